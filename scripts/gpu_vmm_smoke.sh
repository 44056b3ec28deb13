#!/usr/bin/env bash
# The expandable scheme's CUDA ops and range manager on one GPU, before they are wired into the pool (Note
# [Expandable segments]): builds the extensions, then scripts/gpu_vmm_smoke.py builds the test harness with gcc,
# checks what it can (data, a kernel, a matmul, an NCCL all-reduce on mapped memory, physical memory given back,
# the error paths, out of memory, capture) and times map/unmap per page and per 64 MiB beside cudaMalloc.
#   bash scripts/gpu_vmm_smoke.sh                 (~30 s on one H200; vmm_smoke.log and two CSVs in $OUT)
#   WITH_TESTS=1 bash scripts/gpu_vmm_smoke.sh    (+ ~15 s: tests/xpool/test_vmm.py and tests/xpool/test_expandable.py there)
set -uo pipefail
cd "$(dirname "$0")/.."
DEST=${OUT:-build/vmm_smoke}; mkdir -p "$DEST"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
t0=$SECONDS
python3 setup.py build_ext --inplace -q >"$DEST/build.log" 2>&1 || { tail -30 "$DEST/build.log"; exit 1; }
echo "built in $((SECONDS - t0)) s"
timeout -s ABRT 50 python3 -X faulthandler scripts/gpu_vmm_smoke.py --out "$DEST" "$@"; rc=$?
if [ "${WITH_TESTS:-0}" = 1 ]; then
    timeout -s ABRT 60 python3 -m pytest -q -p no:cacheprovider tests/xpool/test_vmm.py tests/xpool/test_expandable.py \
        >"$DEST/tests.log" 2>&1; echo "tests rc=$?"; tail -3 "$DEST/tests.log"
fi
echo "smoke rc=$rc, $((SECONDS - t0)) s in all"
exit $rc
