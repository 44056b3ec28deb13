#!/usr/bin/env bash
# RMM's wheels for a GPU machine that reaches no package registry (the lent device machines): downloaded here into
# .whl/ (git ignores it) for the device's Python (3.12) and CUDA 13; carry .whl with the run, and scripts/gpu_suite.sh
# installs them onto PYTHONPATH. RMM is the scaled runs' and the dynamic benchmark's rmm_pool arm, nothing else.
#   bash scripts/fetch_wheels.sh [python-version] [cuda-major]      (default 3.12 13)
set -euo pipefail
cd "$(dirname "$0")/.."
py=${1:-3.12} cuda=${2:-13}
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" \
    --platform manylinux_2_28_x86_64 -d .whl "rmm-cu$cuda" "librmm-cu$cuda" rapids-logger
ls -l .whl
