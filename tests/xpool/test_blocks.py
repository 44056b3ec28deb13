"""Blocks handed out and given back: the live table under churn, a double free racing the next owner."""
import ctypes
import threading
import time

import pytest

from faults import AddressBackend
from xpool import Pool
from xpool_twin import HostBackend


def wait_for(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "the other thread never got there"
        time.sleep(0.001)


# The live table does not grow with addresses that came and went
@pytest.mark.usefixtures("seed_scheme")
def test_live_table_stays_small_under_address_churn():
    backend = AddressBackend()
    pool = Pool(backend)
    keep = [pool.allocate(512) for _ in range(100)]    # alive throughout
    for _ in range(20_000):                             # a new address each time, none left alive
        pool.allocate(512).release()
        pool.empty_cache(device=0)
    live_slots, live_blocks, _ = pool._core.table_sizes(0)
    assert live_blocks == 100 and live_slots <= 1024
    for a in keep:                                      # every survivor is still found
        a.release()
    st = pool._core.stats(0)
    assert st["blocks_in_use"] == 0 and st["blocks_cached"] == 100


# code read: the debug free path used the block after unlocking; a double free racing the first one then
# checked and poisoned the block after it had been cached and handed to its next owner
@pytest.mark.usefixtures("seed_scheme")
def test_a_racing_double_free_never_touches_the_blocks_next_owner():
    pool = Pool(HostBackend(), debug="raise")
    hook, real_on_free = pool._hook, pool._hook.on_free
    inside, go = [threading.Event(), threading.Event()], [threading.Event(), threading.Event()]
    calls = []

    def on_free(info):                          # the n-th free waits inside the hook until told to go
        n = len(calls)
        calls.append(n)
        if n < 2:
            inside[n].set()
            go[n].wait(10)
        real_on_free(info)

    hook.on_free = on_free
    a = pool._core.allocate(256)
    results = {}

    def free(name):
        try:
            pool._core.free_ptr(0, a.ptr)
            results[name] = "freed"
        except ValueError as e:
            results[name] = str(e)

    first = threading.Thread(target=free, args=("first",))
    first.start()
    inside[0].wait(10)
    second = threading.Thread(target=free, args=("second",))     # the double free, while the first runs
    second.start()
    wait_for(lambda: inside[1].is_set() or "second" in results)
    go[0].set()
    first.join()
    hook.on_free = real_on_free
    b = pool._core.allocate(256)                                  # the block's next owner
    assert b.ptr == a.ptr
    ctypes.memset(b.ptr, 0x11, 256)
    go[1].set()
    second.join()
    assert results["first"] == "freed" and "not handed out" in results["second"]
    assert ctypes.string_at(b.ptr, 256) == b"\x11" * 256
    b.release()
    with pytest.raises(ValueError, match="not handed out"):
        a.release()
