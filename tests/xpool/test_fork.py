"""fork(): a child starts without the parent's memory, locks or references."""
import ctypes
import os
import sys
import threading

import pytest

import xpool
from faults import in_child
from xpool import Pool
from xpool_twin import HostBackend


needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")


# HostBackend in a child forked while another thread held its lock
@pytest.mark.usefixtures("seed_scheme")
@needs_fork
def test_host_backend_works_in_a_child_forked_while_its_lock_was_held():
    backend = HostBackend()
    pool = Pool(backend)
    held, done = threading.Event(), threading.Event()

    def hold():
        with backend._lock:
            held.set()
            done.wait()

    t = threading.Thread(target=hold)
    t.start()
    held.wait()
    try:
        answer = in_child(lambda: "ok" if pool.allocate(4096).size == 4096 else "wrong size")
    finally:
        done.set()
        t.join()
    assert answer == "ok"


# code read: in a fork()ed child an unknown pointer drops no reference to the allocator
@pytest.mark.usefixtures("seed_scheme")
@needs_fork
def test_in_a_forked_child_an_unknown_pointer_drops_no_reference():
    pool = xpool.MemoryPool(backend=HostBackend())
    core = pool._core
    param, _, free_fn = core.cfunctions()
    c_free = ctypes.PYFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)(free_fn)

    def child():
        seen = []
        sys.unraisablehook = seen.append
        before = sys.getrefcount(core)
        c_free(param, 0xDEAD000, 0)              # not a block of the parent, nor of the child
        after = sys.getrefcount(core)
        return "ok" if after == before and len(seen) == 1 else f"refs {before} -> {after}, {seen}"

    assert in_child(child) == "ok"


@needs_fork
def test_forked_child_gets_a_fresh_pool():
    pool = Pool(HostBackend())
    a = pool.allocate(4096)
    keep = a.ptr
    del a                                     # cached in the parent

    def child():                              # must not reuse the parent's block
        st = pool.stats()
        b = pool.allocate(4096)
        return "ok" if len(st) == 0 and b.ptr != keep and pool.stats().misses == 1 else "reused"

    assert in_child(child) == "ok"
    assert pool.allocate(4096).ptr == keep    # the parent's pool is untouched


@needs_fork
def test_fork_resets_a_core_whose_pool_wrapper_is_gone():
    pool = Pool(HostBackend(), debug="raise")
    core = pool._core                         # what CuPy keeps through MemoryPool.malloc
    del pool
    core.allocate(4096).release()
    assert core.devices() == [0]
    assert in_child(lambda: "ok" if core.devices() == [] and not core.debug_hook.where else "kept") == "ok"


@needs_fork
def test_parent_blocks_dying_in_a_child_are_ignored_quietly():
    import sys

    from cupy.cuda import memory as cupy_memory
    pool = xpool.MemoryPool(backend=HostBackend())
    param, malloc_fn, free_fn = pool._core.cfunctions()
    held = [cupy_memory.CFunctionAllocatorMemory(4096, param, malloc_fn, free_fn, 0)]
    direct = pool.allocate(4096)

    def child():
        seen = []
        sys.unraisablehook = seen.append
        held.clear()                          # CuPy's memory object dies here
        direct.release()                      # an inherited block: nothing to give back here
        return "ok" if not seen and list(pool.stats()) == [] else repr(seen)

    assert in_child(child) == "ok"
    assert pool.stats().blocks_in_use == 2   # the parent's pool is untouched


KiB, MiB = 1 << 10, 1 << 20


SEGMENT = 2 * MiB              # a block up to 1 MiB starts a segment of this size; a larger one, of its own


def make(capacity=None, n_devices=8, **kw):
    backend = HostBackend(capacity=capacity, n_devices=n_devices)
    return Pool(backend, **kw), backend


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_forked_child_starts_without_the_parents_segments():
    pool, backend = make()
    a = pool.allocate(4096)                # the parent's segment has a live range and a free rest

    def child():
        b = pool.allocate(4096)            # must not be cut from the parent's segment
        a.release()                        # the parent's block: nothing to give back here
        s = pool.stats()
        inside = a.ptr <= b.ptr < a.ptr + SEGMENT
        return "ok" if not inside and (s.device_mallocs, s.blocks_in_use) == (1, 1) else "reused"

    assert in_child(child) == "ok"
    assert pool.stats().blocks_in_use == 1 and a.ptr
