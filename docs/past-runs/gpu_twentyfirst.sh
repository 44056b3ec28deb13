#!/usr/bin/env bash
# The twenty-first session's GPU run (#22), one H200: the CuPy rows of the dynamic-shape benchmark again, now with
# NVML's utilisation over every timed window, as the PyTorch rows have had since the twentieth session (before, the
# CuPy rows' bound came from the main thread's CPU time).
#   BD: the CuPy workloads (gpt_b32, gpt_b4, gpt_varlen, cupy_mix), their 11 arms, 5 interleaved trials on seeds
#       0-4 (--fresh; RESUME=1 continues a CSV left in build/run/BD by a call that ran out of time); they replace
#       47d37c6's rows in data/dynamic_shapes.csv.
#   bash docs/past-runs/gpu_twentyfirst.sh BD    (the commit in .xpool_commit and RMM's wheels in .whl/, carried)
# The stage's CSVs and main log go to $OUT, and all its files as $OUT/<stage>.tgz.
set -uo pipefail
stage=${1:?BD}
OUT=${OUT:-build/gpu}
L=$PWD/build/run/$stage
mkdir -p "$L" "$OUT"
export PYTHONUNBUFFERED=1 XPOOL_COMMIT=$(cat .xpool_commit) NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$L/pip.log" 2>&1
export PYTHONPATH=$PWD:/tmp/site
python3 setup.py build_ext --inplace > "$L/build.log" 2>&1 || { tail -30 "$L/build.log"; exit 1; }
{ nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv
  python3 -c "import rmm, cupy, torch, pynvml; print('rmm', rmm.__version__, 'cupy', cupy.__version__, 'torch', torch.__version__)"
  echo "commit $XPOOL_COMMIT"; } > "$L/gpu.txt" 2>&1
if [ "$stage" = BD ]; then
    timeout -k 5 $((570 - SECONDS)) python3 -m xlab.bench.dynamic $([ -n "${RESUME:-}" ] || echo --fresh) \
        --out "$L/dynamic_cupy.csv" --workloads gpt_b32,gpt_b4,gpt_varlen,cupy_mix \
        --arms cupy_pool,cupy_async,rmm_pool,cupy_torch_expandable,xpool_segments,xpool_seed,xpool_expandable,xpool_expandable_bounded,xpool_expandable_growth,xpool_expandable_until_churn,xpool_expandable_peak \
        >> "$L/main.log" 2>&1
    echo "bench rc $?" >> "$L/main.log"
fi
tail -c 3000 "$L/main.log"
tar czf "$OUT/$stage.tgz" -C build/run "$stage"
cp "$L"/*.csv "$L/main.log" "$OUT"/ 2>/dev/null || true
