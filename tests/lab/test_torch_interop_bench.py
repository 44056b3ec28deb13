"""The PyTorch interop benchmark's plumbing on a CPU: interleaving, one row per trial, intervals, the memory view.

The GPU worker itself runs on the lead's H200 (`python -m xlab.bench.torch_interop`)."""
import json
import sys

import numpy as np
import pandas as pd
import pytest

from xlab.bench import torch_interop as bench


@pytest.fixture(autouse=True)
def _design_scheme(monkeypatch):
    """These tests spell out the bytes of the design's size classes: they run under scheme seed.  Scheme
    xpool (the default: segments) has its own in tests/xpool/test_segments.py."""
    monkeypatch.setenv("XPOOL_SCHEME", "seed")



def stand_in(arm):
    """A worker that needs no GPU: xpool's empty_del is 10% faster, training the same up to noise."""
    rows = [{"case": "empty_del", "size_bytes": n, "value": (2.0 if arm == "torch" else 1.8), "unit": "us_per_pair",
             "pairs": 10} for n in bench.SIZES]
    rows.append({"case": "train_step", "value": 1000.0, "unit": "tokens_per_s", "steps": 3, "batch_size": 4})
    rows = [{**r, "arm": arm, "torch": "stand-in"} for r in rows]
    return [sys.executable, "-c", f"print({json.dumps(rows)!r})"]


def test_trials_interleave_the_arms_one_row_per_trial_with_provenance():
    df = bench.run(trials=3, command=stand_in)
    assert len(df) == 3 * 3 * (len(bench.SIZES) + 1)
    assert list(df.columns[:len(bench.COLUMNS)]) == bench.COLUMNS
    for col in ("gpu", "commit", "date"):
        assert col in df.columns
    firsts = df[df.order == 0].groupby("trial").arm.first().tolist()
    assert firsts == ["torch", "xpool", "xpool_segments"]          # who goes first rotates
    assert (df.groupby(["trial", "order"]).arm.nunique() == 1).all() and df.arm.nunique() == 3


def test_a_failing_worker_names_the_trial_and_arm():
    with pytest.raises(RuntimeError, match="trial 0, arm torch failed"):
        bench.run(trials=1, command=lambda arm: [sys.executable, "-c", "raise SystemExit('no GPU')"])


def test_summary_judges_by_interval():
    df = bench.run(trials=5, command=stand_in)
    s = bench.summarize(df).set_index("case")
    e = s.loc["empty_del"]
    assert len(e) == len(bench.SIZES)
    assert np.allclose(e.speedup, 2.0 / 1.8) and (e.verdict == "xpool faster").all()
    t = s.loc[["train_step"]].iloc[0]
    assert t.speedup == 1.0 and t.verdict == "within noise" and t.trials == 5
    assert np.allclose(e.xpool_segments_median, 1.8)
    old = bench.summarize(df[df.arm != "xpool_segments"])     # an older CSV, without the segments arm
    assert "xpool_segments_median" not in old and np.allclose(old.speedup.iloc[:3], 2.0 / 1.8)


def test_in_use_by_origin_follows_both_frameworks():
    """Over host memory: CuPy-path and torch-path blocks, then the per-framework levels from the timeline."""
    cupy_memory = pytest.importorskip("cupy.cuda.memory")
    import ctypes

    import xpool
    from xpool import _core
    from xpool_twin import HostBackend
    pool = xpool.Pool(HostBackend(), timeline=1000)
    pool._core.bind_torch()
    lib = ctypes.CDLL(_core.__file__)
    lib.xpool_torch_try_malloc.restype = ctypes.c_void_p
    lib.xpool_torch_try_malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    lib.xpool_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    param, malloc_fn, free_fn = pool._core.cfunctions()
    mem = cupy_memory.CFunctionAllocatorMemory(1 << 20, param, malloc_fn, free_fn, 0)
    t = lib.xpool_torch_try_malloc(2 << 20, 0, None)
    del mem
    lib.xpool_torch_free(t, 2 << 20, 0, None)
    t = lib.xpool_torch_try_malloc(1 << 20, 0, None)        # PyTorch takes CuPy's freed block
    m = bench.in_use_by_origin(pool.timeline())
    assert m.cupy.tolist() == [1 << 20, 1 << 20, 0, 0, 0]
    assert m.torch.tolist() == [0, 2 << 20, 2 << 20, 0, 1 << 20]
    assert m.reserved.iloc[-1] == 3 << 20 and (m.python == 0).all()
    lib.xpool_torch_free(t, 1 << 20, 0, None)
    fig = bench.plot_mixed_memory(m)
    assert fig.axes[0].get_ylabel() == "GiB"
    pool.empty_cache()


def test_the_figure_names_the_scheme_of_the_pool_enable_torch_made():
    from xlab import allocators, plots
    df = bench.run(trials=2, command=stand_in).assign(scheme=lambda d: d.arm.map(
        {"torch": "", "xpool": "expandable", "xpool_segments": "segments"}))
    texts = [t.get_text() for t in plots.torch_interop(df).legends[0].get_texts()]
    assert allocators.label("xpool_expandable") in texts and allocators.label("xpool_segments") in texts
    assert allocators.label("xpool") not in texts          # not drawn as the default scheme (segments)
