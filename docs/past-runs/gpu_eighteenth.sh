#!/usr/bin/env bash
# The eighteenth session's GPU runs (#22), one lent host of two H200s:
#   V: build; the cross-GPU probe at this commit (scripts/gpu_peer_probe.py: NCCL in threads and in processes,
#      CuPy kernels and copies, PyTorch copies; peer_access default and "none"), with what peer access costs a
#      one-page miss; the two-GPU tests of the expandable scheme; then threads and processes on 1 and 2 GPUs,
#      batch 32, 5 interleaved trials (xlab.experiments ddp) under raw, CuPy's pool, xpool's default (segments) and
#      the expandable scheme: the measurement on several GPUs that the CuPy default was waiting for.
#   W: the four PyTorch workloads of the dynamic-shape benchmark at this commit (peer access on, the churn stop of
#      "peak"), every PyTorch-capable arm, 5 interleaved trials on seeds 0-4: they replace the rows of
#      data/dynamic_shapes.csv measured at 6147932.
#   X: the six notebooks on one GPU through papermill, each measuring with small parameters (a smoke run of the
#      measuring path, not numbers to quote), publish=False: they must finish, and change no committed file.
#   Y: the reserve recipe on the GPU (scripts/gpu_reserve_probe.py): the ResNets at varying image sizes through
#      enable_torch()'s pool, plain and with 1.03x their peak reserved first, seeds 0-4, each run in its own process.
#   Z: the same through `pool.reserve` (the API landed after Y), 1.03x only, seeds 0-4.
#   bash docs/past-runs/gpu_eighteenth.sh V     (the commit in .xpool_commit, carried; X: .whl carried too, with
#   RMM's wheels in .whl/ and papermill's and ipykernel's for Python 3.12 in .whl/pm/:
#   pip download papermill ipykernel --python-version 3.12 --platform manylinux_2_28_x86_64 --only-binary=:all: -d .whl/pm)
# Logs and CSVs go to $OUT/<stage>.tgz.
set -uo pipefail
stage=${1:?V}
OUT=${OUT:-build/gpu}
L=/tmp/gpu/$stage          # the stage's files; $OUT gets its tarball (at most 8 files come back) and its main log
mkdir -p "$L" "$OUT"
export PYTHONUNBUFFERED=1 XPOOL_COMMIT=$(cat .xpool_commit) NCCL_NVLS_ENABLE=0 PYTHONPATH=$PWD
python3 setup.py build_ext --inplace > "$L/build.log" 2>&1 || { tail -30 "$L/build.log"; exit 1; }
{ nvidia-smi --query-gpu=name,driver_version,memory.used --format=csv; nvidia-smi topo -m
  python3 -c "import cupy, torch; print('cupy', cupy.__version__, 'torch', torch.__version__)"
  echo "commit $XPOOL_COMMIT"; } > "$L/gpu.txt" 2>&1
if [ "$stage" = V ]; then
    timeout -k 5 170 python3 scripts/gpu_peer_probe.py --out "$L/peer_probe.csv" --peer-accesses 'null;"none"' \
        --map-cost "$L/peer_map_cost.csv" > "$L/peer.log" 2>&1
    echo "peer rc $?" >> "$L/peer.log"
    timeout -k 5 90 python3 -m pytest -q -rxXfs tests/test_gpu_expandable.py \
        -k "another_gpu or peer_access_none or nccl" > "$L/tests.log" 2>&1
    echo "tests rc $?" >> "$L/tests.log"
    left=$((575 - SECONDS)); [ "$left" -lt 10 ] && left=10
    timeout -k 5 "$left" python3 -X faulthandler -m xlab.experiments ddp --trials 5 --no-progress --worlds 1 2 \
        --allocators raw cupy_pool xpool xpool_expandable --out "$L/ddp_expandable.csv" ${RESUME:+--resume} \
        > "$L/ddp.log" 2>&1
    echo "ddp rc $?" >> "$L/ddp.log"
    tail -4 "$L/peer.log"; tail -4 "$L/tests.log"; tail -c 2500 "$L/ddp.log"
fi
if [ "$stage" = W ]; then
    left=$((575 - SECONDS))
    timeout -k 5 "$left" python3 -m xlab.bench.dynamic ${RESUME:---fresh} --out "$L/dynamic_torch.csv" \
        --workloads torch_varlen,torch_fixed,resnet_varres,resnet_fixed \
        --arms torch,torch_expandable,xpool_segments,xpool_seed,xpool_expandable,xpool_expandable_bounded,xpool_expandable_growth,xpool_expandable_until_churn,xpool_expandable_peak \
        > "$L/bench.log" 2>&1
    echo "bench rc $?" >> "$L/bench.log"
    tail -c 3000 "$L/bench.log"
fi
if [ "$stage" = Y ]; then
    timeout -k 5 $((570 - SECONDS)) python3 scripts/gpu_reserve_probe.py --out "$L/reserve_probe.csv" > "$L/probe.log" 2>&1
    echo "probe rc $?" >> "$L/probe.log"
    cp "$L/probe.log" "$L/nb.log"       # the log that comes back beside the tarball
    tail -25 "$L/probe.log"
fi
if [ "$stage" = Z ]; then
    timeout -k 5 200 python3 scripts/gpu_reserve_probe.py --fracs 1.03 --recipe pool.reserve \
        --out "$L/reserve_probe_api.csv" > "$L/probe.log" 2>&1
    echo "probe rc $?" >> "$L/probe.log"
    cp "$L/probe.log" "$L/nb.log"
    tail -15 "$L/probe.log"
fi
if [ "$stage" = X ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        > "$L/pip.log" 2>&1
    python3 -m pip install -q --no-index --find-links .whl/pm papermill ipykernel >> "$L/pip.log" 2>&1
    export PYTHONPATH=$PWD:/tmp/site
    sums() { find data figures notebooks report -type f | sort | xargs sha256sum; }
    sums > "$L/before.sha"
    mkdir -p "$L/nb"
    nb() {      # nb NAME LIMIT ARGS...: one notebook, time-limited by what is left of 570 s
        local name=$1 limit=$2; shift 2
        local left=$((570 - SECONDS)); [ "$left" -lt "$limit" ] && limit=$left
        [ "$limit" -lt 10 ] && { echo "$name: skipped (no time left)" >> "$L/nb.log"; return; }
        local t0=$SECONDS
        timeout -k 5 "$limit" python3 -m papermill --no-progress-bar -k python3 "notebooks/$name.ipynb" "$L/nb/$name.ipynb" "$@" \
            > "$L/nb/$name.log" 2>&1
        echo "$name: rc $? in $((SECONDS - t0)) s" >> "$L/nb.log"
    }
    nb 01_correctness 120 -p transparency_steps 10
    nb 02_allocator_microbench 90 -p quick True
    nb 03_single_gpu 90 -p steps 4 -p warmup 2 -p trials 1 -y "batches: [4]"
    nb 05_memory 60 -y "ks: [1]"
    nb 04_multi_gpu 120 -y "worlds: [1]" -p trials 1 -p steps 3 -p sweep False -p graph False
    nb 06_dynamic_shapes 200 -p quick True
    sums > "$L/after.sha"
    { echo "committed files changed by the runs:"; diff "$L/before.sha" "$L/after.sha" && echo none; } >> "$L/nb.log"
    cat "$L/nb.log"; tail -3 "$L/pip.log"
fi
tar czf "$OUT/$stage.tgz" -C /tmp/gpu "$stage"
cp "$L"/*.csv "$L/nb.log" "$OUT"/ 2>/dev/null
cat "$L/peer.log" 2>/dev/null | cut -c1-300 | tail -30
