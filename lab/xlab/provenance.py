"""Provenance: what every measurement row carries (GPU, driver, CUDA, CuPy, commit, date)."""
from __future__ import annotations

import datetime as _dt
import functools
import os
import platform
import subprocess


# Note [Commits not in the repository]
# A row's commit is the HEAD of the checkout that measured it (or $XPOOL_COMMIT: a device machine's copy of the tree
# may carry a stale .git, so the GPU scripts set it). A few CSVs name commits this repository does not have: rows
# measured in a branch's worktree at its HEAD before the branch was rebased onto main, so the commit that ran was
# rewritten and the file landed minutes later in its rebased form (the traces data/memory_trace_*.csv.gz recorded
# at 55e7e8b, 470072e and 8747672, also named in memory_schemes.csv's trace_commit, landed in 924512e, 4e9da9f and
# 30f9bd2; a C-core timing at 06b3f1f, in the record since, in 012dbeb; the commit log's author dates follow the
# measurements). The report prints such a commit with the one it landed in
# (xlab.sources.REWRITTEN: "rebased away; landed as ..."), and tests/lab/test_report.py fails on any other commit a
# CSV names that the repository lacks.


@functools.lru_cache(maxsize=1)
def git_commit() -> str:
    """Short commit of the working tree ('+dirty' when it has changes), or $XPOOL_COMMIT, or 'unknown'."""
    if os.environ.get("XPOOL_COMMIT"):
        return os.environ["XPOOL_COMMIT"]
    try:
        from .paths import repo_root
        root = str(repo_root())
        sha = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):   # FileNotFoundError: not run from a checkout
        return "unknown"
    return (sha + ("+dirty" if dirty else "")) if sha else "unknown"


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


@functools.lru_cache(maxsize=1)
def gpu_info() -> dict:
    """GPU name and count, driver, CUDA runtime and CuPy versions; 'none' where there is no GPU."""
    info = {"gpu": "none", "n_gpus": 0, "driver": "none", "cuda": "none", "cupy": "none"}
    try:
        import cupy
        info["cupy"] = cupy.__version__
        rt = cupy.cuda.runtime
        v = rt.runtimeGetVersion()
        info["cuda"] = f"{v // 1000}.{v % 1000 // 10}"
        info["n_gpus"] = n = rt.getDeviceCount()
        if n:
            info["gpu"] = _text(rt.getDeviceProperties(0)["name"])
    except Exception:
        pass
    try:
        import pynvml
        pynvml.nvmlInit()
        info["driver"] = _text(pynvml.nvmlSystemGetDriverVersion())
    except Exception:
        pass
    return info


def provenance(**params) -> dict:
    """The provenance columns for one measurement row, plus the run's parameters."""
    return {**gpu_info(), "commit": git_commit(),
            "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "python": platform.python_version(), "host": platform.node(), **params}


def has_gpu() -> bool:
    """True when CuPy can see at least one CUDA device."""
    return gpu_info()["n_gpus"] > 0
