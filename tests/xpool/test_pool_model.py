"""A hypothesis state machine: the pool against a simple model, counter for counter."""
from collections import defaultdict

import pytest

from hypothesis import event, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

import xpool
from xpool import Pool
from xpool_twin import HostBackend

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
