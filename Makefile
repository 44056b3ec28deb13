# Two commands for a new user (see README): `make report` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup test report gpu clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py $(wildcard xpool/*.c xpool/*.h xlab/*.c)
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

test: setup
	$(BIN)/python -m pytest -q

report: setup
	$(BIN)/python -m xlab.report

# On a GPU machine: every GPU test and measurement in one go (CSVs to data/, logs to $$OUT or build/).
gpu:
	bash scripts/gpu_suite.sh

clean:
	rm -rf build $(VENV) xpool/*.so xlab/*.so
