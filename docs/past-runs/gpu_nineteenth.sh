#!/usr/bin/env bash
# The nineteenth session's GPU runs (#22), one H200:
#   AA: the reserve on the GPU at this commit (scripts/gpu_reserve_probe.py): the ResNets at varying image sizes
#       through enable_torch()'s pool, plain, with 1.03x their peak reserved before anything, and with the same
#       reserved once the model and its optimizer are made (`pool.reserve` now holds the bytes in use and a free
#       block of the rest); seeds 0-4, the three arms in turn (rotated by seed), each run in its own process, timed.
#   AB: the CuPy workloads of the dynamic-shape benchmark (gpt_b32, gpt_b4, gpt_varlen, cupy_mix) at this commit,
#       every CuPy arm, 5 interleaved trials on seeds 0-4: they replace the rows measured at 6147932 and 89ee811 in
#       data/dynamic_shapes.csv. RESUME=1 continues a CSV left by a call that ran out of time.
#   AC: the expandable scheme's and PyTorch's GPU tests at the session's last code.
#   bash docs/past-runs/gpu_nineteenth.sh AA     (the commit in .xpool_commit and RMM's wheels in .whl/, carried)
# Logs and CSVs go to $OUT/<stage>.tgz, and the stage's CSVs and main log beside it.
set -uo pipefail
stage=${1:?AA}
OUT=${OUT:-build/gpu}
L=$PWD/build/run/$stage    # the stage's files (kept on a warm machine between calls, for RESUME); $OUT gets its
                           # tarball (at most 8 files come back), its CSVs and its main log
mkdir -p "$L" "$OUT"
export PYTHONUNBUFFERED=1 XPOOL_COMMIT=$(cat .xpool_commit) NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$L/pip.log" 2>&1
export PYTHONPATH=$PWD:/tmp/site
python3 setup.py build_ext --inplace > "$L/build.log" 2>&1 || { tail -30 "$L/build.log"; exit 1; }
{ nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv
  python3 -c "import rmm, cupy, torch; print('rmm', rmm.__version__, 'cupy', cupy.__version__, 'torch', torch.__version__)"
  echo "commit $XPOOL_COMMIT"; } > "$L/gpu.txt" 2>&1
if [ "$stage" = AA ]; then
    timeout -k 5 $((565 - SECONDS)) python3 scripts/gpu_reserve_probe.py --fracs 0,1.03 --when start,build \
        --out "$L/reserve_probe.csv" > "$L/main.log" 2>&1
    echo "probe rc $?" >> "$L/main.log"
    tail -32 "$L/main.log"
fi
if [ "$stage" = AB ]; then
    timeout -k 5 $((565 - SECONDS)) python3 -m xlab.bench.dynamic $([ -n "${RESUME:-}" ] || echo --fresh) --out "$L/dynamic_cupy.csv" \
        --workloads gpt_b32,gpt_b4,gpt_varlen,cupy_mix \
        --arms cupy_pool,cupy_async,rmm_pool,cupy_torch_expandable,xpool_segments,xpool_seed,xpool_expandable,xpool_expandable_bounded,xpool_expandable_growth,xpool_expandable_until_churn,xpool_expandable_peak \
        > "$L/main.log" 2>&1
    echo "bench rc $?" >> "$L/main.log"
    tail -c 3500 "$L/main.log"
fi
if [ "$stage" = AC ]; then
    timeout -k 5 $((560 - SECONDS)) python3 -m pytest -q -rxXfs tests/test_gpu_expandable.py tests/test_torch_gpu.py \
        > "$L/main.log" 2>&1
    echo "tests rc $?" >> "$L/main.log"
    tail -12 "$L/main.log"
fi
tar czf "$OUT/$stage.tgz" -C build/run "$stage"
cp "$L"/*.csv "$L/main.log" "$OUT"/ 2>/dev/null || true      # AC writes no CSV
