#!/usr/bin/env bash
# CUDA-graph steps (issue 13) on a lent 2-GPU machine, in one command; logs and CSVs into $OUT/graph-<part>.tgz.
#   bash docs/past-runs/gpu_graph.sh probe     (~6 min) the graph's GPU tests and the segments' (release_idle, #14) on
#       GPU 0 beside the one-GPU recheck of scheme xpool on GPU 1; a first timing of the graph arms (3 trials, one
#       GPU and threads on two); ddp threads with CuPy's launches (the launcher's share, `gpu_session.sh L`).
#   bash docs/past-runs/gpu_graph.sh measure   (~8 min) the graph arms beside the eager ones, 5 trials interleaved:
#       one GPU at batch 32 and (250 steps) at batch 4; threads on 2 GPUs at batch 32.
#   bash docs/past-runs/gpu_graph.sh measure2  (~6 min) processes on 2 GPUs for xpool and xpool_graph; the batch sweep
#       for xpool_graph; then $BENCH_CMD if set (its CSVs named in $BENCH_CSV).
#   GDATA=data/graph/rerun bash docs/past-runs/gpu_graph.sh measure: the same on a fresh machine, into data/graph/rerun.
#   bash docs/past-runs/gpu_graph.sh final     (~8 min) the alloc+free sweep and hit-path breakdown (#14), every GPU test.
set -uo pipefail
cd "$(dirname "$0")/../.."
part=${1:?probe, measure, measure2 or final}
DEST=${OUT:-build/gpu}; W=/tmp/xpool-graph-$part; mkdir -p "$W" "$DEST"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 CUDA_SCALE_LAUNCH_QUEUES=4x
deadline=$((SECONDS + ${SESSION_LIMIT:-570}))
python3 setup.py build_ext --inplace -q >"$W/build.log" 2>&1 || { tail -30 "$W/build.log"; exit 1; }
{ nvidia-smi -L; git log -1 --oneline 2>/dev/null; echo "XPOOL_COMMIT=${XPOOL_COMMIT:-}"; } >"$W/machine.log" 2>&1
bounded() {   # bounded NAME LIMIT CMD...: one command, output in $W/NAME.log, cut at LIMIT or the deadline
    local name=$1 t=$((deadline - SECONDS - 20)); [ "$2" -lt "$t" ] && t=$2; shift 2
    if [ "$t" -le 10 ]; then echo "skipped (no time left): $name" | tee -a "$W/skipped.log"; return 1; fi
    local t0=$SECONDS
    timeout -s ABRT "$t" "$@" >"$W/$name.log" 2>&1; local rc=$?
    echo "$name rc=$rc in $((SECONDS - t0))s" | tee -a "$W/$name.log" "$W/summary.log"; return $rc; }
PY="python3 -X faulthandler"
G=${GDATA:-data/graph}     # where the measure stages write (GDATA=data/graph/rerun: a second run)
X="$PY -m xlab.experiments"
case $part in
    probe)
        { CUDA_VISIBLE_DEVICES=0 bounded gpu_tests 200 $PY -m pytest -q -p no:warnings -m gpu \
              tests/test_gpu_graph.py tests/test_gpu_segments.py
          CUDA_VISIBLE_DEVICES=0 bounded column_kernels 60 $PY scripts/column_kernels.py --out data/column_kernels.csv; } &
        CUDA_VISIBLE_DEVICES=1 bounded recheck 100 $X single --batches 4 32 --allocators cupy_pool xpool --trials 5 \
            --warmup 5 --no-progress --out data/single_gpu_recheck.csv
        CUDA_VISIBLE_DEVICES=1 bounded memory 60 $PY -m xlab.memory_study --out data
        wait
        bounded graph_single 120 $X single --batches 4 32 --allocators xpool xpool_graph cupy_pool_graph --trials 3 \
            --warmup 3 --no-progress --out data/graph_probe_single.csv
        bounded graph_threads 120 $X ddp --modes threads --worlds 1 2 --allocators xpool xpool_graph --trials 3 \
            --warmup 3 --no-progress --out data/graph_probe_ddp.csv
        mkdir -p data/launch
        TAPEGPT_LAUNCH=cupy bounded launch_cupy 120 $X ddp --modes threads --worlds 1 2 --allocators cupy_pool xpool \
            --trials 5 --warmup 5 --no-progress --out data/launch/ddp_launch_cupy.csv
        CSV="data/single_gpu_recheck.csv data/column_kernels.csv data/memory_*.csv data/graph_probe_*.csv data/launch" ;;
    measure)
        # one GPU: batch 32 on GPU 0 beside batch 4 on GPU 1 (250 steps: a window of seconds, which NVML's
        # utilisation needs; 10 steps of a graph at batch 4 last 80 ms, shorter than NVML's sample period)
        mkdir -p $G
        CUDA_VISIBLE_DEVICES=0 bounded single_b32 200 $X single --batches 32 --trials 5 --warmup 5 --no-progress \
            --allocators raw cupy_pool xpool cupy_pool_graph xpool_graph --out $G/single_gpu.csv &
        CUDA_VISIBLE_DEVICES=1 bounded single_b4 200 $X single --batches 4 --steps 250 --trials 5 --warmup 5 \
            --no-progress --allocators cupy_pool xpool cupy_pool_graph xpool_graph --out $G/single_gpu_b4.csv
        wait
        bounded ddp_threads 300 $X ddp --modes threads --worlds 1 2 --trials 5 --warmup 5 --steps 12 --no-progress \
            --allocators raw cupy_pool xpool cupy_pool_graph xpool_graph --out $G/ddp_scaling.csv
        CSV="$G" ;;
    measure2)
        mkdir -p $G
        bounded ddp_processes 200 $X ddp --modes processes --worlds 1 2 --trials 5 --warmup 5 --steps 12 \
            --no-progress --allocators xpool xpool_graph --out $G/ddp_processes.csv
        bounded sweep 240 $X sweep --trials 5 --no-progress --allocators xpool_graph --out $G/batch_sweep.csv
        ${BENCH_CMD:-true}
        CSV="$G ${BENCH_CSV:-}" ;;
    final)
        # the final allocator core: the alloc+free size sweep (11 trials, arms taking turns window by window) and
        # the hit path's breakdown alone on the machine, then every GPU test
        bounded bench_hit 150 $PY -m xlab.bench.alloc --sweep size --trials 11 \
            --allocators cupy_pool xpool xpool_seed c_noop noop --out data/alloc_hit_sweep.csv
        bounded hit 90 $PY -m xlab.bench.hit --out data/hit_breakdown.csv
        bounded gpu_tests 330 $PY -m pytest -q -p no:warnings -m "gpu or multigpu" tests \
            -k "not transparency_gate_raw" --ignore=tests/test_torch_gpu.py
        CUDA_VISIBLE_DEVICES=0 bounded torch_tests 120 $PY -m pytest -q -p no:warnings -m gpu tests/test_torch_gpu.py
        CSV="data/alloc_hit_sweep.csv data/hit_breakdown.csv" ;;
    *) echo "unknown part $part (probe measure measure2 final)"; exit 2 ;;
esac
cat "$W/summary.log" "$W/skipped.log" 2>/dev/null
for f in "$W"/*.log; do case $f in *summary.log|*build.log) ;; *) echo "== $f"; tail -8 "$f";; esac; done
mkdir -p "$W/csv" && cp -r $CSV "$W/csv/" 2>/dev/null
tar czf "$DEST/graph-$part.tgz" -C "$W" .
