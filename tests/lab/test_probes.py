"""The lab's timing probes (xlab._probes, built by lab/setup.py): C loops that time pairs of allocations through
xpool's C hooks and PyTorch's entry points.  The product's own core exports none (tests/xpool/test_api.py)."""
import ctypes

import pytest

import xpool
from xpool import Pool, _core
from xpool_twin import testing
from xpool_twin import HostBackend
from xpool_twin import TwinBackend

MiB = 1 << 20

# xpool's PyTorch entry points, as PyTorch's CUDAPluggableAllocator finds them by name
_LIB = ctypes.CDLL(_core.__file__)
TRY_MALLOC, FREE = _LIB.xpool_torch_try_malloc, _LIB.xpool_torch_free
TRY_MALLOC.restype, TRY_MALLOC.argtypes = ctypes.c_void_p, [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
FREE.restype, FREE.argtypes = None, [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]


def addr(fn):
    return ctypes.cast(fn, ctypes.c_void_p).value


@pytest.fixture(autouse=True)
def _seed(monkeypatch):
    monkeypatch.setenv("XPOOL_SCHEME", "seed")     # the sizes below are the design's classes


def test_the_probes_are_the_labs():
    from xlab import _probes
    assert {"time_pairs", "time_calls", "time_torch_pairs", "noop_cfunctions"} <= set(dir(_probes))
    assert not {"time_pairs", "time_calls", "time_torch_pairs"} & set(dir(_core))


def test_time_pairs_runs_pairs_through_a_c_allocator_in_c(monkeypatch):
    from xlab import _probes
    monkeypatch.delenv("XPOOL_SCHEME")
    pool = Pool(HostBackend())
    param, malloc, free = testing.cfunctions(pool)
    assert _probes.time_pairs(param, malloc, free, 12 * MiB, 1000) > 0
    s = pool.stats()
    assert (s.requests, s.hits, s.device_mallocs, s.blocks_in_use) == (1000, 999, 1, 0)
    assert _probes.time_pairs(*_probes.noop_cfunctions(4096), 4096, 10) >= 0
    with pytest.raises(ValueError, match="pairs"):
        _probes.time_pairs(param, malloc, free, 4096, -1)
    with pytest.raises(ValueError, match="malloc"):
        _probes.time_pairs(param, 0, free, 4096, 1)


def test_the_labs_torch_probe_times_hits_through_the_entry_points():
    from xlab import _probes
    pool = xpool.Pool(TwinBackend())
    pool._core.bind_torch()
    FREE(TRY_MALLOC(4096, 0, None), 4096, 0, None)       # cached: every timed pair hits
    before = pool._core.stats(0)
    assert _probes.time_torch_pairs(addr(TRY_MALLOC), addr(FREE), 4096, 1000) > 0
    s = pool._core.stats(0)
    assert (s["requests"] - before["requests"], s["hits"] - before["hits"], s["misses"] - before["misses"]) == \
        (1000, 1000, 0)
    assert _probes.time_torch_pairs(addr(TRY_MALLOC), addr(FREE), 1 << 62, 5) == 0   # refused: no pair
    with pytest.raises(ValueError, match="pairs"):
        _probes.time_torch_pairs(addr(TRY_MALLOC), addr(FREE), 4096, -1)
    assert pool._core.stats(0)["bytes_in_use_torch"] == 0
