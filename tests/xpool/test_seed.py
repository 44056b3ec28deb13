"""Scheme seed, the design's size classes: the classes (properties with hypothesis, the documented examples, bad
input), the pool over them on host memory (reuse, streams, devices, OOM, limits, bad input), and a hypothesis state
machine of the pool against a model, counter for counter."""
import ctypes
import gc
from collections import defaultdict

import pytest
from hypothesis import event, given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import xpool
from faults import examples
from xpool import Pool, _core
from xpool.sizeclass import MAX_REQUEST
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


sizes = st.one_of(st.integers(0, 4 * MiB), st.integers(0, 1 << 40))


ks = st.integers(1, 64)


def reference(n: int, k: int) -> int:
    """The classes as the design states them, in Python: up to 1 MiB the next multiple of 512 B; above, the least of
    p + ceil(j p / k) (j = 1..k, p < n <= 2p a power of two), rounded up to 512 B, that holds n."""
    if n <= MiB:
        return max(512, -(-n // 512) * 512)
    p = 1 << ((n - 1).bit_length() - 1)
    return min(c for c in (-(-(p + -(-j * p // k)) // 512) * 512 for j in range(1, k + 1)) if c >= n)


@given(sizes, ks)
@settings(max_examples=examples(2000))
def test_class_covers_request_and_is_aligned(n, k):
    c = xpool.sizeclass.size_class(n, k)
    assert c >= max(n, 1) and c % 512 == 0


@given(sizes, ks)
@settings(max_examples=examples(2000))
def test_c_core_agrees_with_the_design(n, k):
    assert _core.size_class(n, k) == xpool.sizeclass.size_class(n, k) == reference(n, k)


@given(sizes, ks)
def test_idempotent_and_monotone(n, k):
    c = xpool.sizeclass.size_class(n, k)
    assert xpool.sizeclass.size_class(c, k) == c
    assert xpool.sizeclass.size_class(n + 1, k) >= c


@given(st.integers(MiB + 1, 1 << 40), ks)
def test_large_waste_is_bounded_by_one_class_step(n, k):
    # the gap between neighbouring classes above p is p/k (+512 rounding): waste < n/k + 512
    assert xpool.sizeclass.size_class(n, k) - n < n / k + 512


@given(st.integers(MiB + 1, 1 << 40))
def test_seed_design_is_next_power_of_two(n):
    c = xpool.sizeclass.size_class(n)
    assert c & (c - 1) == 0 and c // 2 < n <= c


def test_documented_examples():
    assert xpool.sizeclass.size_class(0) == 512
    assert xpool.sizeclass.size_class(1) == 512
    assert xpool.sizeclass.size_class(513) == 1024
    assert xpool.sizeclass.size_class(MiB) == MiB
    assert xpool.sizeclass.size_class(MiB + 1) == 2 * MiB
    # k=4 between 4 and 8 MiB: 5, 6, 7, 8 MiB
    assert [xpool.sizeclass.size_class(4 * MiB + j * MiB + 1, 4) for j in range(4)] == [5 * MiB, 6 * MiB, 7 * MiB, 8 * MiB]
    assert xpool.sizeclass.size_class(4 * MiB + 1, 4) == 5 * MiB
    assert xpool.sizeclass.size_class(5 * MiB, 4) == 5 * MiB
    # k=3 classes round to 512 B: p + p/3 for p = 2 MiB
    assert xpool.sizeclass.size_class(2 * MiB + 1, 3) == -(-(2 * MiB + -(-2 * MiB // 3)) // 512) * 512


@pytest.mark.parametrize("bad", [-1, 1.5, "10", None, True, MAX_REQUEST + 1, float("nan")])
def test_bad_sizes_raise_value_error_naming_the_argument(bad):
    with pytest.raises(ValueError, match="nbytes"):
        xpool.sizeclass.size_class(bad)


@pytest.mark.parametrize("k", [0, -1, 65, 1.0, "4", True])
def test_bad_classes_per_doubling(k):
    with pytest.raises(ValueError, match="classes_per_doubling"):
        xpool.sizeclass.size_class(1000, k)


CAPACITY = 12 << 20   # small enough that OOM recovery and OOM errors happen


SIZES = st.one_of(st.integers(0, 8192), st.sampled_from([1 << 20, (1 << 20) + 1, 3 << 20, 5 << 20]))


class PoolModel(RuleBasedStateMachine):
    """The model: live blocks, and a count of free blocks per (device, stream, class)."""

    def __init__(self):
        super().__init__()
        self.k = 2
        self.backend = HostBackend(capacity=CAPACITY, n_devices=3)
        self.pool = Pool(self.backend, scheme="seed", classes_per_doubling=self.k)
        self.live = []                                  # Allocation objects
        self.free = defaultdict(int)                    # (device, stream, class) -> count
        self.counts = defaultdict(lambda: defaultdict(int))   # device -> counter -> value

    @rule(n=SIZES, device=st.integers(0, 2), stream=st.integers(0, 2))
    def allocate(self, n, device, stream):
        cls = xpool.sizeclass.size_class(n, self.k)
        key = (device, stream, cls)
        c = self.counts[device]
        c["requests"] += 1
        if self.free[key]:
            self.free[key] -= 1
            c["hits"] += 1
        else:
            c["misses"] += 1
            in_use = sum(a.size for a in self.live if a.device == device)
            cached = sum(k[2] * v for k, v in self.free.items() if k[0] == device)
            if in_use + cached + cls > CAPACITY:        # the device refuses: flush the cache, retry
                for k in [k for k in self.free if k[0] == device]:
                    c["device_frees"] += self.free.pop(k)
                if in_use + cls > CAPACITY:
                    c["oom_errors"] += 1
                    event("oom error")
                    with pytest.raises(xpool.OutOfMemoryError):
                        self.pool.allocate(n, device=device, stream=stream)
                    return
                c["oom_recoveries"] += 1
                event("oom recovered")
            c["device_mallocs"] += 1
        a = self.pool.allocate(n, device=device, stream=stream)
        assert (a.size, a.requested, a.device, a.stream) == (cls, n, device, stream)
        self.live.append(a)

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10_000))
    def release(self, i):
        a = self.live.pop(i % len(self.live))
        self.free[(a.device, a.stream, a.size)] += 1
        self.counts[a.device]["frees"] += 1
        a.release()

    @rule(device=st.integers(0, 2))
    def empty_cache(self, device):
        if device in list(self.pool.stats()):
            self.pool.empty_cache(device)
        for k in [k for k in self.free if k[0] == device]:
            self.counts[device]["device_frees"] += self.free.pop(k)

    @invariant()
    def counters_match_the_model(self):
        for d in list(self.pool.stats()):
            s = self.pool.stats(d)
            for name in ("requests", "hits", "misses", "device_mallocs", "device_frees", "frees",
                         "oom_errors", "oom_recoveries"):
                assert s[name] == self.counts[d][name], (name, d)
            live = [a for a in self.live if a.device == d]
            assert s.blocks_in_use == len(live)
            assert s.bytes_in_use == sum(a.size for a in live)
            assert s.bytes_requested == sum(a.requested for a in live)
            cached = {k: v for k, v in self.free.items() if k[0] == d and v}
            assert s.blocks_cached == sum(cached.values())
            assert s.bytes_cached == sum(k[2] * v for k, v in cached.items())
            assert s.bytes_reserved == self.backend.used(d)

    @invariant()
    def live_blocks_never_overlap(self):
        spans = sorted((a.ptr, a.ptr + a.size) for a in self.live)
        assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))

    def teardown(self):
        self.live.clear()
        self.pool.empty_cache()
        assert sum(self.backend.used(d) for d in range(3)) == 0


PoolModel.TestCase.settings = settings(max_examples=60, stateful_step_count=60, deadline=None)


TestPoolModel = pytest.mark.usefixtures("frozen_gc")(PoolModel.TestCase)
