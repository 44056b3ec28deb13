# A new user's commands (see README): `make setup`, `make test`, `make report`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# CuPy's build for the CUDA the driver speaks (nvidia-smi's "CUDA Version"); CUDA 12 where there is no driver
CUDA_MAJOR := $(shell nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9]*\).*/\1/p' | head -1)
CUPY ?= cupy-cuda$(if $(filter 13 14 15,$(CUDA_MAJOR)),13,12)x>=13.0

.PHONY: setup notebooks test test-xpool test-deep report gpu clean

setup: $(VENV)/.installed notebooks

# the allocator (.), the host twin (twin/: the tests' and the replays' CUDA double), the workload (workload/), the lab with the notebooks' and the tests' tools (lab/), CuPy
$(VENV)/.installed: pyproject.toml setup.py lab/pyproject.toml lab/setup.py workload/pyproject.toml \
		$(wildcard xpool/*.c xpool/*.h lab/xlab/*.c twin/xpool_twin/*.[ch])
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e . -e ./twin -e ./workload -e "./lab[notebooks,dev]" "$(CUPY)"
	touch $@

# The notebooks: git holds notebooks/NN_*.py, their cells alone; JupyterLab and papermill open the .ipynb paired with
# each, which git ignores, outputs and all (docs/decisions/0011-notebooks-in-git.md). A missing .ipynb, or one whose
# cells differ from its .py's, gets the .py's cells (its outputs kept); the others are left alone (one open in
# JupyterLab is not rewritten under it), and no .py is written.
notebooks: $(VENV)/.installed
	$(BIN)/python -m xlab.notebook_utils

# every test (the allocator's, the workload's, the lab's); GPU tests skip where no GPU is visible
test: setup
	$(BIN)/python -m pytest -q

# the allocator's own tests alone: the fast tier
test-xpool: setup
	$(BIN)/python -m pytest -q tests/xpool

# every test, the soaks and the largest hypothesis searches at full size (tests/xpool/faults.py: DEEP), before a release
test-deep: setup
	$(BIN)/python -m pytest -q --deep

report: setup
	$(BIN)/python -m xlab.report

# On a GPU machine: every GPU test and measurement in one go (CSVs to data/, logs to $$OUT or build/).
gpu:
	bash scripts/gpu_suite.sh

clean:
	rm -rf build $(VENV) xpool/*.so lab/xlab/*.so twin/xpool_twin/*.so
