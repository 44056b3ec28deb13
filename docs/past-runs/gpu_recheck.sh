#!/usr/bin/env bash
# A short re-check after a change to scheme xpool's release rule (#14): the segments' GPU tests and the column
# kernels on GPU 0; the one-GPU experiment at batch 4 and 32 for CuPy's pool and xpool (data/single_gpu_recheck.csv)
# and the memory stage on GPU 1. Logs and CSVs go to $OUT/recheck.tgz.   bash docs/past-runs/gpu_recheck.sh  (~1.5 min)
set -uo pipefail
cd "$(dirname "$0")/../.."
DEST=${OUT:-build/gpu}; W=/tmp/xpool-recheck; mkdir -p "$W" "$DEST"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_SCALE_LAUNCH_QUEUES=4x
python3 setup.py build_ext --inplace -q >"$W/build.log" 2>&1 || { tail -30 "$W/build.log"; exit 1; }
{ CUDA_VISIBLE_DEVICES=0 timeout -s ABRT 120 python3 -X faulthandler -m pytest -q -p no:warnings -m gpu \
      tests/test_gpu_segments.py >"$W/segments.log" 2>&1; echo "rc=$?" >>"$W/segments.log"
  CUDA_VISIBLE_DEVICES=0 timeout 60 python3 scripts/column_kernels.py --out data/column_kernels.csv \
      >"$W/column_kernels.log" 2>&1; echo "rc=$?" >>"$W/column_kernels.log"; } &
CUDA_VISIBLE_DEVICES=1 timeout -s ABRT 100 python3 -X faulthandler -m xlab.experiments single --batches 4 32 \
    --allocators cupy_pool xpool --trials 5 --warmup 5 --no-progress --out data/single_gpu_recheck.csv \
    >"$W/single.log" 2>&1; echo "rc=$?" >>"$W/single.log"
CUDA_VISIBLE_DEVICES=1 timeout -s ABRT 60 python3 -m xlab.memory_study --out data >"$W/memory.log" 2>&1
echo "rc=$?" >>"$W/memory.log"
wait
for f in "$W"/*.log; do echo "== $f"; tail -6 "$f"; done
mkdir -p "$W/csv" && cp data/single_gpu_recheck.csv data/column_kernels.csv data/memory_*.csv "$W/csv/" 2>/dev/null
tar czf "$DEST/recheck.tgz" -C "$W" .
