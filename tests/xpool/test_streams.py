"""Streams: the per-thread default stream keys a block per thread, on every path (Python, CuPy's C hook,
PyTorch's), and a thread's key dies with it."""
import ctypes
import threading

import pytest

import xpool_twin
import xpool_twin.testing
from fixtures.torch_c import FREE, torch_malloc
from xpool import Pool
from xpool_twin import HostBackend, TwinBackend


P = 1 << 16


PER_THREAD = 2                  # cudaStreamPerThread's handle


def expandable(**kw):
    backend = TwinBackend(n_devices=1, granularity=P)
    return Pool(backend, scheme="expandable", **kw), backend


class CaptureAwareTwin(TwinBackend):
    """The host twin with the backend's capture query (scheme segments asks it): nothing captures."""

    def capturing(self, device: int, stream: int) -> bool:
        return False


@pytest.mark.parametrize("scheme", ["expandable", "segments"])
def test_a_joined_threads_per_thread_stream_no_longer_holds_anything_back(scheme):
    """Thread.join() returns after the thread's Python state is cleared, which ends its stream key: an empty_cache()
    right after the join gives the thread's memory back, every time (before: 1-26 of 30 kept it)."""
    pool = Pool(CaptureAwareTwin(n_devices=1, granularity=P), scheme=scheme)
    for _ in range(30):
        def work():
            pool.allocate(3 * P, 0, PER_THREAD).release()
        t = threading.Thread(target=work)
        t.start()
        t.join()
        assert pool.empty_cache() > 0 and pool.stats().bytes_reserved == 0


def test_a_living_threads_per_thread_stream_still_holds_back_what_this_thread_gives():
    pool, _ = expandable()
    go, done = threading.Event(), threading.Event()

    def work():
        pool.allocate(P, 0, PER_THREAD).release()
        go.set()
        done.wait()
    t = threading.Thread(target=work)
    t.start()
    go.wait()
    try:
        assert pool.empty_cache() == 0                # it may be capturing: nothing goes back on the device
    finally:
        done.set()
        t.join()
    assert pool.empty_cache() == P


KiB, MiB = 1 << 10, 1 << 20


def _in_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


@pytest.fixture
def torch_pool():
    """A host-memory pool bound to PyTorch's entry points; every torch block must be back at the end."""
    pool = Pool(HostBackend(n_devices=2))
    pool._core.bind_torch()
    yield pool
    for d in list(pool.stats()):
        assert pool._core.stats(d)["bytes_in_use_torch"] == 0, "a test left a torch block in use"
    pool.empty_cache()


def _threads_in_turn(n, alloc_free):
    """n threads one after another, each taking and freeing one block on its per-thread stream: their pointers.
    Thread idents are reused as threads end, so a key derived from them would hand a dead thread's block on."""
    ptrs = []
    for _ in range(n):
        t = threading.Thread(target=lambda: ptrs.append(alloc_free()))
        t.start()
        t.join()
    return ptrs


def _assert_no_block_of_a_dead_thread_reused(ptrs, pool):
    """No thread was handed a block cached for another thread's stream: every request missed.  An address may come
    again, from the device, once the pool gave the dead thread's block back at a miss (Note [Ended threads' streams]
    in xpool/_alloc.c): each repeat needs a give-back before it."""
    st = pool.stats()
    assert st.hits == 0, f"{st.hits} of {len(ptrs)} threads got a block freed by a thread that had ended"
    repeats = sum(p in ptrs[:i] for i, p in enumerate(ptrs))
    assert repeats <= st.device_frees, (repeats, st.device_frees)


def test_allocate_on_the_per_thread_stream_keys_the_block_per_thread():
    pool = Pool(HostBackend())
    a = pool.allocate(4096, stream=PER_THREAD)
    ptr = a.ptr
    assert a.stream == PER_THREAD                   # the handle it was asked for
    a.release()
    other = _in_thread(lambda: pool.allocate(4096, stream=PER_THREAD))
    assert other.ptr != ptr                         # another thread's stream: not reused
    assert pool.allocate(4096, stream=PER_THREAD).ptr == ptr   # this thread's: reused
    del other


def test_allocate_on_the_backends_current_per_thread_stream_keys_the_block_per_thread():
    backend = HostBackend()
    pool = Pool(backend)

    def alloc():
        backend.set_stream(PER_THREAD)              # this thread's current stream: its per-thread stream
        return pool.allocate(4096)

    a = alloc()
    ptr = a.ptr
    a.release()
    other = _in_thread(alloc)
    assert other.ptr != ptr and alloc().ptr == ptr
    del other


def test_release_of_the_per_thread_stream_gives_back_this_threads_blocks_only():
    pool = Pool(HostBackend())
    pool.allocate(3 * MiB, stream=PER_THREAD).release()
    _in_thread(lambda: pool.allocate(5 * MiB, stream=PER_THREAD).release())
    assert pool._core.release(0, stream=PER_THREAD) == 3 * MiB


def test_torch_path_a_new_thread_never_gets_a_dead_threads_per_thread_block(torch_pool):
    def alloc_free():
        p = torch_malloc(4096, stream=PER_THREAD)
        FREE(p, 4096, 0, PER_THREAD)
        return p
    _assert_no_block_of_a_dead_thread_reused(_threads_in_turn(50, alloc_free), torch_pool)


def test_cupy_path_a_new_thread_never_gets_a_dead_threads_per_thread_block():
    cupy_memory = pytest.importorskip("cupy.cuda.memory")
    fn = ctypes.CFUNCTYPE(ctypes.c_ssize_t, ctypes.c_int)(lambda device: PER_THREAD)
    pool = xpool_twin.testing.pool_with_stream_lookup(HostBackend(), ctypes.cast(fn, ctypes.c_void_p).value)
    param, malloc_fn, free_fn = xpool_twin.testing.cfunctions(pool)

    def alloc_free():
        mem = cupy_memory.CFunctionAllocatorMemory(4096, param, malloc_fn, free_fn, 0)
        return mem.ptr                              # freed when mem dies, on return
    _assert_no_block_of_a_dead_thread_reused(_threads_in_turn(50, alloc_free), pool)


def test_python_path_a_new_thread_never_gets_a_dead_threads_per_thread_block():
    pool = Pool(HostBackend())

    def record():
        a = pool.allocate(4096, stream=PER_THREAD)
        p = a.ptr
        a.release()
        return p
    ptrs = _threads_in_turn(50, record)
    _assert_no_block_of_a_dead_thread_reused(ptrs, pool)
    # each dead thread's cache went back at the next thread's miss; the last one's at empty_cache()
    assert pool.stats().device_frees == 49
    assert pool.empty_cache() == 2 * MiB and pool._backend.live() == {}
