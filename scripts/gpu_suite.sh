#!/usr/bin/env bash
# Every GPU test and measurement of xpool, by stage, for a lent GPU machine or your own.
#   bash scripts/gpu_suite.sh [stage ...]        (default: every stage, in the order below)
#
# stage        what                                                     expected (2x H200)   limit
# tests        every test marked gpu or multigpu (not test_torch_gpu)   ~5 min               330 s
# bench        allocator microbenchmark, 7 trials, arms take turns        ~2 min               150 s
# single       one GPU, batch 32 and 4, 4 allocators x 5 trials         ~1.5 min             150 s
# ddp          threads and processes on 1 and 2 GPUs, batch 32, x 5     ~3.5 min             130 s per GPU count
# correctness  the correctness gate on CuPy, bitwise transparency       ~1 min               150 s
# debugcost    debug mode's cost per pair on the GPU                    ~0.5 min              60 s
# memory       memory study (waste per class setting; varying lengths)  ~1 min               120 s
# sweep        threads on 1 and 2 GPUs, batch 4..128, 3 allocators x 5  ~4 min               330 s
# gil          GIL probe: ops/s of 1, 2, 4, 8 dispatching threads        ~0.7 min              90 s
# hit          opt-in: the hit path's breakdown (xlab.bench.hit), then the size sweep of the cached arms only,
#              11 trials (alloc_hit_sweep.csv)                           ~1.2 min             150 s
# split        opt-in (#20): the size sweep of the cached arms with the build before beside this one (BEFORE: a
#              checkout of it, e.g. `git archive 009e8f9 xpool setup.py pyproject.toml README.md`; built here),
#              11 trials interleaved (core_split_gpu.csv)                ~1.5 min             150 s
# torch        opt-in, not in the default list: PyTorch and CuPy sharing xpool, its GPU tests then the interop
#              benchmark (its 200 s ran out on an H100 at db0b678 and f5a602a)   ~7 min   660 s
# expandable   opt-in: the expandable scheme's GPU tests (tests/lab/test_gpu_expandable.py, PyTorch's included),
#              then the capture-legality probe (xlab.bench.vmm_capture: vmm_capture_probe.csv)   ~3 min   300 s
# dynamic      opt-in: the dynamic-shape benchmark (xlab.bench.dynamic: dynamic_shapes.csv), every workload and arm;
#              it outlasts one 9-minute command: run the stage again to resume it          ~11 min   540 s a call
# heldout      opt-in: its held-out PyTorch workloads (dynamic_heldout.csv), resumable as dynamic      540 s
# scale-caps   opt-in (#46): each arm's memory cap on the GPU, an arm a process (tests/lab/test_dynamic_scale.py's
#              GPU test: three or four 64 MiB blocks under 256 MiB, then an error is_oom knows)   ~1 min   120 s
# scale        opt-in (#46): the dynamic workloads at 33-40 GiB requested, then under caps of 1.05x, 1.10x, 1.25x
#              their peak requested (xlab.bench.dynamic_scale: dynamic_scale.csv, memory_cap.csv), 7 CuPy and 5
#              PyTorch arms x 5 trials (TRIALS, CAPS); ~17 min estimated (Note [Scaled runs]): run the stage again
#              to resume it, two or three calls. RMM is not in the device image: `bash scripts/fetch_wheels.sh`
#              first, and carry .whl (the suite installs it), or its arm is skipped. With scale-caps in one
#              call: SCALE_LIMIT=420 bash scripts/gpu_suite.sh scale-caps scale            ~17 min   540 s a call
# traces       opt-in: the request traces of the dynamic workloads for the CPU replays (xlab.bench.dynamic_traces:
#              data/memory_trace_dyn_<workload>.csv.gz; SEEDS, default 0, e.g. SEEDS=1,2,3,4; TRACE_WORKLOADS,
#              default the benchmark's, e.g. cupy_image,cupy_fill)                                   540 s
# reserve      opt-in: pool.reserve on the ResNets at varying sizes (xlab.bench.reserve: reserve_probe.csv) 540 s
# growth       opt-in (#49): growing to ~28 GB in 1,500 kept requests (xlab.bench.growth: growth.csv), xpool
#              expandable and segments, PyTorch's expandable segments, cudaMallocAsync's pool, CuPy's pool, a process
#              per trial and arm, 5 trials interleaved (TRIALS); needs ~30 GB free on GPU 0       ~1.5 min   150 s
# peer         opt-in, two GPUs: cross-GPU uses of pool memory (xlab.bench.peer: peer_probe.csv; the map
#              cost under each peer_access, peer_map_cost.csv, needed the setting: tag record-2026-12-05)   420 s
# (expected times from the H200 step times at 70fd21b, before the fused kernels: 90 ms per batch-32 step, 48 ms
# per batch-4 step, raw about 4x; the fused kernels shorten the host-bound ones.)
#
# Within a 9-minute limit per command, three commands keep every command under it even if every stage runs to
# its limit (about 17 minutes expected in all):
#   bash scripts/gpu_suite.sh tests bench                           # limits 480 s, ~7 min expected
#   bash scripts/gpu_suite.sh single ddp correctness debugcost      # limits 520 s, ~6.5 min expected
#   bash scripts/gpu_suite.sh memory sweep                          # limits 450 s, ~6 min expected
# A stage stopped by its limit keeps what it finished (its CSV is rewritten after every run); finish it later
# with RESUME=1 bash scripts/gpu_suite.sh STAGE (single, ddp, sweep: only the missing trials run; never fewer).
# Each stage writes its own CSV in data/ (every row: GPU, driver, CUDA, CuPy, commit, date and the run's
# parameters) and copies it (the CSVs it wrote, no others), with the stage's log, to $OUT (default build/gpu) as soon
# as it ends.
# Knobs: TRIALS (default 5), BENCH_TRIALS (bench; default 7), STEPS/WARMUP (single and ddp), WORLDS (ddp; default
# "1 2", "1 2 4 8" on eight GPUs), DDP_ALLOCATORS and DDP_MODES (ddp; default: single's allocators, both modes),
# SWEEP_ALLOCATORS (sweep; default raw, cupy_pool, xpool), CAPS (scale; default 1.05,1.1,1.25), SCALE_LIMIT (scale's
# seconds, default 540),
# DYN_WORKLOADS (dynamic; default every workload, e.g. cupy_image,cupy_fill), RESUME=1, XPOOL_ADAMW (default foreach, the flat-buffer AdamW; rows record it), DATA (default data; DATA=data/rerun
# for the second run on a fresh machine: the report checks its ratios against the first run's intervals).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-build/gpu}
DATA=${DATA:-data}       # data/rerun for the second run on a fresh machine (issue #12; the report compares them)
mkdir -p "$OUT" "$DATA"
LOG="$OUT/gpu_suite.log"
# the packages from this checkout, installed or not: xpool (the root), xlab (lab/), tapegpt (workload/), and the
# host twin xpool_twin (twin/: the host doubles and xpool_twin.testing, for the tests and the replays)
# (after them, the caller's PYTHONPATH: packages installed beside the image's, RMM's wheels for the scale stage)
export PYTHONPATH=$PWD:$PWD/lab:$PWD/workload:$PWD/twin${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# NVLink multicast stays off on shared hosts (see the device notes); NCCL inherits this in every process
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# a deeper launch queue (CUDA 12.8+; ignored before): a launch that finds it full blocks, with the GIL held when
# tapegpt.launch makes it (the training loops keep two steps in flight at most, far below either depth)
export CUDA_SCALE_LAUNCH_QUEUES=${CUDA_SCALE_LAUNCH_QUEUES:-4x}
# the commit every row records: $XPOOL_COMMIT, else .xpool_commit (git ignores it), else the checkout's HEAD. A lent
# device machine's copy of the tree keeps the git HEAD the working copy began from, not the tree's: before such a
# run write `git rev-parse --short=12 HEAD > .xpool_commit` and carry it (runs/README.md)
export XPOOL_COMMIT=${XPOOL_COMMIT:-$(cat .xpool_commit 2>/dev/null || git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)}
TRIALS=${TRIALS:-5}
STEPS=${STEPS:-}
WARMUP=${WARMUP:-}
WORLDS=${WORLDS:-1 2}
DDP_LIMIT=${DDP_LIMIT:-$((130 * $(echo $WORLDS | wc -w)))}   # about 130 s per GPU count at the defaults
stages=${*:-tests bench single ddp correctness debugcost memory sweep}
status=0

stage() {   # stage NAME SECONDS CMD...: time-limited (a hang dumps every thread's stack), logged, CSVs copied out
    local name=$1 limit=$2; shift 2
    echo "=== $name ($(date -u +%T), limit ${limit}s): $*" | tee -a "$LOG"
    local t0=$SECONDS stamp="$OUT/.start_$name"
    touch "$stamp"
    timeout -s ABRT "$limit" "$@" 2>&1 | tee "$OUT/$name.log" >>"$LOG"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: rc=$rc in $((SECONDS - t0))s" | tee -a "$LOG"
    tail -n 25 "$OUT/$name.log"
    find "$DATA" -name '*.csv' -newer "$stamp" -exec cp {} "$OUT"/ \;   # the CSVs this stage wrote, no others
    rm -f "$stamp"
    [ "$rc" = 0 ] || status=1
    return "$rc"
}

# RMM's wheels: not in the device image, and the device reaches no registry. scripts/fetch_wheels.sh downloads them
# into .whl/ (git ignores it) on a machine that does; carry .whl to the device, and they go on PYTHONPATH here
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-deps --target "${WHEEL_SITE:-/tmp/xpool_wheels}" .whl/*.whl >>"$LOG" 2>&1 &&
        export PYTHONPATH=$PYTHONPATH:${WHEEL_SITE:-/tmp/xpool_wheels} ||
        echo "wheels in .whl/ did not install (RMM's arms will be skipped)" | tee -a "$LOG"
fi
{ nvidia-smi -L; python3 -c "import cupy; print('cupy', cupy.__version__, 'cuda', cupy.cuda.runtime.runtimeGetVersion())"; } 2>&1 | tee -a "$LOG"
{ python3 setup.py build_ext --inplace -q && (cd lab && python3 setup.py build_ext --inplace -q) &&
  (cd twin && python3 setup.py build_ext --inplace -q); } >>"$LOG" 2>&1 ||
    { echo "build failed" | tee -a "$LOG"; exit 1; }
PY="python3 -X faulthandler"
RESUME=${RESUME:-}
TRAIN="--trials $TRIALS --no-progress ${STEPS:+--steps $STEPS} ${WARMUP:+--warmup $WARMUP} ${RESUME:+--resume}"

for s in $stages; do
    case $s in
        tests)       stage tests 330 $PY -m pytest -q -p no:warnings -m "gpu or multigpu" tests \
                         -k "not transparency_gate_raw" --ignore=tests/lab/test_torch_gpu.py \
                         --ignore=tests/lab/test_gpu_expandable.py --ignore=tests/lab/test_dynamic_scale.py \
                         ${TESTS_IGNORE:-} ;;
        bench)       stage bench 150 $PY -m xlab.bench.alloc --trials "${BENCH_TRIALS:-7}" --out "$DATA"/alloc_microbench.csv ;;
        single)      stage single 150 $PY -m xlab.experiments single $TRAIN --out "$DATA"/single_gpu.csv ;;
        correctness) stage correctness 150 $PY -m xlab.correctness --gpu --out "$DATA"/correctness_gpu.csv ;;
        debugcost)   stage debugcost 60 $PY -m xlab.bench.alloc --out "$DATA"/alloc_debug_cost.csv --trials 3 \
                         --allocators cupy_pool xpool_k1 xpool_k1_debug --sizes 4096 1048576 --target-s 0.05 ;;
        ddp)         stage ddp "$DDP_LIMIT" $PY -m xlab.experiments ddp $TRAIN --worlds $WORLDS \
                         ${DDP_ALLOCATORS:+--allocators $DDP_ALLOCATORS} ${DDP_MODES:+--modes $DDP_MODES} \
                         --out "$DATA"/ddp_scaling.csv ;;
        sweep)       stage sweep 330 $PY -m xlab.experiments sweep --trials "$TRIALS" --no-progress \
                         ${SWEEP_ALLOCATORS:+--allocators $SWEEP_ALLOCATORS} ${RESUME:+--resume} \
                         --out "$DATA"/batch_sweep.csv ;;
        memory)      stage memory 120 $PY -m xlab.memory_study --out "$DATA" ;;
        gil)         stage gil 90 $PY -m xlab.bench.gil --trials "$TRIALS" --seconds 0.25 \
                         --arms python launch launch_gil add gemm gemm_gil --out "$DATA"/gil_probe.csv ;;
        hit)         stage hit 70 $PY -m xlab.bench.hit --out "$DATA"/hit_breakdown.csv
                     stage hit-sweep 80 $PY -m xlab.bench.alloc --sweep size --trials 11 \
                         --allocators cupy_pool xpool xpool_seed c_noop noop --out "$DATA"/alloc_hit_sweep.csv ;;
        split)       [ -n "${BEFORE:-}" ] || { echo "split: set BEFORE to a checkout of the commit before" | tee -a "$LOG"; status=1; continue; }
                     (cd "$BEFORE" && python3 setup.py build_ext --inplace -q) >>"$LOG" 2>&1 || { echo "split: BEFORE did not build" | tee -a "$LOG"; status=1; continue; }
                     stage split 150 $PY -m xlab.bench.alloc --sweep size --trials 11 --xpool-path "$BEFORE" \
                         --allocators cupy_pool xpool xpool_seed xpool_expandable c_noop --out "$DATA"/core_split_gpu.csv ;;
        torch-tests) stage torch-tests 240 $PY -m pytest -q -p no:warnings -m gpu tests/lab/test_torch_gpu.py ;;
        torch-bench) stage torch-bench 420 $PY -m xlab.bench.torch_interop --out "$DATA"/torch_interop.csv ;;
        torch)       stage torch-tests 240 $PY -m pytest -q -p no:warnings -m gpu tests/lab/test_torch_gpu.py
                     stage torch-bench 420 $PY -m xlab.bench.torch_interop --out "$DATA"/torch_interop.csv ;;
        expandable)  stage expandable 240 $PY -m pytest -q -p no:warnings -m gpu tests/lab/test_gpu_expandable.py
                     stage vmm-capture 90 $PY -m xlab.bench.vmm_capture --out "$DATA" ;;
        dynamic)     stage dynamic 540 $PY -m xlab.bench.dynamic ${DYN_WORKLOADS:+--workloads "$DYN_WORKLOADS"} \
                         --out "$DATA"/dynamic_shapes.csv ;;
        heldout)     stage heldout 540 $PY -m xlab.bench.dynamic --workloads torch_varlen_b32,torch_fixed_b32,resnet_varres_b64 \
                         --out "$DATA"/dynamic_heldout.csv ;;
        scale-caps)  stage scale-caps 120 $PY -m pytest -q -p no:warnings -m gpu tests/lab/test_dynamic_scale.py ;;
        scale)       stage scale "${SCALE_LIMIT:-540}" $PY -m xlab.bench.dynamic_scale --trials "$TRIALS" ${CAPS:+--caps "$CAPS"} \
                         --out "$DATA"/dynamic_scale.csv --cap-out "$DATA"/memory_cap.csv ;;
        traces)      stage traces 540 $PY -m xlab.bench.dynamic_traces --seeds "${SEEDS:-0}" --out "$DATA" \
                         ${TRACE_WORKLOADS:+--workloads "$TRACE_WORKLOADS"} ;;
        reserve)     stage reserve 540 $PY -m xlab.bench.reserve --when start,build --out "$DATA"/reserve_probe.csv ;;
        growth)      stage growth 150 $PY -m xlab.bench.growth --trials "$TRIALS" --out "$DATA"/growth.csv ;;
        peer)        stage peer 420 $PY -m xlab.bench.peer --out "$DATA"/peer_probe.csv ;;
        *) echo "unknown stage $s (stages: tests bench single correctness debugcost ddp sweep memory gil hit split torch torch-tests torch-bench expandable dynamic heldout scale-caps scale traces reserve growth peer)" | tee -a "$LOG"
           status=1 ;;
    esac
done
exit $status
