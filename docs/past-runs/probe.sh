#!/usr/bin/env bash
# A short GPU probe (one device call): the direct-cuBLAS path's GPU tests, the GIL probe, host time per step with
# and without direct cuBLAS. Logs and CSVs go to $OUT/probe.tgz.
set -uo pipefail
cd "$(dirname "$0")/../.."
DEST=${OUT:-build/probe}; W=/tmp/probe; mkdir -p "$W" "$DEST"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
python3 setup.py build_ext --inplace -q >"$W/build.log" 2>&1 || { tail -30 "$W/build.log"; exit 1; }
nvidia-smi -L | tee "$W/gpus.log"
step() { local name=$1 limit=$2; shift 2; echo "=== $name $(date -u +%T)"; timeout -s ABRT "$limit" "$@" >"$W/$name.log" 2>&1; echo "rc=$? $(date -u +%T)" >>"$W/$name.log"; tail -${TAIL:-15} "$W/$name.log"; }
for st in ${PROBE_STAGES:-tests gil profile}; do case $st in
  tests) step tests 150 python3 -m pytest -q -p no:warnings -m gpu ${PROBE_TESTS:-tests/test_gpt_blas.py tests/test_gpt_fused.py tests/test_gpt_gpu.py} ;;
  calls) TAIL=120 step calls 120 python3 docs/past-runs/probe_calls.py ;;
  gil) TAIL=40 step gil 120 python3 -m xlab.bench.gil --trials 3 --seconds 0.3 ${GIL_ARGS:---switch-intervals 0.005 0.0005} --out "$W/gil_probe.csv" ;;
  profile) for b in ${PROFILE_BATCHES:-4 32}; do for g in 1 0; do TAPEGPT_BLAS=$g step "profile_b${b}_blas$g" 120 python3 -m tapegpt.bench --profile --batch $b --steps 10; done; done ;;
  sweep) for g in 1 0; do TAPEGPT_BLAS=$g step "sweep_blas$g" 200 python3 -m xlab.experiments sweep --batches 4 32 --allocators xpool cupy_pool --trials 3 --steps-scale 3 --no-progress --out "$W/sweep_blas$g.csv"; done ;;
esac; done
tar czf "$DEST/probe.tgz" -C "$W" .
