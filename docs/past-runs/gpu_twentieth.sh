#!/usr/bin/env bash
# The twentieth session's GPU runs (#22), one H200: the PyTorch rows of the dynamic-shape benchmark again, now with
# NVML's utilisation over every timed window, so each PyTorch row says what bounds its step (before, only the CuPy
# rows did, from the main thread's time, which misses PyTorch's autograd thread).
#   BA: the four PyTorch workloads (torch_varlen, torch_fixed, resnet_varres, resnet_fixed), their 9 arms, 5
#       interleaved trials on seeds 0-4 (--fresh), until the call's deadline; they replace d07f649's rows in
#       data/dynamic_shapes.csv.
#   BB: BA resumed from the CSV BA returned (carried in build/resume/), if it did not finish; then the held-out
#       PyTorch workloads (torch_varlen_b32, torch_fixed_b32, resnet_varres_b64; PyTorch's two allocators and three
#       expandable rules, 5 interleaved trials, --fresh): data/dynamic_heldout.csv; then the benchmark's GPU test
#       (tests/test_dynamic.py -m gpu: every peer a few steps, NVML on every row) while time is left.
#   BC: the reserve probe again (scripts/gpu_reserve_probe.py --when start,build: both ResNets at varying sizes,
#       seeds 0-4, reserve before anything, after the build, none), now with NVML over each timed window; its rows
#       replace 47d37c6's (stage AA's) in data/reserve_probe.csv.
#   bash docs/past-runs/gpu_twentieth.sh BA    (the commit in .xpool_commit and RMM's wheels in .whl/, carried)
# The stage's CSVs and main log go to $OUT, and all its files as $OUT/<stage>.tgz.
set -uo pipefail
stage=${1:?BA, BB or BC}
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
TORCH=torch_varlen,torch_fixed,resnet_varres,resnet_fixed
bench() {   # bench <seconds> <args...>
    local s=$1; shift
    timeout -k 5 "$s" python3 -m xlab.bench.dynamic "$@" >> "$L/main.log" 2>&1
    echo "bench rc $? ($*)" >> "$L/main.log"
}
if [ "$stage" = BA ]; then
    bench $((560 - SECONDS)) --fresh --out "$L/dynamic_torch.csv" --workloads $TORCH
fi
if [ "$stage" = BB ]; then
    if [ -f build/resume/dynamic_torch.csv ]; then
        cp build/resume/dynamic_torch.csv "$L/"
        bench $((300 - SECONDS)) --out "$L/dynamic_torch.csv" --workloads $TORCH
    fi
    bench $((530 - SECONDS)) --fresh --out "$L/dynamic_heldout.csv" --workloads torch_varlen_b32,torch_fixed_b32,resnet_varres_b64 \
        --arms torch,torch_expandable,xpool_expandable_bounded,xpool_expandable_growth,xpool_expandable_peak
    left=$((585 - SECONDS))
    if [ "$left" -gt 60 ]; then
        timeout -k 5 "$left" python3 -m pytest -q -rxXfs -m gpu tests/test_dynamic.py > "$L/tests.log" 2>&1
        echo "tests rc $?" >> "$L/tests.log"
    else
        echo "tests not run: ${left}s left" > "$L/tests.log"
    fi
fi
if [ "$stage" = BC ]; then
    timeout -k 5 $((570 - SECONDS)) python3 scripts/gpu_reserve_probe.py --fracs 0,1.03 --when start,build \
        --out "$L/reserve_probe.csv" >> "$L/main.log" 2>&1
    echo "probe rc $?" >> "$L/main.log"
fi
tail -c 2500 "$L/main.log"; tail -3 "$L/tests.log" 2>/dev/null
tar czf "$OUT/$stage.tgz" -C build/run "$stage"
cp "$L"/*.csv "$L/main.log" "$OUT"/ 2>/dev/null || true
