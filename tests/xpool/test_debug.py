"""Debug mode: poison catches use-after-free, canaries catch overruns; the timeline; fork safety."""
import ctypes
import subprocess
import sys
import textwrap
import threading
import warnings

import pytest

import xpool
from faults import InjectedFault
from xpool import CorruptionError, Pool
from xpool.debug import CANARY, DebugHook, DEFAULT_TAIL, POISON
from xpool_twin import HostBackend, TwinBackend


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


P = 1 << 16


def expandable(**kw):
    backend = TwinBackend(n_devices=1, granularity=P)
    return Pool(backend, scheme="expandable", **kw), backend


def test_debug_mode_catches_a_write_into_freed_bytes_a_miss_joins():
    """A write into the poisoned free rest of a fresh page, then a miss that joins that rest with new pages: the
    block is checked as a reused one (before: handed out unchecked)."""
    pool, _ = expandable(debug="raise")
    a = pool.allocate(P // 2 - 64, 0, 0)             # the page's second half: free, poisoned
    ctypes.memset(a.ptr + P // 2 + 100, 0x11, 1)     # a stray write into it
    with pytest.raises(CorruptionError, match="written after it was freed"):
        pool.allocate(P, 0, 0)                       # cut from that half and a new page
    del a


def test_debug_mode_hands_out_a_clean_miss_of_freed_bytes():
    pool, _ = expandable(debug="raise")
    a = pool.allocate(P // 2 - 64, 0, 0)
    b = pool.allocate(P, 0, 0)
    assert b.ptr == a.ptr + P // 2
    del a, b
    pool.check()


def test_a_debug_block_freed_at_exit_prints_nothing():
    code = textwrap.dedent("""
        import xpool
        from xpool_twin import TwinBackend
        pool = xpool.Pool(TwinBackend(), debug="raise")
        blocks = [pool.allocate(1000) for _ in range(3)]   # alive until the interpreter tears the module down
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "", r.stderr


def swap_debug_hook(pool, mode):
    """The core's hook swapped under a pool that holds blocks (debug mode is a setting of the pool; the core
    still takes a new hook at any time, and the blocks say what the hook they met prepared)."""
    pool._hook = DebugHook(pool._backend, mode) if mode else None
    pool._core.set_debug(pool._hook, DEFAULT_TAIL if mode else 0)


# Check() reports nothing while other threads allocate and free (debug mode)
@pytest.mark.usefixtures("seed_scheme")
def test_check_reports_nothing_while_other_threads_allocate():
    pool = Pool(HostBackend(), debug="raise")
    stop, errors = threading.Event(), []

    def churn():
        try:
            while not stop.is_set():
                blocks = [pool.allocate(n) for n in (100, 1000, 5000)]
                del blocks
        except Exception as e:  # noqa: BLE001 - surfaced below
            errors.append(repr(e))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)                  # switch threads inside the hooks as often as possible
    threads = [threading.Thread(target=churn) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        for _ in range(300):
            pool.check()
    finally:
        stop.set()
        for t in threads:
            t.join()
        sys.setswitchinterval(interval)
    assert errors == [] and pool._hook.found == []


# A debug hook set in a core that already holds blocks
@pytest.mark.usefixtures("seed_scheme")
def test_debug_mode_turned_on_late_reports_nothing_for_older_blocks():
    pool = Pool(HostBackend(), debug=False)
    live = pool.allocate(1000)                   # handed out without a canary
    cached = pool.allocate(3000)
    ctypes.memset(cached.ptr, 0x22, 3000)
    del cached                                   # cached without poison
    swap_debug_hook(pool, "raise")
    pool.check()
    again = pool.allocate(3000)                  # reuses the unpoisoned block
    del live                                     # freed without a canary check
    pool.allocate(8)
    pool.check()
    assert pool._hook.found == []
    ctypes.memset(again.ptr + 3000, 0, 1)        # blocks handed out in debug mode are checked
    with pytest.raises(xpool.CorruptionError, match=r"\+0 past its end"):
        pool.check()


# code read: an exception in flight survives a block dying
@pytest.mark.usefixtures("seed_scheme")
def test_an_exception_in_flight_survives_a_block_dying_in_debug_mode():
    pool = Pool(HostBackend(), debug="raise")
    with pytest.raises(TypeError):
        int(pool.allocate(1000))
    with pytest.raises(TypeError):
        int(pool.allocate(1000))                 # and the pool is fine afterwards
    assert pool.stats().blocks_in_use == 0


# code read: one allocation uses one debug hook, even if the core's set_debug swaps it meanwhile
@pytest.mark.usefixtures("seed_scheme")
def test_an_allocation_uses_the_debug_hook_it_started_with():
    class SwitchingBackend(HostBackend):
        def malloc(self, device, nbytes):
            swap_debug_hook(pool, None)          # another thread takes the hook away meanwhile
            return super().malloc(device, nbytes)

    pool = Pool(SwitchingBackend(), debug="raise")
    hook = pool._hook
    a = pool.allocate(100)
    assert a.size - 100 >= 64 and (0, a.ptr) in hook.where
    assert ctypes.string_at(a.ptr + 100, a.size - 100) == bytes([CANARY]) * (a.size - 100)


@pytest.mark.usefixtures("seed_scheme")
def test_a_failed_poison_fill_caches_no_unpoisoned_block():
    class FillFails(HostBackend):
        fail = False

        def fill(self, device, ptr, nbytes, byte):
            if self.fail and byte == POISON:
                raise InjectedFault("injected: fill failed")
            super().fill(device, ptr, nbytes, byte)

    backend = FillFails()
    pool = Pool(backend, debug="raise")
    a = pool.allocate(256)
    ctypes.memset(a.ptr, 0x11, 256)
    backend.fail = True
    with pytest.raises(InjectedFault):
        a.release()
    backend.fail = False
    b = pool.allocate(256)                       # no false "written after it was freed"
    st = pool.stats()
    assert (st.device_frees, st.blocks_in_use, st.bytes_reserved) == (1, 1, backend.used(0))
    assert pool._hook.found == []
    del b
