#!/usr/bin/env bash
# One lent 2-GPU machine, three commands of at most ~9 minutes (the device tool's limit), everything the report
# needs.  Untimed work (GPU tests, the correctness gate, the memory study) runs on GPU 1 beside the single-GPU
# timings on GPU 0: separate processes on a 32-core host; arms stay interleaved, so ratios see the same machine.
#   bash scripts/gpu_session.sh part1|part2|part3      (OUT: where a tarball of logs and CSVs goes)
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:?part1, part2 or part3}
DEST=${OUT:-build/gpu}
export OUT=/tmp/xpool-$part DATA=${DATA:-data} WARMUP=${WARMUP:-5}   # 5 warm-up steps: pools reach steady state
mkdir -p "$OUT" "$DEST"
python3 setup.py build_ext --inplace -q >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
suite() { OUT="$OUT/$1" bash scripts/gpu_suite.sh "${@:2}"; }
case $part in
    part1)
        CUDA_VISIBLE_DEVICES=1 suite gpu1 tests correctness memory torch-tests >/dev/null 2>&1 &
        CUDA_VISIBLE_DEVICES=0 suite gpu0 bench single
        wait
        OUT=$OUT/multi timeout -s ABRT 180 python3 -m pytest -q -p no:warnings -m multigpu tests \
            >"$OUT/multigpu.log" 2>&1; echo "multigpu rc=$?" >>"$OUT/multigpu.log" ;;
    part2) suite both ddp sweep ;;
    part3)
        CUDA_VISIBLE_DEVICES=0 suite gpu0 torch-bench debugcost
        CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m tapegpt.bench --drift 50 --out "$DATA/fused_drift.csv" \
            >"$OUT/drift.log" 2>&1 ;;
esac
for f in "$OUT"/*/gpu_suite.log "$OUT"/*.log; do [ -f "$f" ] && { echo "== $f"; grep -E "^=== |passed|failed|rc=" "$f" | tail -20; }; done
mkdir -p "$OUT/csv" && cp "$DATA"/*.csv "$OUT/csv"/ 2>/dev/null
tar czf "$DEST/$part.tgz" -C "$OUT" .
