"""The pool core over real host memory: reuse, streams, devices, stats, OOM, limits, bad input."""
import ctypes
import gc

import pytest

import xpool
from xpool import Pool
from xpool_twin import HostBackend


@pytest.fixture(autouse=True)
def _design_scheme(monkeypatch):
    """These tests spell out the bytes of the design's size classes: they run under scheme seed.  Scheme
    segments (the default) has its own in tests/xpool/test_segments.py."""
    monkeypatch.setenv("XPOOL_SCHEME", "seed")


KiB, MiB = 1 << 10, 1 << 20


def make(capacity=None, **kw):
    backend = HostBackend(capacity=capacity)
    return Pool(backend, **kw), backend


def test_freed_block_is_reused_for_same_class():
    pool, backend = make()
    a = pool.allocate(1000)
    ptr = a.ptr
    assert (a.requested, a.size) == (1000, 1024)
    del a
    b = pool.allocate(700)           # same 1024 B class
    assert b.ptr == ptr and backend.mallocs == 1
    s = pool.stats()
    assert (s.requests, s.hits, s.misses, s.device_mallocs) == (2, 1, 1, 1)
    assert (s.bytes_in_use, s.bytes_requested, s.bytes_cached) == (1024, 700, 0)


def test_other_class_misses():
    pool, backend = make()
    a = pool.allocate(1000)
    del a
    b = pool.allocate(2000)
    assert backend.mallocs == 2 and pool.stats().blocks_cached == 1


def test_block_freed_on_a_stream_is_reused_only_on_that_stream():
    pool, backend = make()
    a = pool.allocate(4096, stream=1)
    ptr = a.ptr
    del a
    b = pool.allocate(4096, stream=2)
    assert b.ptr != ptr and backend.mallocs == 2
    c = pool.allocate(4096, stream=1)
    assert c.ptr == ptr


def test_devices_have_separate_pools():
    pool, backend = make()
    a = pool.allocate(4096, device=1)
    del a
    b = pool.allocate(4096, device=2)
    assert b.device == 2 and backend.mallocs == 2
    assert list(pool.stats()) == [1, 2]
    st = pool.stats()
    assert st[1]["blocks_cached"] == 1 and st[2]["blocks_in_use"] == 1
    assert st[1]["blocks_in_use"] == 0 and st[2]["blocks_cached"] == 0


def test_current_device_and_stream_come_from_the_backend():
    pool, backend = make()
    backend.set_device(3)
    backend.set_stream(7)
    a = pool.allocate(10)
    assert (a.device, a.stream) == (3, 7)


def test_release_is_idempotent_and_reported():
    pool, _ = make()
    a = pool.allocate(10)
    a.release()
    a.release()
    assert a.ptr == 0 and "released" in repr(a)
    assert pool.stats().frees == 1


def test_block_released_on_another_thread_returns_to_its_own_device():
    import threading
    pool, backend = make()
    backend.set_device(2)
    a = pool.allocate(5000)
    ptr = a.ptr
    box = [a]
    del a

    def other():
        backend.set_device(0)       # this thread's current device is 0
        box.clear()                  # the last reference dies here

    t = threading.Thread(target=other)
    t.start()
    t.join()
    st = pool.stats()
    assert st[2]["blocks_cached"] == 1 and list(st) == [2]
    assert pool.allocate(5000, device=2).ptr == ptr


def test_empty_cache_and_trim_give_memory_back():
    pool, backend = make()
    blocks = [pool.allocate(s) for s in (1 * MiB, 2 * MiB, 4 * MiB)]
    del blocks
    assert backend.used(0) == 7 * MiB
    released = pool.trim(3 * MiB)
    st = pool.stats()
    assert st.bytes_cached <= 3 * MiB and released == 7 * MiB - st.bytes_cached
    assert pool.empty_cache() == st.bytes_cached
    assert backend.used(0) == 0 and backend.mallocs == backend.frees == 3
    assert pool.stats().device_frees == 3


def test_oom_frees_the_cache_and_retries():
    pool, backend = make(capacity=1 * MiB)
    small = [pool.allocate(4 * KiB) for _ in range(128)]   # 512 KiB, then cached
    del small
    big = pool.allocate(768 * KiB)
    st = pool.stats()
    assert st.oom_recoveries == 1 and st.bytes_cached == 0 and big.size == 768 * KiB


def test_oom_collects_garbage_cycles_before_giving_up():
    pool, _ = make(capacity=1 * MiB)

    class Holder:
        pass

    h = Holder()
    h.block, h.me = pool.allocate(900 * KiB), h   # a cycle: only gc frees it
    del h
    gc.disable()
    try:
        b = pool.allocate(900 * KiB)
    finally:
        gc.enable()
    assert b.size == 900 * KiB and pool.stats().oom_recoveries == 1


def test_oom_raises_a_clear_error_and_leaves_live_blocks_intact():
    pool, _ = make(capacity=1 * MiB)
    live = pool.allocate(600 * KiB)
    ctypes.memset(live.ptr, 0x5A, live.requested)
    with pytest.raises(xpool.OutOfMemoryError) as info:
        pool.allocate(600 * KiB)
    err = info.value
    assert isinstance(err, MemoryError)
    msg = str(err)
    for part in ("device 0", "614,400 B", "in use 600.00 KiB", "limit none"):
        assert part in msg, msg
    assert (err.requested, err.bytes_in_use, err.reason) == (600 * KiB, 600 * KiB, "device")
    assert ctypes.string_at(live.ptr, live.requested) == b"\x5a" * live.requested
    st = pool.stats()
    assert (st.oom_errors, st.blocks_in_use, st.bytes_in_use) == (1, 1, 600 * KiB)
    import pickle
    again = pickle.loads(pickle.dumps(err))
    assert str(again) == msg


def test_limit_caps_reserved_bytes():
    pool, backend = make()
    pool.set_limit(size=2 * MiB)
    assert pool.get_limit() == 2 * MiB
    a = pool.allocate(1 * MiB)
    cached = pool.allocate(512 * KiB)
    del cached
    b = pool.allocate(1 * MiB)                       # fits only once the cache is released
    assert pool.stats().bytes_cached == 0
    with pytest.raises(xpool.OutOfMemoryError, match="limit 2.00 MiB") as info:
        pool.allocate(1)
    assert info.value.reason == "limit"
    pool.set_limit()                                  # no argument: no limit
    assert pool.get_limit() == 0
    pool.allocate(1)
    del a, b


def test_limit_by_fraction_and_environment(monkeypatch):
    pool, _ = make(capacity=8 * MiB)
    pool.set_limit(fraction=0.25)
    assert pool.get_limit() == 2 * MiB
    monkeypatch.setenv("XPOOL_MEMORY_LIMIT", "1MiB")
    assert make()[0].get_limit() == 1 * MiB
    monkeypatch.setenv("XPOOL_MEMORY_LIMIT", "50%")
    assert make(capacity=8 * MiB)[0].get_limit() == 4 * MiB
    monkeypatch.setenv("XPOOL_MEMORY_LIMIT", "lots")
    with pytest.raises(ValueError, match="XPOOL_MEMORY_LIMIT"):
        make()


def test_classes_per_doubling_changes_large_classes():
    pool, _ = make(classes_per_doubling=4)
    assert pool.allocate(4 * MiB + 1).size == 5 * MiB
    pool1, _ = make()
    assert pool1.allocate(4 * MiB + 1).size == 8 * MiB


@pytest.mark.parametrize("bad", [-1, 1.5, "10", None, True, 1 << 60])
def test_bad_sizes(bad):
    pool, backend = make()
    with pytest.raises(ValueError, match="nbytes"):
        pool.allocate(bad)
    assert backend.mallocs == 0 and list(pool.stats()) == []


@pytest.mark.parametrize("bad", [-1, 64, "0", 1.0, True])
def test_bad_devices(bad):
    pool, _ = make()
    with pytest.raises(ValueError, match="device"):
        pool.allocate(10, device=bad)


def test_bad_settings():
    backend = HostBackend()
    with pytest.raises(ValueError, match="classes_per_doubling"):
        Pool(backend, classes_per_doubling=0)
    pool = Pool(backend)
    with pytest.raises(ValueError, match="size"):
        pool.set_limit(size=-1)
    with pytest.raises(ValueError, match="not both"):
        pool.set_limit(size=1, fraction=0.5)
    with pytest.raises(ValueError, match="fraction"):
        pool.set_limit(fraction=2)
    with pytest.raises(ValueError, match="debug mode"):
        Pool(backend, debug="loud")
    with pytest.raises(ValueError, match="timeline"):
        Pool(backend, timeline=-5)
    with pytest.raises(ValueError, match="keep_bytes"):
        pool.trim(-1)


def test_freeing_a_foreign_pointer_is_an_error_and_changes_nothing():
    pool, _ = make()
    a = pool.allocate(100)
    before = pool.stats()
    with pytest.raises(ValueError, match="not handed out by this pool"):
        pool._core.free_ptr(0, a.ptr + 512)
    with pytest.raises(ValueError, match="not handed out"):
        pool._core.free_ptr(5, 4096)
    assert pool.stats() == before


def test_request_larger_than_the_device_is_bad_input_and_flushes_nothing():
    pool, backend = make(capacity=4 * MiB)
    cached = pool.allocate(1 * MiB)
    del cached
    with pytest.raises(ValueError, match="nbytes=5,000,000 .* larger than device 0") as info:
        pool.allocate(5_000_000)
    assert isinstance(info.value, xpool.OutOfMemoryError)     # CuPy code catching OOM still does
    st = pool.stats()
    assert (st.blocks_cached, st.device_frees, backend.mallocs) == (1, 0, 1)


def test_device_beyond_the_machine_is_rejected():
    pool = Pool(HostBackend(n_devices=2))
    with pytest.raises(ValueError, match=r"device must be an int in \[0, 2\)"):
        pool.allocate(10, device=2)
    with pytest.raises(ValueError, match="device"):
        pool.stats(device=7)


def test_a_backend_missing_methods_is_named():
    class Half:
        def malloc(self, device, nbytes):
            return 0

    with pytest.raises(TypeError, match="Half lacks free, fill"):
        Pool(Half())
    with pytest.raises(TypeError, match="backend must provide"):
        Pool(None)
