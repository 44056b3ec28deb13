#!/usr/bin/env bash
# One measurement run of the whole suite on a lent 2-GPU machine in two commands (A1, A2), and a second run on a
# fresh machine for issue #12 (B, into data/rerun). Each command keeps inside SESSION_LIMIT seconds (default 560;
# the device tool stops a command at 600): a stage that would not fit is skipped and the log says so, and the
# tarball of logs and CSVs is always written.
#   bash docs/past-runs/gpu_session.sh A1|A2|B          (OUT: where the tarball goes)
# A1: the gate (the launcher's, cuBLAS path's and fused kernels' GPU tests) on GPU 1 beside the bench on GPU 0;
#     then GPU 1 runs the other GPU tests beside GPU 0's single stage and host profiles (separate processes on a
#     32-core host; arms stay interleaved, so ratios see the same machine); the multi-GPU tests; ddp.  ~6 min
# A2: the GIL probe and the batch sweep on both GPUs; then the fused-kernel drift and the column kernels' GPU
#     time on GPU 0 beside the correctness gate, memory study, debug mode's cost and PyTorch tests on GPU 1. ~7 min
# B:  on a fresh machine: bench and single on GPU 0 beside the PyTorch interop benchmark on GPU 1; ddp in
#     threads mode; the sweep for the pools (raw's cliff is re-measured by ddp).                        ~7 min
# L:  (DATA=data/launch) ddp in threads mode with CuPy's launches, to compare with A1's direct ones.   ~1 min
# (warm() is there for a session that wants the kernel cache filled and the clocks up before timing.)
set -uo pipefail
cd "$(dirname "$0")/../.."
part=${1:?A1, A2, B or L}
DEST=${OUT:-build/gpu}
case $part in B) export DATA=${DATA:-data/rerun} ;; L) export DATA=${DATA:-data/launch} ;; *) export DATA=${DATA:-data} ;; esac
export OUT=/tmp/xpool-$part WARMUP=${WARMUP:-5} DDP_ALLOCATORS=${DDP_ALLOCATORS:-raw cupy_pool xpool}
mkdir -p "$OUT" "$DEST" "$DATA"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1     # scripts/*.py import the packages too
deadline=$((SECONDS + ${SESSION_LIMIT:-560}))
python3 setup.py build_ext --inplace -q >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }

left() { echo $((deadline - SECONDS - 15)); }
suite() {   # suite NAME STAGE...: gpu_suite.sh into $OUT/NAME, cut off at the deadline
    local t; t=$(left)
    if [ "$t" -le 30 ]; then echo "skipped (no time left): $*" | tee -a "$OUT/skipped.log"; return 1; fi
    OUT="$OUT/$1" timeout -s ABRT "$t" bash scripts/gpu_suite.sh "${@:2}"; }
bounded() {   # bounded NAME LIMIT CMD...: one command, its output in $OUT/NAME.log, cut at LIMIT or the deadline
    local name=$1 t; t=$(left); [ "$2" -lt "$t" ] && t=$2; shift 2
    if [ "$t" -le 10 ]; then echo "skipped (no time left): $name" | tee -a "$OUT/skipped.log"; return 1; fi
    timeout -s ABRT "$t" "$@" >"$OUT/$name.log" 2>&1; local rc=$?; echo "$name rc=$rc" >>"$OUT/$name.log"; return $rc; }
warm() {   # compile the kernels into CuPy's cache and wake both GPUs and the host before anything is timed
    for d in 0 1; do CUDA_VISIBLE_DEVICES=$d bounded warm$d 120 python3 -m tapegpt.bench --batch 4 --steps 10 & done
    wait; }
gate() {   # the launcher, cuBLAS path and fused kernels on GPU 1: direct launches only where their tests pass
    CUDA_VISIBLE_DEVICES=1 bounded gate 200 python3 -X faulthandler -m pytest -q -p no:warnings -m gpu \
        tests/test_gpt_launch.py tests/test_gpt_blas.py tests/test_gpt_gpu.py
    local rc=$?; tail -4 "$OUT/gate.log"
    if grep -qE "FAILED tests/test_gpt_gpu.py" "$OUT/gate.log"; then echo "fused kernels fail: stopping"; return 2; fi
    if grep -qE "FAILED tests/test_gpt_launch.py" "$OUT/gate.log"; then
        export TAPEGPT_LAUNCH=cupy; echo "launcher tests fail: TAPEGPT_LAUNCH=cupy for every stage" | tee -a "$OUT/gate.log"
    fi
    [ $rc = 0 ] || echo "gate rc=$rc: see gate.log"; }

case $part in
    A1) CUDA_VISIBLE_DEVICES=0 suite gpu0 bench >/dev/null 2>&1 &
        gate; gated=$?
        wait
        if [ $gated = 0 ]; then
            TESTS_IGNORE="--ignore=tests/test_gpt_launch.py --ignore=tests/test_gpt_blas.py --ignore=tests/test_gpt_gpu.py" \
                CUDA_VISIBLE_DEVICES=1 suite gpu1 tests >/dev/null 2>&1 &
            CUDA_VISIBLE_DEVICES=0 suite gpu0 single >/dev/null 2>&1
            for b in 4 32; do for l in direct cupy; do TAPEGPT_LAUNCH=$l CUDA_VISIBLE_DEVICES=0 bounded \
                profile_b${b}_$l 100 python3 -m tapegpt.bench --profile --batch $b; done; done
            wait
            bounded multigpu 180 python3 -X faulthandler -m pytest -q -p no:warnings -m multigpu tests
            suite both ddp >/dev/null 2>&1
        fi ;;
    A2) suite both gil sweep >/dev/null 2>&1
        CUDA_VISIBLE_DEVICES=1 suite gpu1 correctness memory debugcost torch-tests >/dev/null 2>&1 &
        { CUDA_VISIBLE_DEVICES=0 bounded drift 200 python3 -m tapegpt.bench --drift 50 --out "$DATA/fused_drift.csv"
          CUDA_VISIBLE_DEVICES=0 bounded column_kernels 120 python3 scripts/column_kernels.py \
              --out "$DATA/column_kernels.csv"; }
        wait ;;
    B)  DATA=data suite both gil >/dev/null 2>&1      # the GIL probe's first run (its window fixed after A2)
        CUDA_VISIBLE_DEVICES=1 suite gpu1 torch-bench >/dev/null 2>&1 &
        CUDA_VISIBLE_DEVICES=0 suite gpu0 bench single >/dev/null 2>&1
        wait
        DDP_MODES=threads suite both ddp >/dev/null 2>&1
        SWEEP_ALLOCATORS="cupy_pool xpool" suite both sweep >/dev/null 2>&1 ;;
    L)  # the launchers in threads mode: ddp threads with CuPy's launches (TAPEGPT_LAUNCH=cupy), beside the
        # first run's direct ones, to say what the GIL-held launcher gives two rank threads (not yet measured)
        TAPEGPT_LAUNCH=cupy DDP_MODES=threads DDP_ALLOCATORS="cupy_pool xpool" suite both ddp >/dev/null 2>&1
        cp "$DATA/ddp_scaling.csv" "$DATA/ddp_launch_cupy.csv" 2>/dev/null ;;
    *) echo "unknown part $part (A1 A2 B L)"; exit 2 ;;
esac
for f in "$OUT"/*/gpu_suite.log "$OUT"/*.log; do [ -f "$f" ] && { echo "== $f"; grep -E "^=== |passed|failed|rc=|skipped|fail" "$f" | tail -12; }; done
for f in "$OUT"/profile_*.log; do [ -f "$f" ] && { echo "== $f"; tail -4 "$f"; }; done
mkdir -p "$OUT/csv" && cp "$DATA"/*.csv "$OUT/csv"/ 2>/dev/null
tar czf "$DEST/$part.tgz" -C "$OUT" .
echo "session $part: $SECONDS s"
