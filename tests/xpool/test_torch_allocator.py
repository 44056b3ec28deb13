"""PyTorch's entry points (xpool_torch_malloc / xpool_torch_free), driven over host memory without a GPU.

ctypes calls into a CDLL release the GIL, which is exactly PyTorch's situation when it allocates. The C++
harness (tests/xpool/fixtures/torch_harness.cpp) adds what ctypes cannot: a caller that catches the C++
exception PyTorch would see, and threads Python never saw.
"""
import ctypes
import os
import subprocess
import sys
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import xpool
from xpool import _core
from xpool_twin import TwinBackend
from xpool import torch_allocator


@pytest.fixture(autouse=True)
def _design_scheme(monkeypatch):
    """These tests spell out the bytes of the design's size classes: they run under scheme seed.  Scheme
    segments (the default) has its own in tests/xpool/test_segments.py."""
    monkeypatch.setenv("XPOOL_SCHEME", "seed")


from fixtures.torch_c import (FREE, LAST_ERROR, LIB, MALLOC, TRY_MALLOC, addr, build_harness,  # noqa: E402,F401
                               torch_free, torch_malloc)

@pytest.fixture
def pool():
    """A host-memory pool bound to PyTorch's entry points; every torch block must be back at the end."""
    p = xpool.Pool(TwinBackend())
    p._core.bind_torch()
    yield p
    for d in list(p.stats()):
        assert p._core.stats(d)["bytes_in_use_torch"] == 0, "a test left a torch block in use"
    p.empty_cache()


def stats(pool, device=0):
    return pool._core.stats(device)


def test_entry_points_are_exported_with_pytorchs_names():
    out = subprocess.run(["nm", "-D", "--defined-only", _core.__file__], capture_output=True, text=True)
    if out.returncode:
        pytest.skip("nm is not available")
    names = {line.split()[-1] for line in out.stdout.splitlines() if line.strip()}
    assert {"xpool_torch_malloc", "xpool_torch_free"} <= names
    assert torch_allocator.library_path() == _core.__file__


def test_counters_are_exact_through_the_torch_path(pool):
    ptr = torch_malloc(1000)
    s = stats(pool)
    assert (s["requests"], s["misses"], s["device_mallocs"], s["hits"]) == (1, 1, 1, 0)
    assert (s["bytes_in_use"], s["bytes_requested"], s["bytes_in_use_torch"], s["bytes_in_use_cupy"]) == (
        1024, 1000, 1024, 0)
    torch_free(ptr, 1000)
    s = stats(pool)
    assert (s["frees"], s["bytes_in_use"], s["bytes_cached"], s["bytes_in_use_torch"]) == (1, 0, 1024, 0)
    assert torch_malloc(600) == ptr                      # a hit, served without the GIL
    s = stats(pool)
    assert (s["requests"], s["hits"], s["device_mallocs"], s["bytes_requested"]) == (2, 1, 1, 600)
    assert [b["origin"] for b in pool.live_blocks(0)] == ["torch"]
    torch_free(ptr, 600)
    assert pool._backend.mallocs == 1 and pool._backend.frees == 0


def _run_sequence(pool, alloc, free):
    """miss, free, hit, free of 3000 B: the counters and events it leaves."""
    a = alloc(3000)
    free(a)
    b = alloc(2000)
    free(b)
    return stats(pool), pool.timeline()


def test_the_torch_hit_path_leaves_what_the_core_hit_path_leaves():
    """torch_take_cached/torch_give_back mirror xp_alloc/xp_free: same counters, same events, other origin."""
    runs = []
    for path in ("python", "torch"):
        p = xpool.Pool(TwinBackend(), timeline=100)
        if path == "torch":
            p._core.bind_torch()
            runs.append(_run_sequence(p, torch_malloc, torch_free))
        else:
            live = {}

            def alloc(n, p=p):
                a = p.allocate(n, device=0, stream=0)
                live[a.ptr] = a
                return a.ptr
            runs.append(_run_sequence(p, alloc, lambda ptr: live.pop(ptr).release()))
        p.empty_cache()
    (s_py, tl_py), (s_torch, tl_torch) = runs
    assert s_py == s_torch
    cols = ["device", "event", "stream", "requested", "size", "bytes_in_use", "bytes_cached"]
    assert tl_py[cols].equals(tl_torch[cols]) and len(tl_torch) == 4
    assert set(tl_py.origin) == {"python"} and set(tl_torch.origin) == {"torch"}


def test_a_block_freed_by_cupy_is_reused_by_torch_and_back(pool):
    cupy_memory = pytest.importorskip("cupy.cuda.memory")
    param, malloc_fn, free_fn = pool._core.cfunctions()

    def cupy_alloc(nbytes):
        return cupy_memory.MemoryPointer(
            cupy_memory.CFunctionAllocatorMemory(nbytes, param, malloc_fn, free_fn, 0), 0)

    mp = cupy_alloc(5000)
    ptr = mp.ptr
    assert stats(pool)["bytes_in_use_cupy"] == 5120
    del mp                                              # CuPy frees it ...
    assert torch_malloc(4700) == ptr                    # ... PyTorch gets it (stream 0 is CuPy's null stream)
    s = stats(pool)
    assert (s["bytes_in_use_torch"], s["bytes_in_use_cupy"], s["device_mallocs"]) == (5120, 0, 1)
    torch_free(ptr, 4700)                               # PyTorch frees it ...
    mp = cupy_alloc(5000)                               # ... CuPy gets it
    assert mp.ptr == ptr and stats(pool)["device_mallocs"] == 1
    del mp


def test_streams_key_the_blocks(pool):
    a = torch_malloc(4096, stream=0x7000)
    torch_free(a, stream=0x7000)
    b = torch_malloc(4096, stream=0)                    # another stream: not reused
    assert b != a
    assert torch_malloc(4096, stream=0x7000) == a
    torch_free(a)
    torch_free(b)


def test_the_per_thread_default_stream_is_keyed_by_thread(pool):
    """cudaStreamPerThread (handle 2) is another stream in each thread, as cupy_malloc keys it."""
    a = torch_malloc(4096, stream=2)
    torch_free(a, stream=2)
    seen = []
    t = threading.Thread(target=lambda: seen.append(torch_malloc(4096, stream=2)))
    t.start()
    t.join()
    assert seen[0] != a                                 # another thread's stream: not reused
    assert torch_malloc(4096, stream=2) == a            # this thread's: reused
    assert all(b["stream"] < 0 for b in pool.live_blocks(0))
    torch_free(a)
    torch_free(seen[0])


def test_python_threads_without_the_gil_keep_the_counters_exact(pool):
    threads, pairs = 8, 300
    barrier = threading.Barrier(threads)
    errors = []

    def work(i):
        try:
            barrier.wait()
            for j in range(pairs):
                n = 1000 + (j % 5) * 70_000
                ptr = torch_malloc(n, device=i % 2)
                torch_free(ptr, n, device=i % 2)
        except BaseException as e:                      # noqa: BLE001 - checked below
            errors.append(e)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    total = {k: sum(stats(pool, d)[k] for d in (0, 1))
             for k in ("requests", "hits", "misses", "frees", "device_mallocs", "blocks_cached",
                       "bytes_in_use", "bytes_requested", "bytes_in_use_torch")}
    assert total["requests"] == total["frees"] == threads * pairs
    assert total["hits"] + total["misses"] == total["requests"]
    assert total["device_mallocs"] == total["misses"] == total["blocks_cached"] == pool._backend.mallocs
    assert total["bytes_in_use"] == total["bytes_requested"] == total["bytes_in_use_torch"] == 0


def test_the_oom_ladder_runs_before_torch_sees_an_error(pool):
    pool._backend.capacity = 1 << 20
    cached = torch_malloc(512 << 10)
    torch_free(cached)                                  # 512 KiB cached
    ptr = torch_malloc(700 << 10)                       # fits only once the cache is given back
    s = stats(pool)
    assert (s["oom_recoveries"], s["bytes_cached"], s["bytes_in_use_torch"]) == (1, 0, 700 << 10)
    with pytest.raises(MemoryError, match=r"^OutOfMemoryError: xpool: out of memory on device 0"):
        torch_malloc(700 << 10)
    s = stats(pool)
    assert (s["oom_errors"], s["bytes_in_use"], s["blocks_in_use"]) == (1, 700 << 10, 1)   # nothing lost
    torch_free(ptr)


def test_bad_requests_are_refused_with_the_argument_named(pool):
    for device in (-1, 8, 64):                          # the backend (TwinBackend) has 8 devices
        with pytest.raises(MemoryError, match=rf"ValueError: device must be in \[0, 8\) \(the backend's devices\), "
                                              rf"got {device}$"):
            torch_malloc(1000, device=device)
    with pytest.raises(MemoryError, match="larger than any device"):
        torch_malloc(1 << 62)
    assert stats(pool)["requests"] == 0 and pool._backend.mallocs == 0


def test_bad_frees_are_reported_and_change_nothing(pool, monkeypatch):
    reports = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: reports.append(str(u.exc_value)))
    ptr = torch_malloc(1000)
    before = stats(pool)
    torch_free(ptr + 512)                               # not a block's address
    torch_free(ptr, device=1)                           # the wrong device
    torch_free(ptr, device=-1)
    keep = pool.allocate(1000, device=0, stream=0)      # handed to Python, not to PyTorch
    torch_free(keep.ptr)
    assert len(reports) == 4
    assert "was not handed out by this pool" in reports[0] and "was not handed out" in reports[1]
    assert "device must be in [0, 8) (the backend's devices), got -1" in reports[2]
    assert "a block handed to python, not to PyTorch; it stays in use" in reports[3]
    assert "stays in use" in LAST_ERROR().decode()
    after = stats(pool)
    assert after == {**before, "requests": 2, "misses": 2, "device_mallocs": 2, "blocks_in_use": 2,
                     "bytes_in_use": 2048, "bytes_reserved": 2048, "bytes_requested": 2000, "bytes_in_use_python": 1024,
                     "peak_bytes_in_use": 2048, "peak_bytes_requested": 2000, "peak_bytes_reserved": 2048}
    keep.release()
    torch_free(ptr)
    torch_free(ptr)                                     # twice
    assert len(reports) == 5 and "freed twice" in reports[4]


def test_binding_another_pool_waits_until_torch_gave_its_blocks_back(pool):
    ptr = torch_malloc(1000)
    other = xpool.Pool(TwinBackend())
    with pytest.raises(RuntimeError, match="PyTorch still holds 1024 bytes on device 0"):
        other._core.bind_torch()
    assert _core.torch_bound() is pool._core
    torch_free(ptr)
    other._core.bind_torch()
    assert _core.torch_bound() is other._core
    pool._core.bind_torch()


def test_without_a_bound_pool_the_error_says_what_to_call():
    code = ("import ctypes, xpool; from xpool import _core; lib = ctypes.CDLL(_core.__file__); "
            "f = lib.xpool_torch_try_malloc; f.restype = ctypes.c_void_p; "
            "f.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]; "
            "e = lib.xpool_torch_last_error; e.restype = ctypes.c_char_p; "
            "assert _core.torch_bound() is None; assert f(100, 0, None) is None; print(e().decode())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr
    assert "call xpool.enable_torch() before PyTorch's first CUDA allocation" in out.stdout


def test_debug_mode_checks_torch_blocks_too():
    pool = xpool.Pool(TwinBackend(), debug="raise")
    pool._core.bind_torch()
    ptr = torch_malloc(1000)
    ctypes.memset(ptr + 1000, 0, 8)                     # past the requested bytes: the canary
    torch_free(ptr)
    with pytest.raises(xpool.CorruptionError, match="1000"):
        pool.check()
    assert pool._core.stats(0)["bytes_in_use_torch"] == 0


# --- a C++ caller, as PyTorch is

@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    return build_harness(tmp_path_factory)


def test_an_oom_reaches_a_cxx_caller_as_std_exception(pool, harness):
    """PyTorch turns a std::exception from its allocator into a Python RuntimeError with what()."""
    pool._backend.capacity = 1 << 20
    out, msg = ctypes.c_void_p(), ctypes.create_string_buffer(1024)
    assert harness.call_malloc(addr(MALLOC), 600 << 10, 0, None, ctypes.byref(out), msg, 1024) == 0
    keep = out.value
    rc = harness.call_malloc(addr(MALLOC), 600 << 10, 0, None, ctypes.byref(out), msg, 1024)
    assert rc == 1, "the error must arrive as a std::exception"
    assert msg.value.decode().startswith("OutOfMemoryError: xpool: out of memory on device 0")
    rc = harness.call_malloc(addr(MALLOC), 100, 99, None, ctypes.byref(out), msg, 1024)
    assert rc == 1 and "device must be in [0, 8) (the backend's devices), got 99" in msg.value.decode()
    torch_free(keep)
    assert stats(pool)["oom_errors"] == 1


def test_threads_python_never_saw_allocate_and_free(pool, harness):
    """Misses from a fresh C thread take the GIL (PyGILState_Ensure); hits and frees need none."""
    threads, pairs = 8, 2000
    errors = harness.run_threads(addr(MALLOC), addr(FREE), 10_000, threads, pairs, None)
    assert errors == 0
    s = stats(pool)
    assert s["requests"] == s["frees"] == threads * pairs
    assert s["hits"] + s["misses"] == s["requests"]
    assert 3 <= s["device_mallocs"] == s["misses"] == s["blocks_cached"] == pool._backend.mallocs
    assert s["device_mallocs"] <= 3 * threads          # at most one miss per class per thread
    assert s["bytes_in_use"] == s["bytes_in_use_torch"] == s["bytes_requested"] == 0


# --- a model of the pool under any mix of the three origins

OPS = st.lists(st.tuples(st.sampled_from(["cupy", "torch", "python", "free"]), st.integers(1, 3 << 20),
                         st.integers(0, 10_000)), max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_bytes_in_use_by_origin_match_the_live_blocks(pool, ops):
    cupy_memory = pytest.importorskip("cupy.cuda.memory")
    param, malloc_fn, free_fn = pool._core.cfunctions()
    live = []                                           # (origin, handle)
    for kind, n, pick in ops:
        if kind == "free":
            if live:
                origin, h = live.pop(pick % len(live))
                if origin == "torch":
                    torch_free(h)
                elif origin == "python":
                    h.release()
                else:
                    del h
        elif kind == "torch":
            live.append(("torch", torch_malloc(n)))
        elif kind == "python":
            live.append(("python", pool.allocate(n, device=0, stream=0)))
        else:
            live.append(("cupy", cupy_memory.CFunctionAllocatorMemory(n, param, malloc_fn, free_fn, 0)))
        s = stats(pool)
        blocks = pool.live_blocks(0)
        for origin in ("cupy", "torch", "python"):
            assert s[f"bytes_in_use_{origin}"] == sum(b["size"] for b in blocks if b["origin"] == origin)
        assert s["bytes_in_use"] == sum(b["size"] for b in blocks)
        assert len(blocks) == len(live) == s["blocks_in_use"]
    while live:
        origin, h = live.pop()
        if origin == "torch":
            torch_free(h)
        elif origin == "python":
            h.release()
        del h
    assert stats(pool)["bytes_in_use"] == 0


# --- enable(): the one line, and its errors, over a stand-in for torch

class FakeTorch:
    """What enable() touches of torch; records change_current_allocator's argument."""

    def __init__(self, initialized=False, cuda_build=True, refuse=None):
        import types
        self.__version__ = "2.99.0+fake"
        self.changed = []
        outer = self

        class CUDAPluggableAllocator:
            def __init__(self, path, alloc_name, free_name):
                lib = ctypes.CDLL(path)                 # as torch does: the names must resolve in the .so
                self.fns = (getattr(lib, alloc_name), getattr(lib, free_name))
                self.args = (path, alloc_name, free_name)

        def change_current_allocator(a):
            if refuse:
                raise RuntimeError(refuse)
            outer.changed.append(a.args)

        memory = types.SimpleNamespace(CUDAPluggableAllocator=CUDAPluggableAllocator,
                                       change_current_allocator=change_current_allocator)
        self.cuda = types.SimpleNamespace(memory=memory, is_initialized=lambda: initialized)
        self._C = types.SimpleNamespace(**({"_cuda_customAllocator": object()} if cuda_build else {}))


@pytest.fixture
def fresh_enable(monkeypatch):
    monkeypatch.setattr(torch_allocator, "_enabled", None)
    yield monkeypatch
    xpool.uninstall()
    bound = _core.torch_bound()
    if bound is not None:
        bound.release(0)


def test_enable_installs_one_pool_for_both(fresh_enable):
    pytest.importorskip("cupy")
    fake = FakeTorch()
    fresh_enable.setitem(sys.modules, "torch", fake)
    pool = xpool.enable_torch(xpool.MemoryPool(backend=TwinBackend()))
    assert xpool.cupy_adapter.installed() is pool and _core.torch_bound() is pool._core
    assert fake.changed == [(_core.__file__, "xpool_torch_malloc", "xpool_torch_free")]
    assert xpool.enable_torch() is pool and torch_allocator.enabled() is pool   # again: the same pool
    with pytest.raises(RuntimeError, match="already ran with another pool"):
        xpool.enable_torch(classes_per_doubling=4)


def test_enable_shares_the_pool_already_installed(fresh_enable):
    pytest.importorskip("cupy")
    fresh_enable.setitem(sys.modules, "torch", FakeTorch())
    pool = xpool.install(xpool.MemoryPool(backend=TwinBackend()))
    with pytest.raises(RuntimeError, match="already installed for CuPy with another pool"):
        xpool.enable_torch(xpool.MemoryPool(backend=TwinBackend()))
    assert xpool.enable_torch() is pool


@pytest.mark.parametrize("fake, message", [
    (dict(initialized=True), "already initialised in this process"),
    (dict(refuse="Can't swap an already initialized allocator"), "already initialised in this process"),
    (dict(cuda_build=False), "built without CUDA"),
])
def test_enable_explains_why_it_cannot(fresh_enable, fake, message):
    pytest.importorskip("cupy")
    fresh_enable.setitem(sys.modules, "torch", FakeTorch(**fake))
    with pytest.raises(RuntimeError, match=message):
        xpool.enable_torch(xpool.MemoryPool(backend=TwinBackend()))
    assert xpool.cupy_adapter.installed() is None and torch_allocator.enabled() is None   # nothing left half done


def test_enable_without_torch_says_to_install_it(fresh_enable):
    fresh_enable.setitem(sys.modules, "torch", None)      # `import torch` raises ImportError
    with pytest.raises(ImportError, match="needs PyTorch"):
        xpool.enable_torch()
    assert xpool.cupy_adapter.installed() is None


def test_enable_on_this_cpu_only_torch_names_the_problem(fresh_enable):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA build of PyTorch")
    with pytest.raises(RuntimeError, match="built without CUDA"):
        xpool.enable_torch()


def test_importing_xpool_does_not_import_torch():
    code = "import sys, xpool; assert 'torch' not in sys.modules, 'xpool imported torch'"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr


# --- the pool enable() makes: scheme expandable unless one is set (docs/decisions/0003-expandable-for-pytorch.md)

class NoVmmBackend(TwinBackend):
    """Host memory whose driver, like an old one, has no virtual memory management."""

    def vmm(self):
        from xpool._core import VmmError
        raise VmmError("cuMemAddressReserve not found (a driver without virtual memory management)")


@pytest.fixture
def made(fresh_enable):
    """enable_torch() making its own pool over host memory, XPOOL_SCHEME unset."""
    pytest.importorskip("cupy")
    fresh_enable.delenv("XPOOL_SCHEME", raising=False)
    fresh_enable.setitem(sys.modules, "torch", FakeTorch())
    fresh_enable.setattr(torch_allocator, "_backend", TwinBackend)
    return fresh_enable


def test_the_pool_enable_makes_is_expandable_and_says_why(made):
    pool = xpool.enable_torch(limit="1GiB")
    assert pool.settings.scheme == "expandable" and pool.settings.source("scheme") == "default (torch)"
    assert pool.settings.source("limit") == "limit"
    assert "default (torch)" in pool.settings.describe()
    torch_free(torch_malloc(3 << 20))                  # it serves PyTorch's entry points from mapped pages
    assert pool.stats().device_maps >= 1 and xpool.cupy_adapter.installed() is pool


@pytest.mark.parametrize("how, scheme", [
    (dict(scheme="seed"), "seed"),
    (dict(settings=xpool.Settings()), "segments"),      # a Settings resolved with xpool's own defaults
    ("env", "segments"),
])
def test_a_scheme_that_is_set_wins_over_the_torch_default(made, how, scheme):
    if how == "env":
        made.setenv("XPOOL_SCHEME", "segments")
        how = {}
    pool = xpool.enable_torch(**how)
    assert pool.settings.scheme == scheme and pool.settings.source("scheme") != "default (torch)"


def test_the_pool_installed_for_cupy_is_shared_whatever_its_scheme(made):
    pool = xpool.install(xpool.MemoryPool(backend=TwinBackend()))
    assert xpool.enable_torch() is pool and pool.settings.scheme == "segments"


def test_without_virtual_memory_the_torch_default_falls_back_with_a_warning(made):
    made.setattr(torch_allocator, "_backend", NoVmmBackend)
    with pytest.warns(RuntimeWarning, match="needs CUDA's virtual memory management.*using scheme 'segments'"):
        pool = xpool.enable_torch()
    assert pool.settings.scheme == "segments" and pool.settings.source("scheme") == "default"


def test_without_virtual_memory_a_scheme_asked_for_is_an_error(made):
    made.setattr(torch_allocator, "_backend", NoVmmBackend)
    with pytest.raises(RuntimeError, match="vmm\\(\\) failed"):
        xpool.enable_torch(scheme="expandable")
    assert xpool.cupy_adapter.installed() is None and torch_allocator.enabled() is None


def test_a_bad_variable_is_refused_and_nothing_is_installed(made):
    made.setenv("XPOOL_MEMORY_LIMIT", "0.4B")
    with pytest.raises(ValueError, match="^XPOOL_MEMORY_LIMIT='0.4B': not a whole number of bytes"):
        xpool.enable_torch()
    assert xpool.cupy_adapter.installed() is None and torch_allocator.enabled() is None


def test_a_pool_and_settings_together_are_refused(made):
    with pytest.raises(ValueError, match="not both"):
        xpool.enable_torch(xpool.MemoryPool(backend=TwinBackend()), limit="1GiB")
    assert xpool.cupy_adapter.installed() is None
