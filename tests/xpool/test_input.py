"""Bad input, refused naming the argument and changing nothing: sizes, devices, streams, pointers, what a
backend answers, the core's entry points."""
import ctypes
import os
import subprocess
import sys

import numpy as np
import pytest

import xpool
import xpool_twin
import xpool_twin.testing
from fixtures.torch_c import FREE, torch_malloc
from xpool import Pool, Settings
from xpool_twin import HostBackend, TwinBackend


P = 1 << 16


def expandable(**kw):
    backend = TwinBackend(n_devices=1, granularity=P)
    return Pool(backend, scheme="expandable", **kw), backend


@pytest.mark.parametrize("call, name", [(lambda: Settings(frontend=[]), "frontend"),
                                        (lambda: Settings().source([]), "name"),
                                        (lambda: Settings(debug=[]), "debug"),
                                        (lambda: Settings(limit={}), "limit")])
def test_bad_input_names_its_argument(call, name):
    with pytest.raises(ValueError, match=rf"^{name}"):
        call()


@pytest.mark.parametrize("ptr", [True, -1, 1.5, "0x10", None, 1 << 64])
def test_check_ipc_names_a_bad_pointer(ptr):
    pool, _ = expandable()
    with pytest.raises(ValueError, match="^ptr must be a device address"):
        pool.check_ipc(ptr, 0)


def test_a_stream_lookup_that_answers_a_negative_number_is_refused():
    """A stream lookup of pool_with_stream_lookup answering -1 (no error set): CuPy's hook refuses it rather than
    key the block with another thread's per-thread key."""
    lookup = ctypes.CFUNCTYPE(ctypes.c_ssize_t, ctypes.c_int)(lambda device: -1)
    pool = xpool_twin.testing.pool_with_stream_lookup(TwinBackend(), lookup)
    param, malloc, _ = xpool_twin.testing.cfunctions(pool)
    c_malloc = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)(malloc)
    with pytest.raises(ValueError, match="not a stream handle"):    # with the GIL, as CuPy calls it
        c_malloc(param, 512, 0)
    assert pool.stats().requests == 0


def cupy_memory():
    """CuPy's C allocator path (CFunctionAllocatorMemory) works without a GPU."""
    return pytest.importorskip("cupy.cuda.memory")


def c_path(pool):
    return pool._core.cfunctions()


# Heap corruption: a request near 2**64 through CuPy's C path, in debug mode
@pytest.mark.usefixtures("seed_scheme")
@pytest.mark.parametrize("nbytes", [2**64 - 1, 2**64 - 64, 2**64 - 4096, 2**63, 2**48 + 1])
def test_request_near_2_64_through_cupys_c_path_is_refused(nbytes):
    memory = cupy_memory()
    pool = xpool.MemoryPool(backend=HostBackend(), debug="raise")
    with pytest.raises(ValueError, match="larger than any device"):
        memory.CFunctionAllocatorMemory(nbytes, *c_path(pool), 0)
    assert list(pool.stats()) == [] and pool._backend.mallocs == 0


# code read: numbers the core takes are not wrapped to 2**64 - n
@pytest.mark.usefixtures("seed_scheme")
@pytest.mark.parametrize("call, name", [
    (lambda c: c.set_limit(0, -1), "limit"),
    (lambda c: c.release(0, keep=-1), "keep"),
    (lambda c: c.free_ptr(0, -4096), "ptr"),
    (lambda c: c.allocate(-1), "nbytes"),
])
def test_core_refuses_negative_numbers_by_name(call, name):
    pool = Pool(HostBackend())
    pool.allocate(10).release()
    with pytest.raises(ValueError, match=f"{name} must be"):
        call(pool._core)
    assert pool.get_limit() == 0 and pool.stats().blocks_cached == 1


@pytest.mark.usefixtures("seed_scheme")
@pytest.mark.parametrize("bad", [1.5, "1", True, 2**64])
def test_a_bad_stream_is_refused_not_truncated(bad):
    pool = Pool(HostBackend())
    with pytest.raises(ValueError, match="stream"):
        pool.allocate(10, stream=bad)
    assert pool.allocate(10, stream=np.int64(3)).stream == 3


KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture
def torch_pool():
    """A host-memory pool bound to PyTorch's entry points; every torch block must be back at the end."""
    pool = Pool(HostBackend(n_devices=2))
    pool._core.bind_torch()
    yield pool
    for d in list(pool.stats()):
        assert pool._core.stats(d)["bytes_in_use_torch"] == 0, "a test left a torch block in use"
    pool.empty_cache()


class Garbage(HostBackend):
    def __init__(self, count=2, device=0, stream=0):
        super().__init__(n_devices=2)
        self.count, self.device, self.stream = count, device, stream

    def device_count(self):
        return self.count

    def current_device(self):
        return self.device

    def current_stream(self):
        return self.stream


def test_torch_path_refuses_an_unknown_device_before_counting(torch_pool, monkeypatch):
    reports = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: reports.append(str(u.exc_value)))
    for device in (2, 5, 63):
        with pytest.raises(MemoryError, match=rf"device must be .*\[0, 2\).* got {device}"):
            torch_malloc(100, device=device)
    FREE(0x1000, 100, 5, None)                      # a free on an unknown device: reported, nothing made
    FREE(0x1000, 100, 0, None)                      # a pointer never handed out: named in the report
    assert list(torch_pool.stats()) == [] and len(reports) == 2 and "[0, 2)" in reports[0]
    assert "pointer 0x1000 on device 0 was not handed out" in reports[1], reports[1]


def test_cupy_path_refuses_an_unknown_device_before_counting():
    cupy_memory = pytest.importorskip("cupy.cuda.memory")
    pool = Pool(HostBackend(n_devices=2))
    param, malloc_fn, free_fn = xpool_twin.testing.cfunctions(pool)
    with pytest.raises(ValueError, match=r"device must be .*\[0, 2\).* got 5"):
        cupy_memory.CFunctionAllocatorMemory(100, param, malloc_fn, free_fn, 5)
    assert list(pool.stats()) == []


def test_core_entry_points_refuse_an_unknown_device():
    pool = Pool(HostBackend(n_devices=2))
    for call in (lambda: pool._core.allocate(100, 5, 0), lambda: pool._core.stats(5),
                 lambda: pool._core.set_limit(5, 100)):
        with pytest.raises(ValueError, match=r"\[0, 2\)"):
            call()
    assert list(pool.stats()) == []


def test_free_all_blocks_takes_a_stream_handle_and_names_a_bad_one():
    pytest.importorskip("cupy")
    pool = xpool.MemoryPool(backend=HostBackend())
    pool.allocate(3 * MiB, stream=5).release()
    pool.allocate(3 * MiB, stream=6).release()
    pool.free_all_blocks(stream=5)                  # an int handle, as Pool.allocate takes
    assert pool.free_bytes() == 3 * MiB
    with pytest.raises((TypeError, ValueError), match="stream"):
        pool.free_all_blocks(stream="5")


def test_torch_path_a_negative_size_is_refused_naming_it(torch_pool):
    with pytest.raises(MemoryError, match=r"size must be >= 0, got -1"):
        torch_malloc(-1)
    assert torch_pool._core.stats(0)["requests"] == 0


@pytest.mark.parametrize("count", ["2", None, -1, 2.5, True])
def test_garbage_device_count_is_refused_naming_it(count):
    with pytest.raises((TypeError, ValueError), match=r"device_count\(\)"):
        Pool(Garbage(count=count))


@pytest.mark.parametrize("device", ["0", None, -1, 2, 1.0])
def test_garbage_current_device_is_refused_naming_it(device):
    pool = Pool(Garbage(device=device))
    with pytest.raises((TypeError, ValueError), match=r"current_device\(\)"):
        pool.allocate(100)
    assert list(pool.stats()) == []


@pytest.mark.parametrize("stream", ["0", None, 1 << 64, -1, 1.0])
def test_garbage_current_stream_is_refused_naming_it(stream):
    pool = Pool(Garbage(stream=stream))
    with pytest.raises((TypeError, ValueError), match=r"current_stream\(\)"):
        pool.allocate(100)
    assert list(pool.stats()) == []


@pytest.mark.parametrize("lookup", ["1", "4096", "id(object())"])
def test_a_bad_stream_lookup_is_refused_not_called(lookup):
    code = ("import xpool, xpool_twin, xpool_twin.testing\n"
            "try:\n"
            f"    p = xpool_twin.testing.pool_with_stream_lookup(xpool_twin.HostBackend(), {lookup})\n"
            "    import cupy.cuda.memory as m\n"
            "    param, f, g = xpool_twin.testing.cfunctions(p)\n"
            "    m.CFunctionAllocatorMemory(100, param, f, g, 0)\n"
            "except (TypeError, ValueError) as e:\n"
            "    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.startswith("refused:") and "stream_lookup" in out.stdout, out.stdout
