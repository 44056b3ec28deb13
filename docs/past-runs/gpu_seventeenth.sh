#!/usr/bin/env bash
# The seventeenth session's GPU runs (#22), one lent host of two H200s:
#   P: build; which cross-GPU uses of pool memory work under each scheme (scripts/gpu_peer_probe.py: NCCL in
#      threads and in processes, CuPy kernels and copies, PyTorch copies); then the GPU traces of the held-out
#      language model at batch 32 (seeds 0-4), the held-out fixed-length model, and gpt_varlen's other
#      realizations, for replay on the CPU.
#   Q: after peer access (peer_access "all"): the expandable scheme's and PyTorch's GPU tests (the two-GPU cases
#      included), then the probe again under peer_access "all" (the default) and "none", with the map cost.
#   R: after the churn stop of "peak" and peer access: the GPU tests again, the probe under peer_access "all" and
#      "none" with the map cost, the held-out language model at batch 32 under PyTorch's allocators and the three
#      expandable rules (5 interleaved trials, seeds 0-4; data/dynamic_heldout_b32.csv), and the traces of the
#      held-out ResNet at batch 64 (seeds 0-4) for replay on the CPU.
#   S: the CuPy loop (cupy_mix) again under every arm (5 interleaved trials, seeds 0-4;
#      data/dynamic_cupy_mix_rerun.csv), whose "peak" rows the churn stop changes (by the replays of its traces).
#   bash docs/past-runs/gpu_seventeenth.sh P     (the commit in .xpool_commit, RMM's wheels in .whl/, both carried)
# Logs and CSVs go to $OUT/<stage>.tgz.
set -uo pipefail
stage=${1:?P}
OUT=${OUT:-build/gpu}
L=$OUT/$stage
mkdir -p "$L"
export PYTHONUNBUFFERED=1 XPOOL_COMMIT=$(cat .xpool_commit) NCCL_NVLS_ENABLE=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    > "$L/pip.log" 2>&1
export PYTHONPATH=$PWD:/tmp/site
python3 setup.py build_ext --inplace > "$L/build.log" 2>&1 || { tail -30 "$L/build.log"; exit 1; }
{ nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv; nvidia-smi topo -m
  python3 -c "import rmm, cupy, torch; print('rmm', rmm.__version__, 'cupy', cupy.__version__, 'torch', torch.__version__)"
  echo "commit $XPOOL_COMMIT"; } > "$L/gpu.txt" 2>&1
if [ "$stage" = P ]; then
    timeout -k 5 200 python3 scripts/gpu_peer_probe.py --out "$L/peer_probe.csv" > "$L/peer.log" 2>&1
    echo "peer rc $?" >> "$L/peer.log"
    mkdir -p "$L/traces"
    timeout -k 5 300 python3 scripts/record_dynamic_traces.py --out "$L/traces" --workloads torch_varlen_b32 \
        --seeds 0,1,2,3,4 > "$L/traces.log" 2>&1
    timeout -k 5 60 python3 scripts/record_dynamic_traces.py --out "$L/traces" --workloads torch_fixed_b32 \
        >> "$L/traces.log" 2>&1
    timeout -k 5 80 python3 scripts/record_dynamic_traces.py --out "$L/traces" --workloads gpt_varlen \
        --seeds 1,2,3,4 >> "$L/traces.log" 2>&1
    echo "traces rc $?" >> "$L/traces.log"
fi
if [ "$stage" = R ]; then
    timeout -k 5 170 python3 -m pytest -q -rxXfs tests/test_gpu_expandable.py tests/test_torch_gpu.py > "$L/tests.log" 2>&1
    echo "tests rc $?" >> "$L/tests.log"
    if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then      # the probe needs two GPUs
        timeout -k 5 120 python3 scripts/gpu_peer_probe.py --out "$L/peer_probe.csv" --peer-accesses 'null;"none"' \
            --map-cost "$L/peer_map_cost.csv" > "$L/peer.log" 2>&1
        echo "peer rc $?" >> "$L/peer.log"
    fi
    timeout -k 5 290 python3 -m xlab.bench.dynamic --fresh --out "$L/dynamic_heldout_b32.csv" --workloads torch_varlen_b32 \
        --arms torch,torch_expandable,xpool_expandable_bounded,xpool_expandable_growth,xpool_expandable_peak \
        > "$L/bench.log" 2>&1
    echo "bench rc $?" >> "$L/bench.log"
    mkdir -p "$L/traces"
    left=$((570 - SECONDS)); [ "$left" -lt 10 ] && left=10
    timeout -k 5 "$left" python3 scripts/record_dynamic_traces.py --out "$L/traces" \
        --workloads resnet_varres_b64 --seeds 0,1,2,3,4 > "$L/traces.log" 2>&1
    echo "traces rc $?" >> "$L/traces.log"
    tail -3 "$L/tests.log"; tail -4 "$L/peer.log"; tail -c 1500 "$L/bench.log"; tail -6 "$L/traces.log"
fi
if [ "$stage" = S ]; then
    timeout -k 5 520 python3 -m xlab.bench.dynamic --fresh --out "$L/dynamic_cupy_mix.csv" --workloads cupy_mix \
        > "$L/bench.log" 2>&1
    echo "bench rc $?" >> "$L/bench.log"
    tail -c 2500 "$L/bench.log"
fi
if [ "$stage" = Q ]; then
    timeout -k 5 330 python3 -m pytest -q -rxXfs tests/test_gpu_expandable.py tests/test_torch_gpu.py > "$L/tests.log" 2>&1
    echo "tests rc $?" >> "$L/tests.log"
    timeout -k 5 200 python3 scripts/gpu_peer_probe.py --out "$L/peer_probe.csv" --peer-accesses 'null;"none"' \
        --map-cost "$L/peer_map_cost.csv" > "$L/peer.log" 2>&1
    echo "peer rc $?" >> "$L/peer.log"
    tail -5 "$L/tests.log"
fi
tar czf "$OUT/$stage.tgz" -C "$OUT" "$stage"
cat "$L/peer.log" 2>/dev/null | cut -c1-400; tail -15 "$L/traces.log" 2>/dev/null
