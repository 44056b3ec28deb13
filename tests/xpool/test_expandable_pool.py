"""Scheme expandable wired into the pool (Note [Expandable segments] in xpool/_pages.c): Pool(scheme="expandable")
over TwinBackend's host twin, whose pages, ranges and counters every test audits the pool against.  The range
manager alone is tests/xpool/test_expandable.py; the GPU checks are tests/lab/test_gpu_expandable.py; the replays of
the H200's traces and the reserve up front are the lab's (tests/lab/test_replays.py, tests/lab/test_reserve.py)."""
import ctypes
import gc
import os
import pickle
import threading
import time

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import xpool
from faults import AddressBackend, in_child
from fixtures.torch_c import FREE, LAST_ERROR, MALLOC, TRY_MALLOC, addr, build_harness  # noqa: F401
from xpool import Pool, Settings
from xpool.debug import CANARY, POISON
from xpool_twin import TwinBackend


P = 1 << 16                     # the twin's default granularity: the scheme's page
MiB = 1 << 20


def make(capacity=None, n_devices=2, granularity=P, **kw):
    backend = TwinBackend(capacity=capacity, n_devices=n_devices, granularity=granularity)
    return Pool(backend, scheme="expandable", **kw), backend


def stats(pool, device=0):
    return pool._core.stats(device)


def total(pool, name):
    return sum(stats(pool, d)[name] for d in list(pool.stats()))


def audit(pool, backend):
    """Reserved is what the twin maps, device by device; the device calls are the twin's; nothing in flight;
    nothing unmapped while a device captured; no backend allocation at all."""
    twin = backend.twin
    for d in list(pool.stats()):
        s = stats(pool, d)
        assert s["bytes_reserved"] == twin.mapped_bytes(d), (d, s, twin.mapped_bytes(d))
        assert s["bytes_in_use"] + s["bytes_cached"] == s["bytes_reserved"], s
        assert s["bytes_pending"] == s["bytes_releasing"] == 0, s
        assert s["requests"] == s["hits"] + s["misses"], s
    c = twin.counters()
    # device_unmaps counts the unmap calls that unmapped pages, a failed call's prefix too; the twin counts a failed
    # call among its unmap_failures: without a failed unmap the two agree exactly
    unmaps = total(pool, "device_unmaps")
    assert total(pool, "device_maps") == c["maps"]
    assert c["unmaps"] <= unmaps <= c["unmaps"] + c["unmap_failures"], (unmaps, c)
    if not c["unmap_failures"]:
        assert unmaps == c["unmaps"], (unmaps, c)
    assert c["unmaps_while_capturing"] == 0
    assert total(pool, "device_mallocs") == total(pool, "device_frees") == backend.mallocs == 0


def fill(a, byte):
    ctypes.memset(a.ptr, byte, a.requested)


def intact(a, byte):
    return ctypes.string_at(a.ptr, a.requested) == bytes([byte]) * a.requested


# --- settings and backends

def test_the_scheme_comes_from_the_argument_or_the_environment(monkeypatch):
    s = Settings(scheme="expandable")
    assert (s.scheme, s.source("scheme"), s.classes_per_doubling) == ("expandable", "scheme", None)
    assert "expandable" in xpool.settings.SCHEMES
    monkeypatch.setenv("XPOOL_SCHEME", "expandable")
    assert (Settings().scheme, Settings().source("scheme")) == ("expandable", "XPOOL_SCHEME")
    pool = Pool(TwinBackend())
    assert pool.settings.scheme == pool._core.scheme == "expandable"


def test_a_backend_without_virtual_memory_is_refused_naming_the_scheme_and_the_backend():
    with pytest.raises(TypeError, match=r"^scheme 'expandable' needs a backend with virtual memory .*"
                                        r"AddressBackend has none: use scheme 'segments'"):
        Pool(AddressBackend(), scheme="expandable")
    Pool(AddressBackend())                                 # the other schemes need none

    class NoDriver(TwinBackend):
        def vmm(self):
            raise xpool._core.VmmError("cannot load the CUDA driver (libcuda.so.1)")

    with pytest.raises(RuntimeError, match=r"scheme 'expandable': NoDriver.vmm\(\) failed: cannot load") as e:
        Pool(NoDriver(), scheme="expandable")
    assert isinstance(e.value.__cause__, xpool._core.VmmError)

    class Junk(TwinBackend):
        def vmm(self):
            return 42

    with pytest.raises(TypeError, match=r"Junk.vmm\(\) must return an 'xpool.vmm' capsule"):
        Pool(Junk(), scheme="expandable")


# --- the hit path, streams, devices

def test_blocks_live_in_mapped_pages_and_reserved_is_what_is_mapped():
    pool, backend = make()
    twin = backend.twin
    a = pool.allocate(100_000)
    b = pool.allocate(3 * P)
    for x, byte in ((a, 1), (b, 2)):
        assert twin.is_mapped(x.ptr) and twin.is_mapped(x.ptr + x.size - 1)
        fill(x, byte)
    s = stats(pool)
    assert (s["misses"], s["hits"], s["device_maps"], s["device_mallocs"]) == (2, 0, 2, 0)
    assert s["bytes_reserved"] == twin.mapped_bytes(0) == 5 * P  # 100000 B: 2 pages; b: 3 more after a's rest
    assert s["bytes_in_use"] == a.size + b.size == (100_352 + 3 * P)
    assert intact(a, 1) and intact(b, 2)
    audit(pool, backend)


def test_hits_and_frees_map_and_unmap_nothing():
    pool, backend = make()
    pool.allocate(4 * P).release()
    before = backend.twin.counters()
    for n in (P, 4 * P, 1000, 3 * P + 7):
        a = pool.allocate(n)
        a.release()
    s = stats(pool)
    assert s["hits"] == 4 and backend.twin.counters() == before
    audit(pool, backend)


def test_a_block_is_reused_only_on_its_stream():
    pool, backend = make()
    a = pool.allocate(2 * P, stream=1)
    ptr = a.ptr
    a.release()
    b = pool.allocate(2 * P, stream=2)                   # stream 2's own range: a new one
    assert b.ptr != ptr and len(backend.twin.ranges()) == 2
    assert [r for r in backend.twin.ranges() if r[1] <= ptr < r[1] + r[2]] != \
           [r for r in backend.twin.ranges() if r[1] <= b.ptr < r[1] + r[2]]
    c = pool.allocate(2 * P, stream=1)
    assert c.ptr == ptr and stats(pool)["hits"] == 1
    audit(pool, backend)


def test_each_device_has_its_own_ranges_and_pages():
    backend = TwinBackend(n_devices=2, granularity=[P, 4 * P])
    pool = Pool(backend, scheme="expandable")
    a0, a1 = pool.allocate(1000, device=0), pool.allocate(1000, device=1)
    assert backend.twin.mapped_bytes(0) == P and backend.twin.mapped_bytes(1) == 4 * P
    assert {(d, n) for d, _, n, _ in backend.twin.pages()} == {(0, P), (1, 4 * P)}
    audit(pool, backend)
    del a0, a1


def test_pages_are_mapped_for_every_device_that_can_access_them():
    """Each map names every device the backend says can access the pool's device (the twin: every other one unless
    set), so another GPU's copy or kernel reaches a block as it reaches cudaMalloc's memory: behaviour, not a
    setting.  Asked once per device, on its first miss."""
    backend = TwinBackend(n_devices=3, granularity=P)
    backend.twin.set_peers(2, 0b001)                      # device 1 has no P2P to device 2
    pool = Pool(backend, scheme="expandable")
    held = [pool.allocate(1000, device=d) for d in (0, 1, 2)] + [pool.allocate(5 * P, device=0)]
    assert sorted({(d, peers) for d, _, _, peers in backend.twin.pages()}) == [(0, 0b110), (1, 0b101), (2, 0b001)]
    audit(pool, backend)
    backend.twin.set_peers(0, 0b010)                      # asked once: a later map names its first answer, which
    before = stats(pool)                                  # the twin now refuses, as a driver would a lost peer:
    with pytest.raises(RuntimeError, match="cannot access device 0"):   # the request fails, nothing is kept
        pool.allocate(9 * P, device=0)
    after = stats(pool)
    assert (after["bytes_reserved"], after["device_maps"], after["blocks_in_use"]) == \
           (before["bytes_reserved"], before["device_maps"], before["blocks_in_use"])
    audit(pool, backend)
    del held


def test_a_device_no_other_can_access_maps_for_itself_alone():
    backend = TwinBackend(n_devices=2, granularity=P)
    backend.twin.set_peers(1, 0)                          # GPUs without P2P between them
    pool = Pool(backend, scheme="expandable")
    held = [pool.allocate(P, device=1), pool.allocate(P, device=0)]
    assert sorted((d, peers) for d, _, _, peers in backend.twin.pages()) == [(0, 0b10), (1, 0)]
    audit(pool, backend)
    del held


# --- giving pages back

def test_empty_cache_unmaps_every_free_page_and_gives_the_ranges_back():
    pool, backend = make()
    keep = pool.allocate(P // 2)
    for n in (3 * P, 1000, 5 * P):
        pool.allocate(n, stream=3).release()
    pool.allocate(2 * P).release()
    assert pool.empty_cache() == backend.twin.counters()["unmap_pages"] * P > 0
    assert backend.twin.mapped_bytes(0) == P and stats(pool)["bytes_cached"] == P - P // 2
    assert len(backend.twin.ranges()) == 1                  # stream 3's range went back, stream 0's holds keep
    assert [a for _, a, _, _ in backend.twin.pages()] == [keep.ptr]
    audit(pool, backend)


def test_trim_unmaps_until_keep_bytes_stay_and_keeps_the_ranges():
    pool, backend = make()
    blocks = [pool.allocate(n * P) for n in (4, 1, 2, 1)]
    for i in (0, 2):
        blocks[i].release()                               # free runs of 4 and 2 pages
    assert pool.trim(4 * P) == 2 * P                      # the 2-page run covers it alone
    assert stats(pool)["bytes_cached"] == 4 * P and not backend.twin.is_mapped(blocks[1].ptr + P)
    assert pool.trim(0) == 4 * P and stats(pool)["bytes_cached"] == 0
    assert len(backend.twin.ranges()) == 1                # trim keeps the address range
    audit(pool, backend)


def test_free_all_blocks_of_one_stream_leaves_the_other_streams_pages():
    pytest.importorskip("cupy.cuda.memory")
    pool = xpool.MemoryPool(backend=TwinBackend(granularity=P), scheme="expandable")
    pool.allocate(3 * P, stream=1).release()
    pool.allocate(2 * P, stream=2).release()

    class S:
        ptr = 1
    pool.free_all_blocks(stream=S())
    assert stats(pool)["bytes_cached"] == 2 * P and len(pool._backend.twin.ranges()) == 2
    pool.free_all_blocks()
    assert pool._backend.twin.pages() == [] and pool._backend.twin.ranges() == []


# --- the limit

def test_the_limit_counts_mapped_bytes():
    pool, backend = make(limit=6 * P)
    pool.allocate(4 * P, stream=1).release()              # 4 pages cached on stream 1
    a = pool.allocate(4 * P)                              # 4 + 4 > 6: stream 1's pages go back first, then it fits
    s = stats(pool)
    assert (s["bytes_reserved"], s["oom_recoveries"], s["device_unmaps"]) == (4 * P, 1, 1)
    b = pool.allocate(2 * P)                              # 6: at the limit
    with pytest.raises(xpool.OutOfMemoryError, match="the xpool limit refused") as e:
        pool.allocate(P)
    assert e.value.reason == "limit" and backend.twin.mapped_bytes(0) == 6 * P
    b.release()
    before = backend.twin.counters()
    with pytest.raises(xpool.OutOfMemoryError) as e:
        pool.allocate(7 * P)                              # larger than the limit itself: raised at once
    assert e.value.reason == "limit_too_small" and backend.twin.counters() == before   # the cache was left alone
    audit(pool, backend)
    del a


class Hook:
    """A debug hook doing nothing but what `segment` says when new pages are mapped (on_segment)."""

    def __init__(self, segment=None):
        self.segment = segment

    def on_alloc(self, b):
        pass

    on_reuse = on_free = on_alloc

    def on_segment(self, b):
        if self.segment:
            self.segment(b)


def test_the_limit_counts_maps_in_flight():
    """While a miss maps its pages, its bytes count against the limit: a second request meanwhile (here from the
    debug hook that runs after the maps, before the block is made) cannot pass the limit with it."""
    pool, backend = make(limit=4 * P)
    seen = {}

    def meanwhile(b):
        if seen:
            return
        seen["pending"] = stats(pool)["bytes_pending"]
        try:
            pool.allocate(2 * P)                          # 0 mapped + 2 pages fits; 3 in flight + 2 does not
            seen["inner"] = "allocated"
        except xpool.OutOfMemoryError as e:
            seen["inner"] = e.reason

    pool._core.set_debug(Hook(meanwhile), 0)
    a = pool.allocate(3 * P)
    assert seen == {"pending": 3 * P, "inner": "limit"} and a.size == 3 * P
    pool._core.set_debug(None, 0)
    audit(pool, backend)


def test_the_limit_holds_with_threads_sharing_a_device():
    limit = 24 * P
    pool, backend = make(limit=limit)
    errors, over = [], []

    def work(i):
        import random
        rng, held = random.Random(i), []
        try:
            for _ in range(300):
                if held and rng.random() < 0.5:
                    held.pop(rng.randrange(len(held))).release()
                    continue
                try:
                    held.append(pool.allocate(rng.choice([P // 3, P, 3 * P, 5 * P]), stream=rng.randrange(3)))
                except xpool.OutOfMemoryError:
                    pass
                if backend.twin.mapped_bytes(0) > limit:
                    over.append(backend.twin.mapped_bytes(0))
                if rng.random() < 0.05:
                    pool.trim(rng.randrange(limit))
        except Exception as e:  # noqa: BLE001 - checked below
            errors.append(e)
        finally:
            held.clear()

    ts = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert errors == [] and over == []
    assert stats(pool)["peak_bytes_reserved"] <= limit and stats(pool)["bytes_in_use"] == 0
    audit(pool, backend)


# --- out of memory

def test_out_of_memory_unmaps_free_pages_of_every_stream_and_retries():
    pool, backend = make(capacity=8 * P)
    pool.allocate(6 * P, stream=1).release()
    a = pool.allocate(4 * P)
    s = stats(pool)
    assert (s["oom_recoveries"], s["bytes_reserved"]) == (1, 4 * P) and backend.twin.is_mapped(a.ptr)
    assert backend.twin.counters()["map_failures"] == 1
    audit(pool, backend)


def test_garbage_collection_is_the_ladders_second_step():
    pool, backend = make(capacity=4 * P)

    class Cycle:
        pass
    gc.disable()
    try:
        c = Cycle()
        c.me, c.block = c, pool.allocate(3 * P)
        del c                                             # only the collector can give its block back
        a = pool.allocate(3 * P)
    finally:
        gc.enable()
    assert stats(pool)["oom_recoveries"] == 1 and backend.twin.is_mapped(a.ptr)
    audit(pool, backend)


def test_out_of_memory_raises_with_the_reason_and_the_twins_words():
    pool, backend = make(capacity=4 * P)
    held = pool.allocate(3 * P)
    with pytest.raises(xpool.OutOfMemoryError, match="out of memory on device 0: device 0 refused") as e:
        pool.allocate(2 * P)
    assert e.value.reason == "device" and isinstance(e.value.__cause__, MemoryError)
    assert "out of memory at page 1 of 2" in str(e.value.__cause__)
    with pytest.raises(xpool.errors.RequestTooLargeError):
        pool.allocate(5 * P)
    s = stats(pool)
    assert (s["oom_errors"], s["bytes_in_use"], s["blocks_in_use"]) == (2, 3 * P, 1)
    audit(pool, backend)
    del held


def test_a_failing_map_that_is_not_out_of_memory_is_raised_at_once():
    pool, backend = make()
    pool.allocate(P, stream=1).release()
    backend.twin.fail_maps(count=1, kind="error", after_pages=1)
    with pytest.raises(RuntimeError, match=r"scheme expandable, device 0\): map: injected failure at page 1"):
        pool.allocate(3 * P)
    assert stats(pool)["device_unmaps"] == 0 and backend.twin.counters()["map_failures"] == 1
    audit(pool, backend)
    assert backend.twin.is_mapped(pool.allocate(3 * P).ptr)   # and the next one works


def test_a_failing_unmap_is_raised_by_empty_cache_and_its_pages_stay_cached():
    pool, backend = make()
    a = pool.allocate(3 * P)
    b = pool.allocate(P)
    a.release()
    backend.twin.fail_unmaps(count=1, after_pages=1)
    with pytest.raises(RuntimeError, match="unmap: injected failure at page 1 of 3"):
        pool.empty_cache()
    assert stats(pool)["bytes_cached"] == 2 * P and backend.twin.mapped_bytes(0) == 3 * P
    audit(pool, backend)
    assert pool.empty_cache() == 2 * P
    audit(pool, backend)
    del b


def test_out_of_address_space_gives_emptied_ranges_back_and_retries():
    pool, backend = make()
    pool.allocate(P, stream=1).release()                  # a range of stream 1, its pages free
    backend.twin.fail_reserves(1)
    a = pool.allocate(P, stream=2)                        # stream 2's range: refused once, then reserved
    assert stats(pool)["oom_recoveries"] == 1 and backend.twin.counters()["reserve_failures"] == 1
    assert len(backend.twin.ranges()) == 1 and backend.twin.is_mapped(a.ptr)   # stream 1's went back
    backend.twin.fail_reserves(3)
    with pytest.raises(xpool.OutOfMemoryError, match="refused") as e:
        pool.allocate(P, stream=3)
    assert e.value.reason == "device" and "reserve: injected failure" in str(e.value.__cause__)
    audit(pool, backend)


# --- the one release rule: a miss only adds (docs/decisions/0001-one-release-rule-per-scheme.md)

def test_a_miss_unmaps_nothing_whatever_is_free():
    pool, backend = make()
    a = pool.allocate(4 * P)
    z = pool.allocate(P)                                  # bounds a: no miss can join a's pages
    pool.allocate(2 * P, stream=1).release()              # another stream's free pages
    ptr = a.ptr
    a.release()                                           # 4 idle pages of its own stream
    for _ in range(70):
        pool.allocate(P // 2, stream=1).release()         # a's pages stay idle for 70 requests
    b = pool.allocate(6 * P)                              # above every mark the pool had: maps 6 pages more
    c = pool.allocate(9 * P)
    s = stats(pool)
    assert (s["device_unmaps"], s["bytes_reserved"]) == (0, 22 * P) and backend.twin.is_mapped(ptr)
    assert backend.twin.counters()["unmaps"] == 0
    audit(pool, backend)
    assert pool.empty_cache() == 6 * P                    # a's 4 pages and stream 1's 2 go back here
    audit(pool, backend)
    del z, b, c


def test_a_loop_whose_requests_repeat_makes_no_device_call_once_warm():
    """A fixed-shape step whose layout shifts by half a page every other step: the misses of the first steps map,
    and from then on the step is served by hits alone (a miss never unmaps what a later step needs)."""
    pool, backend = make()
    calls = []
    for k in range(8):
        before = stats(pool)
        pad = [pool.allocate(P // 2)] if k % 2 else []
        small = [pool.allocate(P) for _ in range(8)]
        for a in small[::2]:
            a.release()
        big = pool.allocate(5 * P)
        s = stats(pool)
        calls.append((s["device_maps"] - before["device_maps"], s["device_unmaps"] - before["device_unmaps"]))
        audit(pool, backend)
        del big, small, pad
    assert all(unmaps == 0 for _, unmaps in calls) and calls[-4:] == [(0, 0)] * 4, calls


# --- capture safety

def test_nothing_is_unmapped_while_the_device_captures():
    pool, backend = make(capacity=8 * P)
    twin = backend.twin
    pool.allocate(5 * P, stream=1).release()
    held = pool.allocate(P)
    twin.set_capturing(0, True)
    assert pool.empty_cache() == 0 and pool.trim(0) == 0 and twin.mapped_bytes(0) == 6 * P
    with pytest.raises(xpool.OutOfMemoryError, match="capturing a CUDA graph") as e:
        pool.allocate(4 * P)                              # out of memory: the cache is kept
    assert e.value.reason == "device_capturing" and stats(pool)["bytes_cached"] == 5 * P
    a = pool.allocate(P)                                  # a miss that fits still maps (and unmaps nothing)
    assert twin.is_mapped(a.ptr) and stats(pool)["device_unmaps"] == 0
    assert twin.counters()["unmaps_while_capturing"] == 0
    twin.set_capturing(0, False)
    assert pool.empty_cache() == 5 * P
    audit(pool, backend)
    del held


def test_another_threads_per_thread_stream_holds_back_what_this_thread_gives():
    """A range of another thread's per-thread stream (handle 2, keyed per thread: through PyTorch's entry point
    here): no other thread can ask whether it captures, so nothing is unmapped on that device from here; the
    thread itself can."""
    pool, backend = make()
    pool._core.bind_torch()
    ready, go, done = threading.Event(), threading.Event(), {}

    def other():
        FREE(TRY_MALLOC(2 * P, 0, 2), 0, 0, 2)            # its own per-thread stream
        ready.set()
        go.wait()
        done["own"] = pool.empty_cache()                  # its own thread: asked by its handle, not capturing

    t = threading.Thread(target=other)
    t.start()
    ready.wait()
    pool.allocate(3 * P).release()
    assert pool.empty_cache() == 0 and backend.twin.mapped_bytes(0) == 5 * P
    go.set()
    t.join()
    assert done["own"] == 5 * P and backend.twin.mapped_bytes(0) == 0
    t = threading.Thread(target=lambda: FREE(TRY_MALLOC(2 * P, 0, 2), 0, 0, 2))
    t.start()
    t.join()
    freed = 0
    for _ in range(200):                                  # once that thread has ended (its key is marked so when
        freed = pool.empty_cache()                        # the system thread exits, after join), its pages go back
        if freed:
            break
        time.sleep(0.01)
    assert freed == 2 * P and backend.twin.ranges() == []
    audit(pool, backend)


# --- statistics and the timeline


# --- debug mode

def test_debug_mode_poisons_new_pages_and_catches_a_write_in_them():
    pool, backend = make(debug="raise")
    a = pool.allocate(1000)                               # 1000 B + 64 B of canary; the page's rest is free
    end = a.ptr + a.size
    assert ctypes.string_at(end, P - a.size) == bytes([POISON]) * (P - a.size)
    assert ctypes.string_at(a.ptr + 1000, a.size - 1000) == bytes([CANARY]) * (a.size - 1000)
    ctypes.memset(end + 100, 7, 1)                        # a write into free space
    with pytest.raises(xpool.CorruptionError, match="written after it was freed"):
        pool.allocate(2000)                               # the free rest, reused: its poison is checked
    a.release()
    pool.check()


def test_debug_mode_catches_a_write_past_the_request():
    pool, backend = make(debug="raise")
    a = pool.allocate(3 * P)
    ctypes.memset(a.ptr + 3 * P, 0, 1)
    a.release()
    with pytest.raises(xpool.CorruptionError, match="write past the end"):
        pool.allocate(10)
    audit(pool, backend)


def test_nothing_is_unmapped_while_a_check_reads_live_blocks():
    """check() reads canaries from a listing of live blocks that other threads may free meanwhile: while it reads
    (a pin), their pages stay mapped, and an unmap waits for it."""
    pool, backend = make()
    pool.allocate(3 * P).release()
    pool._core.pin_pages(True)
    done = {}
    t = threading.Thread(target=lambda: done.setdefault("freed", pool.empty_cache()))
    t.start()
    try:
        t.join(0.3)
        waited, mapped = t.is_alive(), backend.twin.mapped_bytes(0)
    finally:
        pool._core.pin_pages(False)
        t.join()
    assert waited and mapped == 3 * P, "an unmap did not wait for the pin"
    assert done["freed"] == 3 * P and backend.twin.mapped_bytes(0) == 0
    audit(pool, backend)
    pool, backend = make(debug="raise")
    pool.allocate(3 * P).release()
    pool.check()                                          # pins and lets go
    assert pool.empty_cache() == 4 * P                    # 3 pages and the canary's
    audit(pool, backend)


def test_a_failing_poison_of_new_pages_keeps_them_cached_and_raises():
    pool, backend = make()

    def fail(b):
        raise OSError("fill failed")

    pool._core.set_debug(Hook(fail), 0)
    with pytest.raises(OSError, match="fill failed"):
        pool.allocate(2 * P)
    s = stats(pool)
    assert (s["blocks_in_use"], s["bytes_cached"], s["bytes_reserved"]) == (0, 2 * P, 2 * P)
    pool._core.set_debug(None, 0)
    assert pool.allocate(2 * P).size == 2 * P and stats(pool)["hits"] == 1
    audit(pool, backend)


# --- fork

@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_a_forked_child_forgets_the_parents_pages_and_never_unmaps_them():
    pool, backend = make()
    a = pool.allocate(2 * P)
    fill(a, 5)
    pool.allocate(3 * P).release()                        # cached pages of the parent

    def child():
        before = backend.twin.counters()["unmap_pages"]
        b = pool.allocate(P)                              # the child's own range and page
        inside = any(r[1] <= b.ptr < r[1] + r[2] and r[1] <= a.ptr < r[1] + r[2] for r in backend.twin.ranges())
        ptr, n = a.ptr, a.requested
        a.release()                                       # the parent's block: forgotten
        b.release()
        freed = pool.empty_cache()
        kept = backend.twin.is_mapped(ptr) and ctypes.string_at(ptr, n) == bytes([5]) * n
        unmapped = backend.twin.counters()["unmap_pages"] - before
        return "ok" if not inside and kept and freed == P and unmapped == 1 else \
            f"inside={inside} kept={kept} freed={freed} unmapped={unmapped}"

    assert in_child(child) == "ok"
    assert intact(a, 5) and stats(pool)["blocks_in_use"] == 1
    audit(pool, backend)


# --- CUDA IPC

def test_ipc_of_an_expandable_block_is_refused_with_a_clear_error():
    pool, backend = make()
    a = pool.allocate(3 * P)
    for ptr in (a.ptr, a.ptr + P + 17):
        with pytest.raises(xpool.errors.IpcUnsupportedError, match="CUDA IPC cannot share.*scheme 'segments'") as e:
            pool.check_ipc(ptr, device=0)
        assert (e.value.device, e.value.ptr) == (0, ptr) and e.value.base <= ptr < e.value.base + e.value.nbytes
        # the setting that fixes it, both ways a program sets it (docs/usage.md: CUDA IPC)
        assert 'scheme="segments"' in str(e.value) and "XPOOL_SCHEME=segments" in str(e.value)
    again = pickle.loads(pickle.dumps(e.value))
    assert str(again) == str(e.value)
    pool.check_ipc(12345, device=0)                       # no range of this pool: nothing to say
    other = Pool(TwinBackend())
    other.check_ipc(other.allocate(1000).ptr)             # ordinary device memory


# --- the CuPy drop-in over host memory

def test_the_cupy_drop_in_serves_cupys_memory_objects():
    cupy_memory = pytest.importorskip("cupy.cuda.memory")
    pool = xpool.MemoryPool(scheme="expandable", backend=TwinBackend(granularity=P))
    param, malloc_fn, free_fn = pool._core.cfunctions()
    mem = cupy_memory.CFunctionAllocatorMemory(5000, param, malloc_fn, free_fn, 0)
    assert mem.size == 5000 and pool._backend.twin.is_mapped(mem.ptr)
    assert (pool.used_bytes(), pool.total_bytes()) == (5120, P)
    del mem
    assert pool.used_bytes() == 0 and pool.n_free_blocks() == 1
    pool.free_all_blocks()
    assert pool._backend.twin.pages() == [] and pool.total_bytes() == 0


# --- PyTorch's entry points: the miss needs no GIL


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    lib = build_harness(tmp_path_factory)
    held = ctypes.PyDLL(lib._name)                       # PyDLL: its calls keep the GIL
    held.hold_gil_until_done.restype, held.hold_gil_until_done.argtypes = ctypes.c_int, [ctypes.c_double]
    return lib, held


@pytest.fixture
def torch_pool():
    made = []

    def bind(**kw):
        pool, backend = make(**kw)
        pool._core.bind_torch()
        made.append(pool)
        return pool, backend
    yield bind
    for p in made:
        assert stats(p)["bytes_in_use_torch"] == 0, "a test left a torch block in use"


def run_job(harness, sizes, hold_s):
    """The harness job allocating `sizes` (on stream 0) while this thread holds the GIL for up to hold_s:
    (whether it finished while the GIL was held, allocations that failed)."""
    lib, held = harness
    arr = (ctypes.c_ssize_t * len(sizes))(*sizes)
    assert lib.start_job(addr(MALLOC), addr(FREE), ctypes.addressof(arr), len(sizes), None) == 0
    finished = held.hold_gil_until_done(hold_s)
    return bool(finished), lib.join_job()


def test_torch_misses_of_the_expandable_scheme_run_without_the_gil(torch_pool, harness):
    pool, backend = torch_pool()
    FREE(TRY_MALLOC(1000, 0, None), 0, 0, None)          # the device's ranges are made on a first miss, with the GIL
    before = stats(pool)
    sizes = [(i + 1) * P + 512 for i in range(40)]        # each a miss: kept, so every one maps new pages
    finished, failed = run_job(harness, sizes, hold_s=20.0)
    assert finished and failed == 0, "a miss waited for the GIL"
    s = stats(pool)
    assert s["misses"] - before["misses"] == 40 and s["device_maps"] - before["device_maps"] == 40
    assert s["bytes_in_use_torch"] == 0
    audit(pool, backend)


def test_torch_misses_of_another_scheme_wait_for_the_gil(harness):
    """The control: the same job under scheme segments (its misses call backend.malloc, Python) cannot finish
    while the GIL is held, so the test above would see a miss that took it."""
    pool = Pool(TwinBackend(), scheme="segments")
    pool._core.bind_torch()
    finished, failed = run_job(harness, [(i + 1) * MiB + 512 for i in range(4)], hold_s=0.5)
    assert not finished and failed == 0 and stats(pool)["misses"] == 4


def test_a_torch_oom_recovers_without_the_gil_and_raises_through_it(torch_pool, harness):
    pool, backend = torch_pool(capacity=8 * P)
    FREE(TRY_MALLOC(6 * P, 0, 5), 0, 0, 5)                # 6 pages cached on stream 5
    finished, failed = run_job(harness, [4 * P], hold_s=20.0)   # unmaps stream 5's pages and retries, in C
    assert finished and failed == 0 and stats(pool)["oom_recoveries"] == 1
    keep = TRY_MALLOC(5 * P, 0, None)
    lib, _ = harness
    out, msg = ctypes.c_void_p(), ctypes.create_string_buffer(1024)
    assert lib.call_malloc(addr(MALLOC), 4 * P, 0, None, ctypes.byref(out), msg, 1024) == 1
    assert msg.value.decode().startswith("OutOfMemoryError: xpool: out of memory on device 0: device 0 refused")
    FREE(keep, 0, 0, None)
    assert stats(pool)["oom_errors"] == 1
    audit(pool, backend)


def test_torch_threads_keep_the_counters_exact(torch_pool):
    pool, backend = torch_pool(limit=40 * P)
    errors = []

    def work(i):
        try:
            for j in range(200):
                n = (j % 7 + 1) * (P // 3) + i * 512
                ptr = TRY_MALLOC(n, i % 2, i % 3)
                if ptr is None:
                    if not LAST_ERROR().startswith(b"OutOfMemoryError"):
                        errors.append(LAST_ERROR())
                    continue
                FREE(ptr, n, i % 2, i % 3)
        except Exception as e:  # noqa: BLE001 - checked below
            errors.append(e)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert errors == []
    assert total(pool, "requests") == total(pool, "frees") + total(pool, "oom_errors")
    assert total(pool, "bytes_in_use") == 0
    audit(pool, backend)


# --- a model: random sequences through the whole pool, every step audited against the twin

SIZES = st.one_of(st.integers(0, 3 * P), st.sampled_from([P, 2 * P, P // 2, 512]),
                  st.integers(1, 6).map(lambda k: k * P))


class PoolModel(RuleBasedStateMachine):
    @initialize(capacity=st.sampled_from([None, 12 * P, 24 * P]), debug=st.sampled_from([False, False, "raise"]))
    def setup(self, capacity, debug):
        self.pool, self.backend = make(capacity=capacity, debug=debug)
        self.twin = self.backend.twin
        self.live = []                                    # (allocation, byte)
        self.byte = 0

    @rule(size=SIZES, device=st.integers(0, 1), stream=st.sampled_from([0, 0, 1]))
    def allocate(self, size, device, stream):
        c, recoveries = self.twin.counters(), stats(self.pool, device)["oom_recoveries"]
        try:
            a = self.pool.allocate(size, device=device, stream=stream)
        except xpool.OutOfMemoryError as e:
            assert e.reason in ("device", "limit", "limit_too_small", "device_capturing", "limit_capturing",
                                "too_large"), e
            return
        except RuntimeError as e:
            assert "injected" in str(e), e
            return
        if stats(self.pool, device)["oom_recoveries"] == recoveries:   # the one release rule: a miss only adds
            now = self.twin.counters()
            assert (now["unmap_pages"], now["releases"]) == (c["unmap_pages"], c["releases"]), "a miss gave back"
        assert self.twin.is_mapped(a.ptr) and self.twin.is_mapped(a.ptr + a.size - 1)
        for b, _ in self.live:
            assert b.device != a.device or a.ptr + a.size <= b.ptr or b.ptr + b.size <= a.ptr, "overlap"
        self.byte = self.byte % 251 + 1
        fill(a, self.byte)
        self.live.append((a, self.byte))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        a, byte = self.live.pop(data.draw(st.integers(0, len(self.live) - 1)))
        assert intact(a, byte), "a live block's bytes changed"
        a.release()

    @rule(keep=st.sampled_from([0, P, 3 * P]), everything=st.booleans())
    def release(self, keep, everything):
        try:
            self.pool.empty_cache() if everything else self.pool.trim(keep)
        except RuntimeError as e:
            assert "injected" in str(e), e

    @rule(limit=st.sampled_from([0, 0, 6 * P, 16 * P]), device=st.integers(0, 1))
    def limit(self, limit, device):
        self.pool.set_limit(limit, device=device)

    @rule(kind=st.sampled_from(["oom", "error"]), after=st.integers(0, 3))
    def map_fault(self, kind, after):
        self.twin.fail_maps(count=1, kind=kind, after_pages=after)

    @rule(after=st.integers(0, 2))
    def unmap_fault(self, after):
        self.twin.fail_unmaps(count=1, after_pages=after)

    @rule()
    def reserve_fault(self):
        self.twin.fail_reserves(1)

    @rule(on=st.booleans(), device=st.integers(0, 1))
    def capturing(self, on, device):
        self.twin.set_capturing(device, on)

    @invariant()
    def consistent(self):
        if not hasattr(self, "pool"):
            return
        audit(self.pool, self.backend)
        for a, _ in self.live:
            assert self.twin.is_mapped(a.ptr) and self.twin.is_mapped(a.ptr + a.size - 1)
        if self.pool.settings.debug:
            self.pool.check()

    def teardown(self):
        if not hasattr(self, "pool"):
            return
        for d in (0, 1):
            self.twin.set_capturing(d, False)
        self.twin.fail_maps(count=0)
        self.twin.fail_unmaps(count=0)
        self.twin.fail_reserves(0)
        assert all(intact(a, byte) for a, byte in self.live)
        self.live.clear()
        self.pool.empty_cache()
        audit(self.pool, self.backend)
        assert self.twin.pages() == [] and self.twin.ranges() == []
        if self.pool.settings.debug:
            assert self.pool._hook.found == []


@pytest.mark.usefixtures("frozen_gc")
def test_random_sequences_through_the_pool_keep_every_invariant():
    PoolModel.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None,
                                           suppress_health_check=list(HealthCheck))
    PoolModel.TestCase().runTest()


def expandable(**kw):
    backend = TwinBackend(n_devices=1, granularity=P)
    return Pool(backend, scheme="expandable", **kw), backend


class Cycle:
    """Holds a block in a reference cycle: only the collector frees it."""

    def __init__(self, block):
        self.block, self.me = block, self


def _cycle_beside_a_run(pool):
    """Page 0: a block kept and a block held only by a reference cycle (its halves); page 1 unmapped by a trim, a run
    right after the held block.  The held block's pointer."""
    keep, held, last = pool.allocate(P // 2, 0, 0), pool.allocate(P // 2, 0, 0), pool.allocate(P, 0, 0)
    ptr = held.ptr
    del last
    assert pool.trim(0) == P
    Cycle(held)
    return keep, ptr


def test_a_block_the_ladders_collection_frees_serves_the_retried_request_with_no_map():
    """The limit refuses the page a request would map; the ladder collects garbage and retries: the block the cycle
    held (half a page, so no release unmapped it) holds the request and is taken, nothing mapped (before: a 0-byte map
    was planned, RuntimeError)."""
    pool, backend = expandable()
    gc.disable()
    try:
        keep, ptr = _cycle_beside_a_run(pool)
        pool.set_limit(P)
        maps = pool.stats().device_maps
        got = pool.allocate(P // 2, 0, 0)
    finally:
        gc.enable()
    s = pool.stats()
    assert got.ptr == ptr and s.device_maps == maps and s.oom_recoveries == 1 and s.oom_errors == 0
    assert s.bytes_in_use == P and s.bytes_reserved == P == backend.twin.mapped_bytes(0)
    del keep, got


def test_a_miss_joins_the_freed_block_before_a_run_with_the_pages_it_lacks():
    pool, backend = expandable()
    gc.disable()
    try:
        keep, ptr = _cycle_beside_a_run(pool)
    finally:
        gc.enable()
    gc.collect()
    maps = pool.stats().device_maps
    got = pool.allocate(P, 0, 0)                      # the freed half page, and the half of a new page it lacks
    s = pool.stats()
    assert got.ptr == ptr and s.device_maps == maps + 1 and s.bytes_reserved == 2 * P == backend.twin.mapped_bytes(0)
    del keep, got
    assert pool.empty_cache() == 2 * P and backend.twin.mapped_bytes(0) == 0
