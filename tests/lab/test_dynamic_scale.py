"""The dynamic-shape benchmark at scale and under a memory cap (xlab.bench.dynamic_scale) without a GPU: the scaled
workloads' sizes and their estimates against the committed rows, the plan's order and resuming, the caps and their
setters, a capped run stopped by its first out-of-memory error, both CSVs from a --cpu run, the summaries."""
import numpy as np
import pytest

from xlab.bench import dynamic_workloads as wl
from xlab.experiments.train import Window


def _window():
    return Window(lambda: None, lambda: None)


# --- cupy_mix at scale

def _cupy_mix_requests(monkeypatch, scale):
    """The sort and cumsum lengths and the rfft lengths of a small cupy_mix run on NumPy at `scale`, in order."""
    made = []
    for name, module in (("sort", np), ("cumsum", np), ("rfft", np.fft)):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda a, real=real, name=name: made.append((name, a.size)) or real(a))
    info = wl.cupy_mix(12, 2, 3, _window(), gpu=False, small=True, scale=scale)
    monkeypatch.undo()
    return made, info


def test_cupy_mix_at_scale_makes_the_same_draws_scale_times_larger(monkeypatch):
    """Note [cupy_mix at scale]: the same ops in the same order; rfft lengths times s, sort and cumsum lengths times
    s (to within int()), the matmul's sides times sqrt(s) and its k over sqrt(s)."""
    one, info1 = _cupy_mix_requests(monkeypatch, 1)
    four, info4 = _cupy_mix_requests(monkeypatch, 4)
    assert [k for k, _ in one] == [k for k, _ in four] and len(one) > 20
    for (kind, n1), (_, n4) in zip(one, four):
        if kind == "rfft":
            assert n4 == 4 * n1
        elif n1 > 512:                                   # sort and cumsum lengths below 512 are raised to it
            assert n4 == pytest.approx(4 * n1, rel=0.01)
    assert info1["shape"] == "6 ops/step, up to 4096 floats, matmul up to 64"     # scale 1: the benchmark's
    assert info4["shape"] == "6 ops/step, up to 16384 floats, matmul up to 128 (k up to 32)"
    for bad in (0, 1.5, True):
        with pytest.raises(ValueError, match="scale"):
            wl.cupy_mix(1, 1, 0, _window(), gpu=False, small=True, scale=bad)
