"""Debug mode: poison catches use-after-free, canaries catch overruns; the timeline; fork safety."""
import ctypes
import os
import warnings

import pytest

import xpool
from faults import in_child as in_forked_child
from xpool import Pool
from xpool_twin import HostBackend
from xpool.debug import CANARY, POISON


def make(mode="raise"):
    return Pool(HostBackend(), debug=mode)


def test_freed_block_reads_as_poison():
    pool = make()
    a = pool.allocate(256)
    ptr, size = a.ptr, a.size
    ctypes.memset(ptr, 0x11, 256)
    del a                                    # a stale pointer now reads NaN bytes
    assert ctypes.string_at(ptr, size) == bytes([POISON]) * size
    import numpy as np
    stale = np.frombuffer(ctypes.string_at(ptr, 64), dtype=np.float32)
    assert np.isnan(stale).all()


def test_write_after_free_is_caught_on_reuse():
    pool = make()
    a = pool.allocate(256)
    ptr = a.ptr
    del a
    ctypes.memset(ptr + 10, 0x00, 1)          # the planted use-after-free write
    with pytest.raises(xpool.CorruptionError, match="written after it was freed: byte 10"):
        pool.allocate(256)
    b = pool.allocate(256)                    # reported once; the block is usable again
    assert b.ptr == ptr


def test_one_byte_overrun_is_caught_with_size_device_and_site():
    pool = make()
    a = pool.allocate(100)
    assert a.size >= 100 + 64                 # debug mode keeps room for the canary
    assert ctypes.string_at(a.ptr + 100, a.size - 100) == bytes([CANARY]) * (a.size - 100)
    ctypes.memset(a.ptr + 100, 0x00, 1)       # the planted one-byte overrun
    del a                                     # found here; a destructor cannot raise...
    with pytest.raises(xpool.CorruptionError) as info:
        pool.allocate(8)                      # ...so the next allocation does
    msg = str(info.value)
    assert "requested 100 B" in msg and "device 0" in msg and "+0 past the end" in msg
    assert "test_debug.py" in msg             # where the block was allocated


def test_check_finds_overrun_in_live_blocks():
    pool = make()
    a = pool.allocate(1000)
    pool.check()
    ctypes.memset(a.ptr + 1003, 0x00, 1)
    with pytest.raises(xpool.CorruptionError, match=r"\+3 past its end"):
        pool.check()


def test_warn_mode_warns_instead():
    pool = make("warn")
    a = pool.allocate(10)
    ctypes.memset(a.ptr + 10, 0x00, 5)
    with pytest.warns(xpool.errors.CorruptionWarning, match="write past the end"):
        del a
    pool.allocate(10)                         # nothing pending


def test_clean_use_reports_nothing():
    pool = make()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for n in (1, 511, 512, 4096, 1 << 20, 3 << 20):
            a = pool.allocate(n)
            ctypes.memset(a.ptr, 0x33, n)
            del a
            b = pool.allocate(n)
            del b
        pool.check()
    assert pool._hook.found == []


def test_debug_from_environment(monkeypatch):
    monkeypatch.setenv("XPOOL_DEBUG", "warn")
    assert Pool(HostBackend()).settings.debug == "warn"
    monkeypatch.setenv("XPOOL_DEBUG", "0")
    assert Pool(HostBackend()).settings.debug is False
    assert Pool(HostBackend(), debug=True).settings.debug == "raise"


def test_debug_off_adds_no_tail():
    pool = Pool(HostBackend(), debug=False)
    assert pool.allocate(512).size == 512


needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")


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

    assert in_forked_child(child) == "ok"
    assert pool.allocate(4096).ptr == keep    # the parent's pool is untouched


@needs_fork
def test_fork_resets_a_core_whose_pool_wrapper_is_gone():
    pool = Pool(HostBackend(), debug="raise")
    core = pool._core                         # what CuPy keeps through MemoryPool.malloc
    del pool
    core.allocate(4096).release()
    assert core.devices() == [0]
    assert in_forked_child(lambda: "ok" if core.devices() == [] and not core.debug_hook.where else "kept") == "ok"


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

    assert in_forked_child(child) == "ok"
    assert pool.stats().blocks_in_use == 2   # the parent's pool is untouched
