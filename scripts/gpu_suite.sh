#!/usr/bin/env bash
# Every GPU test and measurement of xpool in one call, for a lent GPU machine or your own.
#   bash scripts/gpu_suite.sh [stage ...]
#   stages: bench single ddp correctness tests memory debugcost (default: all, in that order; about 11 minutes)
#   opt-in: torch (PyTorch and CuPy sharing xpool: its GPU tests, then the interop benchmark; about 5 minutes)
# CSVs go to data/ (provenance in every row) and, after each stage, with the log to $OUT (default build/gpu),
# so a run stopped by a time limit still returns what it finished.  STEPS/WARMUP size the training runs,
# WORLDS the GPU counts of the data-parallel runs (default "1 2"; "1 2 4 8" on an eight-GPU machine),
# XPOOL_ADAMW=foreach the optimizer form (default per_param, the workload as first measured; rows record it).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/gpu}
mkdir -p "$OUT" data
LOG="$OUT/gpu_suite.log"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# NVLink multicast stays off on shared hosts (see the device notes); NCCL inherits this in every process
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export XPOOL_COMMIT=${XPOOL_COMMIT:-$(cat .xpool_commit 2>/dev/null || git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
STEPS=${STEPS:-20}
WARMUP=${WARMUP:-3}
WORLDS=${WORLDS:-1 2}
DDP_LIMIT=${DDP_LIMIT:-$((100 * $(echo $WORLDS | wc -w)))}   # about 100 s per GPU count at the default steps
stages=${*:-bench single ddp correctness tests memory debugcost}
status=0

stage() {   # stage NAME SECONDS CMD...: time-limited (a hang dumps every thread's stack), logged, CSVs copied out
    local name=$1 limit=$2; shift 2
    echo "=== $name ($(date -u +%T), limit ${limit}s): $*" | tee -a "$LOG"
    local t0=$SECONDS
    timeout -s ABRT "$limit" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: rc=$rc in $((SECONDS - t0))s" | tee -a "$LOG"
    cp data/*.csv "$OUT"/ 2>/dev/null
    rm -f "$OUT/corpus.txt"
    [ "$rc" = 0 ] || status=1
    return "$rc"
}

{ nvidia-smi -L; python3 -c "import cupy; print('cupy', cupy.__version__, 'cuda', cupy.cuda.runtime.runtimeGetVersion())"; } 2>&1 | tee -a "$LOG"
python3 setup.py build_ext --inplace -q >>"$LOG" 2>&1 || { echo "build failed" | tee -a "$LOG"; exit 1; }
PY="python3 -X faulthandler"
TRAIN="--steps $STEPS --warmup $WARMUP --no-progress"

for s in $stages; do
    case $s in
        bench)       stage bench 240 $PY -m xlab.bench.alloc --out data/alloc_microbench.csv ||
                     stage bench-peers-only 100 $PY -m xlab.bench.alloc --out data/alloc_microbench.csv \
                         --allocators raw cupy_pool cupy_async xpool xpool_seed xpool_k4 noop ;;
        single)      stage single 150 $PY -m xlab.experiments single $TRAIN --out data/single_gpu.csv ;;
        ddp)         stage ddp "$DDP_LIMIT" $PY -m xlab.experiments ddp $TRAIN --worlds $WORLDS --out data/ddp_scaling.csv ;;
        correctness) stage correctness 180 $PY -m xlab.correctness --gpu --out data/correctness_gpu.csv ;;
        tests)       stage tests 120 $PY -m pytest -q -p no:warnings -m "gpu or multigpu" \
                         tests/test_gpu_pool.py tests/test_gpu_segments.py tests/test_gpt_gpu.py -k "not transparency_gate_raw" ;;
        memory)      stage memory 60 $PY -m xlab.memory_study --out data ;;
        debugcost)   stage debugcost 120 $PY -m xlab.bench.alloc --out data/alloc_debug_cost.csv \
                         --allocators cupy_pool xpool xpool_debug --sizes 4096 1048576 --target-s 0.1 --repeats 3 ;;
        torch)       stage torch-tests 240 $PY -m pytest -q -p no:warnings -m gpu tests/test_torch_gpu.py
                     stage torch-bench 200 $PY -m xlab.bench.torch_interop --out data/torch_interop.csv ;;
        *) echo "unknown stage $s" | tee -a "$LOG"; status=1 ;;
    esac
done
exit $status
