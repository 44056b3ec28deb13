"""Scheme segments (the default): blocks cut from segments by best fit, split, merged again; over host memory."""
import ctypes

import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import xpool
import xpool_twin
import xpool_twin.testing
from xpool import Pool
from xpool.debug import POISON
from xpool_twin import HostBackend


KiB, MiB = 1 << 10, 1 << 20
SEGMENT = 2 * MiB              # a block up to 1 MiB starts a segment of this size; a larger one, of its own


def make(capacity=None, n_devices=8, **kw):
    backend = HostBackend(capacity=capacity, n_devices=n_devices)
    return Pool(backend, **kw), backend


def segments(backend, device=0):
    """The backend's allocations of one device: {ptr: bytes}."""
    return {p: n for p, (d, n) in backend._live.items() if d == device}


def test_blocks_are_cut_from_one_segment_and_merge_back_whole():
    pool, backend = make()
    a, b, c = pool.allocate(1000), pool.allocate(300 * KiB), pool.allocate(5000)
    assert backend.mallocs == 1 and a.size == 1024 and b.size == 300 * KiB and c.size == 5120
    assert b.ptr == a.ptr + a.size and c.ptr == b.ptr + b.size           # cut in address order
    s = pool.stats()
    assert (s.bytes_in_use, s.bytes_reserved, s.blocks_cached) == (a.size + b.size + c.size, SEGMENT, 1)
    del b                                  # a hole between two live ranges
    assert pool.stats().blocks_cached == 2
    del a, c                               # all three merge with the rest: one whole segment
    cached = pool._core.cached_blocks(0)
    assert [(x["ptr"], x["size"]) for x in cached] == list(segments(backend).items())
    assert pool.empty_cache() == SEGMENT and backend.used(0) == 0


def test_best_fit_takes_the_smallest_free_range_that_fits():
    pool, backend = make()
    blocks = {n: pool.allocate(n * MiB) for n in (3, 5, 4)}   # above 1 MiB: a segment each, of its size
    holes = {n: b.ptr for n, b in blocks.items()}
    del blocks                             # three whole free segments: 3, 4 and 5 MiB
    b = pool.allocate(3 * MiB + 1)         # fits the 4 and the 5 MiB one: takes the 4
    assert b.ptr == holes[4] and backend.mallocs == 3
    c = pool.allocate(MiB + 1)             # the 4 MiB one's rest is 512 B short: the 3 MiB one
    assert c.ptr == holes[3] and backend.mallocs == 3


def test_a_range_is_reused_only_on_its_stream():
    pool, backend = make()
    a = pool.allocate(4 * MiB, stream=1)
    ptr = a.ptr
    del a
    b = pool.allocate(MiB, stream=2)       # stream 1's segment is free, but not stream 2's
    assert b.ptr != ptr and backend.mallocs == 2
    assert pool.allocate(MiB, stream=1).ptr == ptr


def test_devices_have_their_own_segments():
    pool, backend = make()
    a = pool.allocate(MiB, device=0)
    b = pool.allocate(MiB, device=1)
    assert backend.mallocs == 2 and a.device == 0 and b.device == 1
    del a
    assert pool.stats(1).bytes_cached == SEGMENT - MiB   # device 0's free range is not device 1's


def test_empty_cache_gives_back_whole_free_segments_only():
    pool, backend = make()
    live = pool.allocate(MiB)              # a 2 MiB small-block segment: stays, part of it is in use
    other = pool.allocate(3 * MiB)         # a 3 MiB segment of its own, whole once freed
    del other
    before = backend.used(0)
    assert pool.empty_cache() == 3 * MiB and backend.used(0) == before - 3 * MiB
    s = pool.stats()
    assert (s.bytes_reserved, s.bytes_cached, s.device_frees) == (SEGMENT, SEGMENT - MiB, 1)
    del live
    assert pool.trim(0) == SEGMENT and backend.used(0) == 0


def test_a_miss_below_the_high_water_mark_gives_nothing_back():
    pool, backend = make()
    a, b = pool.allocate(8 * MiB), pool.allocate(3 * MiB)    # the mark: 11 MiB
    del a
    pool.empty_cache()                     # 3 MiB reserved
    del b                                  # a whole free 3 MiB segment, too small for ...
    c = pool.allocate(4 * MiB)             # ... this miss: 3 + 4 MiB stay below the mark, it is kept
    s = pool.stats()
    assert (s.device_mallocs, s.device_frees, s.bytes_reserved) == (3, 1, 7 * MiB) and c.size == 4 * MiB
    assert backend.used(0) == 7 * MiB


def test_a_miss_only_adds_above_the_mark_too():
    """The one release rule: a miss gives nothing back, however far above the most the pool ever held and
    however long a whole free segment has waited; empty_cache, trim and the ladder do."""
    pool, backend = make()
    keep = pool.allocate(KiB)              # a 2 MiB segment
    a = pool.allocate(3 * MiB)
    del a                                  # a whole free 3 MiB segment
    for _ in range(100):                   # it waits: hits elsewhere
        pool.allocate(KiB).release()
    for n in range(4, 12):                 # each miss above every mark before it
        pool.allocate(n * MiB).release()
    s = pool.stats()
    assert s.device_frees == 0 and s.device_mallocs == 2 + 8
    assert s.bytes_reserved == backend.used(0) == (2 + 3 + sum(range(4, 12))) * MiB
    assert pool.empty_cache() == (3 + sum(range(4, 12))) * MiB and keep.size


def test_a_segment_is_its_blocks_size_rounded_to_512_bytes():
    pool, backend = make()
    a = pool.allocate(MiB + 1)             # above 1 MiB: a segment of its own, rounded to 512 B
    assert a.size == MiB + 512 and list(segments(backend).values()) == [MiB + 512]
    b = pool.allocate(MiB)                 # up to 1 MiB: a 2 MiB segment, shared by later small blocks
    c = pool.allocate(MiB - 512)
    assert sorted(segments(backend).values()) == [MiB + 512, SEGMENT] and c.ptr == b.ptr + MiB
    del a, b, c


def test_segment_rounding_gives_way_to_a_small_device_and_to_the_limit():
    pool, backend = make(capacity=MiB)
    a = pool.allocate(600 * KiB)           # a 2 MiB segment would not fit the device: exactly 600 KiB
    assert backend.used(0) == 600 * KiB and a.size == 600 * KiB
    pool2, backend2 = make(limit=3 * MiB)
    b = pool2.allocate(MiB)                # 2 MiB fits the limit
    c = pool2.allocate(MiB)                # the rest of b's segment
    d = pool2.allocate(512 * KiB)          # 2 MiB more would pass the limit: exactly 512 KiB
    assert backend2.used(0) == 2 * MiB + 512 * KiB and b.size and c.size and d.size


def test_limit_and_oom_ladder_free_whole_segments_and_retry():
    pool, backend = make(capacity=8 * MiB)
    keep = pool.allocate(3 * MiB)          # stream 0
    other = pool.allocate(3 * MiB, stream=1)
    del other                              # a whole free segment of stream 1: only the ladder frees it
    c = pool.allocate(4 * MiB, stream=0)   # the device has 2 MiB left: free the cache, retry
    s = pool.stats()
    assert (s.oom_recoveries, s.device_frees) == (1, 1) and backend.used(0) == 7 * MiB
    with pytest.raises(xpool.OutOfMemoryError):
        pool.allocate(4 * MiB)
    assert keep.size == 3 * MiB and c.size == 4 * MiB
    s = pool.stats()
    assert s.bytes_in_use == 7 * MiB and s.bytes_reserved == backend.used(0)


def test_write_past_a_split_block_is_caught():
    pool = Pool(HostBackend(), debug="raise")
    a = pool.allocate(1000)
    b = pool.allocate(1000)                # b's range starts where a's ends, inside one segment
    assert b.ptr == a.ptr + a.size
    ctypes.memset(a.ptr + 1000, 0x42, 1)   # one byte past a: a's canary, not b's data
    with pytest.raises(xpool.CorruptionError, match="past the end"):
        del a
        pool.allocate(10)


def test_write_after_free_into_a_range_is_caught_when_it_is_cut_again():
    pool = Pool(HostBackend(), debug="raise")
    a = pool.allocate(1000)
    keep = pool.allocate(1000)             # a's range stays apart from the segment's rest
    ptr = a.ptr
    del a
    ctypes.memset(ptr, 0x11, 8)
    with pytest.raises(xpool.CorruptionError, match="written after it was freed"):
        pool.allocate(200)                 # best fit: a's old range
    assert keep.size == 1536               # 1000 B + the 64 B canary, to 512 B


def test_the_rest_of_a_new_segment_starts_poisoned():
    pool = Pool(HostBackend(), debug="raise")
    a = pool.allocate(4096)
    rest = a.ptr + a.size + 64
    assert ctypes.string_at(rest, 64) == bytes([POISON]) * 64
    pool.allocate(4096)                    # cut from the poisoned rest: no false alarm
    pool.check()


def test_scheme_is_chosen_by_name_and_classes_per_doubling_needs_seed(monkeypatch):
    backend = HostBackend()
    assert Pool(backend).settings.scheme == "segments" and Pool(backend).settings.classes_per_doubling is None
    assert Pool(backend, scheme="seed").settings.classes_per_doubling == 1
    seed = Pool(backend, scheme="seed", classes_per_doubling=4)
    assert seed.settings.scheme == "seed" and seed.allocate(4 * MiB + 1).size == 5 * MiB
    with pytest.raises(ValueError, match="classes_per_doubling=4 applies to scheme 'seed' only"):
        Pool(backend, classes_per_doubling=4)                       # no longer selects seed by itself
    with pytest.raises(ValueError, match="classes_per_doubling"):
        Pool(backend, scheme="segments", classes_per_doubling=4)
    with pytest.raises(ValueError, match="scheme"):
        Pool(backend, scheme="arena")
    monkeypatch.setenv("XPOOL_SCHEME", "seed")
    assert Pool(backend).settings.scheme == "seed"
    monkeypatch.setenv("XPOOL_SCHEME", "buddy")
    with pytest.raises(ValueError, match="XPOOL_SCHEME"):
        Pool(backend)
    monkeypatch.setenv("XPOOL_SCHEME", "seed")
    monkeypatch.setenv("XPOOL_CLASSES_PER_DOUBLING", "4")
    assert Pool(backend).settings.classes_per_doubling == 4   # the variables' cases: tests/xpool/test_settings.py


SIZES = st.one_of(st.integers(0, 64 * KiB), st.integers(MiB - 4 * KiB, 3 * MiB),
                  st.sampled_from([512, SEGMENT, SEGMENT + 1, 5 * MiB]))


class SegmentModel(RuleBasedStateMachine):
    """Random allocs, frees, cache flushes and limits on 2 devices x 2 streams of a small host device;
    after every step the pool's ranges must tile the backend's allocations exactly."""

    CAPACITY = 16 * MiB
    DEBUG = False

    def __init__(self):
        super().__init__()
        self.backend = HostBackend(capacity=self.CAPACITY, n_devices=2)
        self.pool = Pool(self.backend, debug=self.DEBUG)
        self.live = []

    @rule(n=SIZES, device=st.integers(0, 1), stream=st.integers(0, 1))
    def allocate(self, n, device, stream):
        m = n + self.pool._core.debug_tail         # debug mode's canary room
        size = max(512, -(-m // 512) * 512)
        bound = min(self.pool.get_limit(device) or self.CAPACITY, self.CAPACITY)
        before = self.pool._core.stats(device)
        mallocs = before["device_mallocs"]
        try:
            a = self.pool.allocate(n, device=device, stream=stream)
        except xpool.OutOfMemoryError:
            # only when even after giving every whole free segment back (what the ladder did), the
            # segments still partly in use leave no room on the device or under the limit for its new
            # segment: 2 MiB for a block up to 1 MiB (exactly its size where the limit has no room for 2)
            limit = self.pool.get_limit(device)
            used = self.backend.used(device)
            segment = SEGMENT if size <= MiB and not (limit and used + SEGMENT > limit) else size
            assert used + segment > bound
            return
        self.live.append(a)
        assert (a.size, a.requested, a.device, a.stream) == (size, n, device, stream)
        after = self.pool._core.stats(device)
        if after["device_mallocs"] > mallocs:     # the pool grew: within bounds
            assert self.backend.used(device) <= bound
        if after["oom_recoveries"] == before["oom_recoveries"]:   # the one release rule: a miss only adds
            assert after["device_frees"] == before["device_frees"]

    @precondition(lambda self: self.live)
    @rule(i=st.integers(0, 10_000))
    def release(self, i):
        self.live.pop(i % len(self.live)).release()

    @rule(device=st.integers(0, 1))
    def empty_cache(self, device):
        before = self.backend.used(device)
        released = self.pool.empty_cache(device)
        assert self.backend.used(device) == before - released
        # only whole free segments went: every one left holds a block in use
        used = {p for p, n in segments(self.backend, device).items()
                if any(p <= a.ptr < p + n for a in self.live if a.device == device)}
        assert used == set(segments(self.backend, device))

    @rule(device=st.integers(0, 1), mib=st.sampled_from([0, 6, 10]))
    def set_limit(self, device, mib):
        self.pool.set_limit(size=mib * MiB, device=device)

    @invariant()
    def ranges_tile_the_segments(self):
        for device in list(self.pool.stats()):
            s = self.pool._core.stats(device)
            mine = [a for a in self.live if a.device == device]
            cached = self.pool._core.cached_blocks(device)
            ranges = sorted([(a.ptr, a.size, a.stream) for a in mine] +
                            [(c["ptr"], c["size"], c["stream"]) for c in cached])
            segs = segments(self.backend, device)
            # every range lies in one segment, ranges never overlap, and together they fill every segment
            covered = dict.fromkeys(segs, 0)
            streams = {}
            for ptr, size, stream in ranges:
                seg = [p for p, n in segs.items() if p <= ptr and ptr + size <= p + n]
                assert len(seg) == 1, "a range outside every segment"
                covered[seg[0]] += size
                assert streams.setdefault(seg[0], stream) == stream, "one segment, two streams"
            assert covered == segs
            for (p1, n1, _), (p2, _, _) in zip(ranges, ranges[1:]):
                assert p1 + n1 <= p2, "overlapping ranges"
            # a free range never sits next to another free one of its segment: they merge
            free = sorted((c["ptr"], c["size"]) for c in cached)
            for (p1, n1), (p2, _) in zip(free, free[1:]):
                assert p1 + n1 != p2 or not any(p <= p1 < p + n and p <= p2 < p + n for p, n in segs.items())
            # counters are exact and reserved is what the backend holds
            assert s["bytes_in_use"] == sum(a.size for a in mine)
            assert s["bytes_requested"] == sum(a.requested for a in mine)
            assert s["blocks_in_use"] == len(mine)
            assert s["bytes_cached"] == sum(c["size"] for c in cached)
            assert s["blocks_cached"] == len(cached)
            assert s["bytes_reserved"] == self.backend.used(device) == sum(segs.values())
            assert s["device_mallocs"] - s["device_frees"] == len(segs)

    @rule()
    def release_all(self):
        while self.live:
            self.live.pop().release()
        for device in list(self.pool.stats()):
            assert self.pool._core.stats(device)["bytes_in_use"] == 0
            # with nothing in use, every segment is one free range again, and all of them go back
            cached = self.pool._core.cached_blocks(device)
            assert sorted((c["ptr"], c["size"]) for c in cached) == sorted(segments(self.backend, device).items())
        self.pool.empty_cache()
        assert all(self.backend.used(d) == 0 for d in range(2))

    def teardown(self):
        self.live.clear()


TestSegmentModel = pytest.mark.usefixtures("frozen_gc")(SegmentModel.TestCase)
TestSegmentModel.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


class DebugSegmentModel(SegmentModel):
    """The same, in debug mode: split, merged and new ranges keep poison and canaries consistent (a false
    alarm raises CorruptionError out of allocate)."""

    DEBUG = "raise"

    @invariant()
    def no_damage_found(self):
        self.pool.check()
        assert not self.pool._hook.found


TestDebugSegmentModel = pytest.mark.usefixtures("frozen_gc")(DebugSegmentModel.TestCase)
TestDebugSegmentModel.settings = settings(max_examples=15, stateful_step_count=30, deadline=None)


def test_pytorchs_gil_free_path_cuts_and_merges_ranges_too():
    from test_torch_allocator import torch_free, torch_malloc
    pool, backend = make()
    pool._core.bind_torch()
    a = torch_malloc(1000, 0, 5)           # a miss: takes the GIL, starts a segment on stream 5
    b = torch_malloc(3000, 0, 5)           # a hit without the GIL: the next range of that segment
    assert b == a + 1024 and backend.mallocs == 1
    s = pool._core.stats(0)
    assert (s["hits"], s["bytes_in_use_torch"], s["bytes_reserved"]) == (1, 1024 + 3072, SEGMENT)
    torch_free(a, 1000, 0, 5)
    torch_free(b, 3000, 0, 5)              # both back without the GIL: one whole free segment again
    s = pool._core.stats(0)
    assert (s["bytes_in_use"], s["blocks_cached"], s["bytes_cached"]) == (0, 1, SEGMENT)
    assert torch_malloc(SEGMENT, 0, 5) == a and backend.mallocs == 1    # the whole segment, best fit
    torch_free(a, SEGMENT, 0, 5)
    assert pool.empty_cache() == SEGMENT and backend.used(0) == 0


def test_a_ladder_whose_give_back_fails_raises_and_keeps_the_segment_cached():
    from faults import FaultyBackend, InjectedFault
    backend = FaultyBackend(capacity=6 * MiB)
    pool = Pool(backend)
    a = pool.allocate(3 * MiB)
    del a                                  # a whole free 3 MiB segment
    backend.fail_frees = 1
    with pytest.raises(InjectedFault):
        pool.allocate(4 * MiB)             # 3 + 4 MiB > 6: the ladder's free of the 3 MiB segment fails
    s = pool.stats()
    assert (s.bytes_reserved, s.bytes_cached, s.bytes_in_use, s.device_frees) == (3 * MiB, 3 * MiB, 0, 0)
    assert backend.used(0) == 3 * MiB and s.oom_errors == 0
    b = pool.allocate(4 * MiB)             # tried again: now it goes back
    s = pool.stats()
    assert (s.device_frees, s.bytes_reserved, s.oom_recoveries) == (1, 4 * MiB, 1)
    assert backend.used(0) == 4 * MiB and b.size


# --- the exact-size fast path (FreeTree.recent): where a freed range waits changes no decision

def test_a_freed_range_with_nothing_to_merge_comes_back_to_its_size_and_counts_as_cached():
    pool, backend = make()
    a = pool.allocate(12 * MiB)            # a whole segment: nothing to merge with once free
    ptr = a.ptr
    del a
    s = pool.stats()
    assert (s.blocks_cached, s.bytes_cached) == (1, 12 * MiB)
    assert [(c["ptr"], c["size"]) for c in pool._core.cached_blocks(0)] == [(ptr, 12 * MiB)]
    b = pool.allocate(12 * MiB)
    assert b.ptr == ptr and backend.mallocs == 1 and pool.stats().hits == 1


def test_the_lowest_free_range_of_a_size_is_taken_first_as_without_the_fast_path():
    pool, backend = make()
    x = [pool.allocate(64 * KiB) for _ in range(5)]      # one segment: x0 x1 x2 x3 x4, then its rest
    low, high = x[1].ptr, x[3].ptr
    x[3].release()                         # neighbours in use: it waits for a request of 64 KiB
    x[1].release()                         # the same size: x1 waits, x3 goes to the tree
    r1 = pool.allocate(64 * KiB)           # the waiting one is the lowest of its size
    r3 = pool.allocate(64 * KiB)
    assert (r1.ptr, r3.ptr, backend.mallocs) == (low, high, 1)
    r1.release()                           # x1 waits
    r3.release()                           # x3 waits, x1 goes to the tree
    r = pool.allocate(64 * KiB)            # best fit (lowest address) beats the waiting one
    assert r.ptr == low and backend.mallocs == 1
    assert pool.stats().blocks_cached == 2   # x3's hole and the segment's rest


def test_a_range_freed_next_to_a_waiting_one_merges_with_it():
    pool, backend = make()
    a, b = pool.allocate(256 * KiB), pool.allocate(256 * KiB)
    rest = pool.allocate(SEGMENT - 512 * KiB)           # fills the segment
    assert backend.mallocs == 1 and rest.ptr == b.ptr + b.size
    ptr = a.ptr
    del a                                  # waits: its neighbour is in use
    del b                                  # frees next to it: one range again
    assert [(c["ptr"], c["size"]) for c in pool._core.cached_blocks(0)] == [(ptr, 512 * KiB)]
    assert pool.stats().blocks_cached == 1
    assert pool.allocate(512 * KiB).ptr == ptr and backend.mallocs == 1


def test_empty_cache_gives_back_a_waiting_whole_segment():
    pool, backend = make()
    a = pool.allocate(12 * MiB)
    del a                                  # waits in the exact-size cache
    assert pool.empty_cache() == 12 * MiB and backend.used(0) == 0
    assert pool.stats().blocks_cached == 0


def test_the_ladder_gives_back_a_waiting_whole_segment():
    pool, backend = make(capacity=8 * MiB)
    a = pool.allocate(3 * MiB)
    del a                                  # waits in the exact-size cache
    big = pool.allocate(6 * MiB)           # the device refuses 3 + 6 MiB: the ladder frees the waiting segment
    s = pool.stats()
    assert (s.device_mallocs, s.device_frees, s.bytes_reserved, s.oom_recoveries) == (2, 1, 6 * MiB, 1)
    assert big.size == 6 * MiB and backend.used(0) == 6 * MiB


class _BestFitModel:
    """Scheme segments' decisions in plain Python, for one stream: the free range of least (size, address) that
    fits, cut at its start, the rest kept free; a freed range merges with free neighbours of its segment."""

    def __init__(self):
        self.free = {}             # ptr -> size of the free ranges
        self.segment_of = {}       # ptr of a range (free or in use) -> (segment ptr, segment end)
        self.used = {}             # ptr -> size in use

    def fit(self, size):
        fits = [(n, p) for p, n in self.free.items() if n >= size]
        return min(fits)[1] if fits else None

    def take(self, ptr, size):
        n = self.free.pop(ptr)
        if n > size:
            self.free[ptr + size] = n - size
            self.segment_of[ptr + size] = self.segment_of[ptr]
        self.used[ptr] = size

    def new_segment(self, ptr, seg_bytes, size):
        self.segment_of[ptr] = (ptr, ptr + seg_bytes)
        self.free[ptr] = seg_bytes
        self.take(ptr, size)

    def give_back(self, ptr):
        size = self.used.pop(ptr)
        lo, hi = self.segment_of[ptr]
        nxt = ptr + size
        if nxt < hi and nxt in self.free:
            size += self.free.pop(nxt)
        prev = next((p for p, n in self.free.items() if p + n == ptr and p >= lo), None)
        if prev is not None:
            ptr, size = prev, size + self.free.pop(prev)
        self.free[ptr] = size


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(st.tuples(st.integers(0, 2), st.sampled_from([4096, 64 * KiB, 64 * KiB, 300 * KiB, 3 * MiB,
                                                                   3 * MiB, 5 * MiB]),
                              st.integers(0, 10_000)), min_size=1, max_size=150))
def test_every_request_gets_the_best_fit_of_all_free_ranges_waiting_or_filed(ops):
    """The exact-size cache (FreeTree.recent) changes where free ranges are kept, never which range a request
    gets: the least (size, address) of every free range of its stream that fits, as a plain model says."""
    from faults import AddressBackend
    backend = AddressBackend()                          # addresses in order: the same case, the same run
    pool = Pool(backend)
    model, live = _BestFitModel(), []
    for alloc, n, i in ops:
        if alloc or not live:             # two allocs to one free: the pool grows, ranges of a size recur
            mallocs = pool.stats().device_mallocs
            expect = model.fit(n)
            a = pool.allocate(n)
            if pool.stats().device_mallocs > mallocs:   # a new segment: no free range fitted
                assert expect is None
                model.new_segment(a.ptr, SEGMENT if n <= MiB else n, a.size)
            else:
                assert a.ptr == expect
                model.take(a.ptr, a.size)
            live.append(a)
        else:
            a = live.pop(i % len(live))
            model.give_back(a.ptr)
            a.release()
    s = pool.stats()
    assert (s.blocks_cached, s.bytes_cached) == (len(model.free), sum(model.free.values()))
    assert sorted((c["ptr"], c["size"]) for c in pool._core.cached_blocks(0)) == sorted(model.free.items())


def _pool_with_free_ranges(n_ranges, **kw):
    """A pool whose stream 0 has `n_ranges` free 512 B ranges inside partly used 2 MiB segments."""
    pool = Pool(HostBackend(), **kw)
    blocks = [pool.allocate(512) for _ in range(2 * n_ranges)]
    keep = blocks[1::2]                             # every other one stays in use: the rest cannot merge
    del blocks
    assert pool._core.stats(0)["blocks_cached"] >= n_ranges
    return pool, keep


def _scan_visits_per_release(n_ranges, releases=8):
    pool, keep = _pool_with_free_ranges(n_ranges)
    visits0 = xpool_twin.testing.release_scan_visits(pool, 0)
    for i in range(releases):
        pool.allocate(8 * MiB + 512 * i).release()  # one whole free segment beside the partly used ones
        assert pool.empty_cache() == 8 * MiB + 512 * i
    return (xpool_twin.testing.release_scan_visits(pool, 0) - visits0) / releases


def test_a_growing_miss_searches_nothing_to_give_back():
    pool, keep = _pool_with_free_ranges(1000)
    size, before = 8 * MiB, pool.stats()
    for _ in range(8):
        size += 512                                 # each one larger than any before
        pool.allocate(size).release()
    assert xpool_twin.testing.release_scan_visits(pool, 0) == 0     # a miss only adds: the one release rule
    assert (pool.stats() - before).device_frees == 0


def test_empty_cache_does_not_walk_the_free_ranges_of_partly_used_segments():
    few, many = _scan_visits_per_release(100), _scan_visits_per_release(10_000)
    assert many < 10 * max(few, 1), (few, many)     # O(free ranges) would be 100 times as many
    assert many < 200, many
