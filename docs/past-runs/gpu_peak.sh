#!/usr/bin/env bash
# The sixteenth session's H200 run (#22, release_on_miss "peak", the new default of the pool enable_torch() makes),
# in two commands on one lent GPU (a command may run 10 minutes):
#   A: build; the expandable scheme's and PyTorch's GPU tests under the new default; then the whole dynamic
#      benchmark (--fresh: every workload and arm, 5 interleaved trials, each its own seed) until A's deadline;
#   B, C: the benchmark resumed from the CSV the call before wrote (carried back into data/ between them);
#   H: the held-out PyTorch workloads (xlab.bench.dynamic's held_out), PyTorch's allocators and three expandable
#      rules, 5 interleaved trials: data/dynamic_heldout.csv.
#   bash docs/past-runs/gpu_peak.sh A|B|C|H     (RMM's wheels in .whl/ and the commit in .xpool_commit, both carried)
# Logs and the CSV go to $OUT/<stage>.tgz.
set -uo pipefail
stage=${1:?A or B}
OUT=${OUT:-build/gpu}
L=$OUT/$stage
mkdir -p "$L"
export PYTHONUNBUFFERED=1 XPOOL_COMMIT=$(cat .xpool_commit)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$L/pip.log" 2>&1
export PYTHONPATH=$PWD:/tmp/site
python3 setup.py build_ext --inplace > "$L/build.log" 2>&1 || { tail -30 "$L/build.log"; exit 1; }
{ nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv
  python3 -c "import rmm, cupy, torch; print('rmm', rmm.__version__, 'cupy', cupy.__version__, 'torch', torch.__version__)"
  echo "commit $XPOOL_COMMIT"; } > "$L/gpu.txt" 2>&1
end=$((SECONDS + ${BUDGET_S:-560}))
csv=data/dynamic_shapes.csv
args=()
if [ "$stage" = A ]; then
    timeout -k 5 200 python3 -m pytest -q -rxXfs tests/test_gpu_expandable.py tests/test_torch_gpu.py > "$L/tests.log" 2>&1
    echo "tests rc $?" >> "$L/tests.log"
    args=(--fresh)
elif [ "$stage" = H ]; then
    csv=data/dynamic_heldout.csv
    args=(--fresh --out "$csv" --workloads torch_varlen_b32,torch_fixed_b32,resnet_varres_b64
          --arms torch,torch_expandable,xpool_expandable_bounded,xpool_expandable_growth,xpool_expandable_peak)
fi
timeout -k 5 $((end - SECONDS)) python3 -m xlab.bench.dynamic "${args[@]}" > "$L/bench.log" 2>&1
echo "bench rc $?" >> "$L/bench.log"
cp "$csv" "$L/"
tar czf "$OUT/$stage.tgz" -C "$OUT" "$stage"
tail -3 "$L/tests.log" 2>/dev/null; tail -c 600 "$L/bench.log"
