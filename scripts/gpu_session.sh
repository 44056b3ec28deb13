#!/usr/bin/env bash
# One measurement run of the whole suite on a lent 2-GPU machine, in two commands of under ~7 minutes each (the
# device tool's limit is 10), and a second run on a fresh machine for issue #12 (DATA=data/rerun).
#   bash scripts/gpu_session.sh A1|A2|B1|B2          (OUT: where a tarball of logs and CSVs goes)
# A1: GPU 1 runs the untimed work (GPU tests, correctness gate, memory study, PyTorch tests) beside GPU 0's
#     timed bench and single stages (separate processes on a 32-core host; arms stay interleaved, so ratios see
#     the same machine); then the multi-GPU tests, the GIL probe and ddp on both GPUs.            ~6 min
# A2: the batch sweep, then the fused-kernel drift and debug mode's cost.                          ~5 min
# B1: on a fresh machine, into data/rerun: bench and single on GPU 0 beside the PyTorch interop benchmark on
#     GPU 1; the GIL probe and ddp.                                                                ~5 min
# B2: the batch sweep, into data/rerun.                                                            ~4 min
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:?A1, A2, B1 or B2}
DEST=${OUT:-build/gpu}
case $part in B*) export DATA=${DATA:-data/rerun} ;; *) export DATA=${DATA:-data} ;; esac
export OUT=/tmp/xpool-$part WARMUP=${WARMUP:-5} DDP_ALLOCATORS=${DDP_ALLOCATORS:-raw cupy_pool xpool}
mkdir -p "$OUT" "$DEST" "$DATA"
python3 setup.py build_ext --inplace -q >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
suite() { OUT="$OUT/$1" bash scripts/gpu_suite.sh "${@:2}"; }
multigpu() { timeout -s ABRT 180 python3 -X faulthandler -m pytest -q -p no:warnings -m multigpu tests \
    >"$OUT/multigpu.log" 2>&1; echo "multigpu rc=$?" >>"$OUT/multigpu.log"; }
case $part in
    A1) CUDA_VISIBLE_DEVICES=1 suite gpu1 tests correctness memory torch-tests >/dev/null 2>&1 &
        CUDA_VISIBLE_DEVICES=0 suite gpu0 bench single
        wait
        multigpu
        suite both gil ddp ;;
    A2) suite both sweep
        CUDA_VISIBLE_DEVICES=1 suite gpu1 debugcost >/dev/null 2>&1 &
        CUDA_VISIBLE_DEVICES=0 timeout 200 python3 -m tapegpt.bench --drift 50 --out "$DATA/fused_drift.csv" \
            >"$OUT/drift.log" 2>&1
        wait ;;
    B1) CUDA_VISIBLE_DEVICES=1 suite gpu1 torch-bench >/dev/null 2>&1 &
        CUDA_VISIBLE_DEVICES=0 suite gpu0 bench single
        wait
        suite both gil ddp ;;
    B2) suite both sweep ;;
    *) echo "unknown part $part (A1 A2 B1 B2)"; exit 2 ;;
esac
for f in "$OUT"/*/gpu_suite.log "$OUT"/*.log; do [ -f "$f" ] && { echo "== $f"; grep -E "^=== |passed|failed|rc=" "$f" | tail -20; }; done
mkdir -p "$OUT/csv" && cp "$DATA"/*.csv "$OUT/csv"/ 2>/dev/null
tar czf "$DEST/$part.tgz" -C "$OUT" .
