"""The CuPy adapter's C path, driven through CuPy's own CFunctionAllocatorMemory over host memory (no GPU)."""
import gc
import sys

import pytest

cupy_memory = pytest.importorskip("cupy.cuda.memory")

import xpool  # noqa: E402
import xpool_twin.testing  # noqa: E402
from xpool_twin import HostBackend  # noqa: E402
from xpool_twin.testing import pool_with_stream_lookup  # noqa: E402


def visible_gpus() -> int:
    """CUDA devices CuPy sees (0 without a driver or a device)."""
    import cupy
    try:
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:   # noqa: BLE001 - no driver, no device: CuPy raises its own errors
        return 0


def cupy_alloc(pool, nbytes, device=0):
    """What CFunctionAllocator.malloc does, minus the CUDA call for the current device."""
    param, malloc_fn, free_fn = pool._core.cfunctions()
    mem = cupy_memory.CFunctionAllocatorMemory(nbytes, param, malloc_fn, free_fn, device)
    return cupy_memory.MemoryPointer(mem, 0)


def test_cupy_memory_objects_go_through_the_pool():
    pool = xpool.MemoryPool(backend=HostBackend())
    mp = cupy_alloc(pool, 1000)
    assert mp.mem.size == 1000 and mp.device_id == 0
    # scheme xpool: the block is cut from a 2 MiB segment, whose rest stays cached
    assert (pool.used_bytes(), pool.free_bytes(), pool.total_bytes()) == (1024, (2 << 20) - 1024, 2 << 20)
    ptr = mp.ptr
    del mp
    assert (pool.used_bytes(), pool.free_bytes(), pool.n_free_blocks()) == (0, 2 << 20, 1)   # merged whole
    assert cupy_alloc(pool, 600).ptr == ptr
    pool.free_all_blocks()


def test_blocks_return_to_their_device_pool():
    pool = xpool.MemoryPool(backend=HostBackend())
    mp = cupy_alloc(pool, 5000, device=3)
    del mp
    assert pool.stats(3).blocks_cached == 1


def test_oom_propagates_through_cupy_as_xpool_error():
    pool = xpool.MemoryPool(backend=HostBackend(capacity=1 << 20))
    keep = cupy_alloc(pool, 600 << 10)
    with pytest.raises(xpool.OutOfMemoryError) as info:
        cupy_alloc(pool, 600 << 10)
    assert isinstance(info.value, cupy_memory.OutOfMemoryError)
    assert keep.mem.size == 600 << 10 and pool.used_bytes() == 600 << 10


def test_the_allocator_outlives_the_pool_while_cupy_holds_blocks():
    pool = xpool.MemoryPool(backend=HostBackend())
    core = pool._core
    base = sys.getrefcount(core)
    mp = cupy_alloc(pool, 100)
    assert sys.getrefcount(core) == base + 1      # each block CuPy holds keeps the core alive
    del pool, core
    gc.collect()
    del mp                                        # frees into a core nobody else references: no crash


def test_memory_pool_settings_are_checked():
    with pytest.raises(ValueError, match="classes_per_doubling"):
        xpool.MemoryPool(classes_per_doubling=0, backend=HostBackend())
    pool = xpool.MemoryPool(limit=1 << 20, backend=HostBackend())
    assert pool.get_limit() == 1 << 20


def test_install_twice_is_an_error_and_uninstall_restores():
    import cupy
    before = cupy.cuda.get_allocator()
    pool = xpool.install(xpool.MemoryPool(backend=HostBackend()))
    try:
        assert cupy.cuda.get_allocator() == pool.malloc and xpool.cupy_adapter.installed() is pool
        with pytest.raises(RuntimeError, match="already installed"):
            xpool.install()
    finally:
        xpool.uninstall()
    assert cupy.cuda.get_allocator() == before and xpool.cupy_adapter.installed() is None
    with pytest.raises(TypeError, match="MemoryPool"):
        xpool.install(object())
    assert xpool.cupy_adapter.installed() is None


def test_use_is_scoped_to_the_block():
    import cupy
    before = cupy.cuda.get_allocator()
    with xpool.use(xpool.MemoryPool(backend=HostBackend())) as pool:
        assert cupy.cuda.get_allocator() == pool.malloc
    assert cupy.cuda.get_allocator() == before


def test_use_checks_its_arguments():
    with pytest.raises(TypeError, match="MemoryPool"):
        with xpool.use(object()):
            pass
    with pytest.raises(ValueError, match="not both"):
        with xpool.use(xpool.MemoryPool(backend=HostBackend()), limit=1):
            pass


def stream_fn(fn):
    """A stand-in for CuPy's `intptr_t get_stream_ptr(int device)`, kept alive by the caller."""
    import ctypes
    return ctypes.CFUNCTYPE(ctypes.c_ssize_t, ctypes.c_int)(fn)


def test_blocks_are_keyed_by_the_current_stream_of_their_device():
    """The hook asks CuPy for the stream of the device it allocates on (not of whichever device is current)."""
    import ctypes
    asked = []
    fn = stream_fn(lambda device: asked.append(device) or 1000 + device)
    pool = pool_with_stream_lookup(HostBackend(), ctypes.cast(fn, ctypes.c_void_p).value)
    a, b = cupy_alloc(pool, 4096, device=0), cupy_alloc(pool, 4096, device=3)
    assert asked == [0, 3]
    assert [blk["stream"] for blk in pool._core.live_blocks(0) + pool._core.live_blocks(3)] == [1000, 1003]
    del a, b
    assert {blk["stream"] for d in (0, 3) for blk in pool._core.cached_blocks(d)} == {1000, 1003}


def test_switching_streams_between_requests_keys_each_block_to_the_stream_then_current():
    """What `with stream:` does to the hook, on the CPU: the lookup is asked on every request, so a block freed on
    one stream is never handed out on another, and is on its own again."""
    import ctypes
    current = {0: 0}                                                # device -> stream, as CuPy's thread-local
    fn = stream_fn(lambda device: current[device])
    pool = pool_with_stream_lookup(HostBackend(), ctypes.cast(fn, ctypes.c_void_p).value)
    current[0] = 0x5001                                             # with s1:
    a = cupy_alloc(pool, 4096)
    p1 = a.ptr
    del a
    current[0] = 0x5002                                             # with s2:
    b = cupy_alloc(pool, 4096)
    assert b.ptr != p1
    current[0] = 0x5001                                             # with s1: again
    c = cupy_alloc(pool, 4096)
    assert c.ptr == p1
    assert {blk["ptr"]: blk["stream"] for blk in pool._core.live_blocks(0)} == {b.ptr: 0x5002, c.ptr: 0x5001}


def test_a_stream_lookup_that_raises_propagates_and_hands_out_nothing():
    """CuPy 14's lookup fails with -1 (Cython 3), CuPy 13's with 0: either way its exception comes out of the
    allocation, and no block is handed out under a made-up stream."""
    import ctypes
    # PyLong_AsSsize_t(NULL) -- device 0 -- sets SystemError and returns -1, as CuPy 14's lookup fails
    fails = ctypes.cast(ctypes.pythonapi.PyLong_AsSsize_t, ctypes.c_void_p).value
    pool = pool_with_stream_lookup(HostBackend(), fails)
    with pytest.raises(SystemError):
        cupy_alloc(pool, 4096)
    assert pool._core.live_blocks(0) == [] and pool.stats().requests == 0


def test_cupy_stream_lookup_without_a_gpu_raises_cupys_error():
    """CuPy's own get_stream_ptr, on a machine with no CUDA driver: its error, not a block."""
    if visible_gpus():
        pytest.skip("a GPU is visible: CuPy's lookup succeeds (test_gpu_pool covers it)")
    from cupy_backends.cuda.api.runtime import CUDARuntimeError

    pool = pool_with_stream_lookup(HostBackend(), xpool_twin.testing.cupy_stream_lookup())
    with pytest.raises(CUDARuntimeError):
        cupy_alloc(pool, 4096)
    assert pool._core.live_blocks(0) == [] and pool.stats().requests == 0


def test_per_thread_default_stream_is_keyed_by_thread():
    """cudaStreamPerThread (handle 2) is a different stream in each thread: blocks must not cross threads."""
    import ctypes
    import threading
    per_thread = stream_fn(lambda device: 2)                        # CuPy's current stream: always PTDS
    pool = pool_with_stream_lookup(HostBackend(), ctypes.cast(per_thread, ctypes.c_void_p).value)
    first = cupy_alloc(pool, 4096)
    ptr = first.ptr
    del first                                                       # cached for this thread's stream
    seen = []
    t = threading.Thread(target=lambda: seen.append(cupy_alloc(pool, 4096).ptr))
    t.start()
    t.join()
    assert seen[0] != ptr                                           # another thread: not reused
    assert cupy_alloc(pool, 4096).ptr == ptr                        # this thread: reused
    assert all(b["stream"] < 0 for b in pool._core.cached_blocks(0) + pool._core.live_blocks(0))


def test_module_functions_follow_the_pool_in_use():
    assert xpool.current() is None and len(xpool.stats()) == 0 and xpool.empty_cache() == 0
    with xpool.use(xpool.MemoryPool(backend=HostBackend())) as pool:
        assert xpool.current() is pool
        mp = cupy_alloc(pool, 3000)
        del mp
        assert xpool.stats().bytes_cached == 2 << 20        # its whole segment, merged again
        assert xpool.stats().requests == 1
        assert xpool.empty_cache() == 2 << 20
    assert xpool.current() is None


def test_install_without_cupy_says_what_to_install():
    """xpool.install() on a machine without CuPy: an ImportError naming the CuPy wheels and the extras."""
    import subprocess
    import sys
    code = ("import sys\nfor m in ('cupy', 'cupy.cuda', 'cupy.cuda.memory'): sys.modules[m] = None\nimport xpool\n"
            "try:\n    xpool.install()\nexcept ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "pip install cupy-cuda12x" in out and "cupy-cuda13x" in out
    assert "'.[cuda12]'" in out and "'.[cuda13]'" in out


def test_install_without_a_gpu_says_so():
    pytest.importorskip("cupy")
    if visible_gpus():
        pytest.skip("a GPU is visible")
    import xpool
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        xpool.install()
    assert xpool.cupy_adapter.installed() is None                  # nothing half-installed
