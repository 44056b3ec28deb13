#!/usr/bin/env bash
# Every GPU test and measurement of xpool in one call, for a lent GPU machine or your own.
#   bash scripts/gpu_suite.sh [stage ...]      stages: tests bench single ddp memory correctness (default: all)
# CSVs go to data/ (with provenance in every row); the log and a copy of the CSVs go to $OUT (default build/gpu).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/gpu}
mkdir -p "$OUT" data
LOG="$OUT/gpu_suite.log"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# NVLink multicast stays off on shared hosts (see the device notes); NCCL inherits this in every process
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export XPOOL_COMMIT=${XPOOL_COMMIT:-$(cat .xpool_commit 2>/dev/null || git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
stages=${*:-tests bench single ddp memory correctness}
status=0

stage() {   # stage NAME SECONDS CMD...: run with a time limit, log everything, remember failures
    local name=$1 limit=$2; shift 2
    echo "=== $name ($(date -u +%T), limit ${limit}s): $*" | tee -a "$LOG"
    local t0=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: rc=$rc in $((SECONDS - t0))s" | tee -a "$LOG"
    [ "$rc" = 0 ] || status=1
}

{ nvidia-smi -L; python3 -c "import cupy; print('cupy', cupy.__version__, 'cuda', cupy.cuda.runtime.runtimeGetVersion())"; } 2>&1 | tee -a "$LOG"
python3 setup.py build_ext --inplace -q >>"$LOG" 2>&1 || { echo "build failed" | tee -a "$LOG"; exit 1; }

for s in $stages; do
    case $s in
        tests)       stage tests 240 python3 -m pytest -q -p no:warnings -m "gpu or multigpu" tests ;;
        bench)       stage bench 150 python3 -m xpool.bench.alloc --out data/alloc_microbench.csv ;;
        single)      stage single 240 python3 -m xpool.experiments single --out data/single_gpu.csv ;;
        ddp)         stage ddp 300 python3 -m xpool.experiments ddp --out data/ddp_scaling.csv ;;
        memory)      stage memory 120 python3 -m xpool.memory_study --out data ;;
        correctness) stage correctness 180 python3 -m xpool.gpt.checks --gpu --out data/correctness_gpu.csv ;;
        *) echo "unknown stage $s" | tee -a "$LOG"; status=1 ;;
    esac
done

# at most 8 files come back from a lent machine: the log, and the CSVs in one archive
tar czf "$OUT/data.tgz" data/*.csv 2>/dev/null
exit $status
