"""The recovery ladder (Note [Recovery ladder] in xpool/_alloc.c): try; free this device's cache and retry; collect
garbage, free the cache and retry; raise. The limit and the device's out-of-memory climb the same steps."""
import gc

import pytest

import xpool
from xpool import Pool
from xpool.backends import DeviceOutOfMemory
from xpool_twin import HostBackend


KiB, MiB = 1 << 10, 1 << 20


class Scripted(HostBackend):
    """HostBackend whose next `refuse` mallocs raise DeviceOutOfMemory; every call is logged."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.refuse, self.log = 0, []

    def malloc(self, device, nbytes):
        if self.refuse:
            self.refuse -= 1
            self.log.append(("refused", nbytes))
            raise DeviceOutOfMemory(f"scripted: {nbytes} B")
        self.log.append(("malloc", nbytes))
        return super().malloc(device, nbytes)

    def free(self, device, ptr, nbytes):
        self.log.append(("free", nbytes))
        super().free(device, ptr, nbytes)


@pytest.fixture
def collections():
    """The log of gc.collect() runs (the core calls gc.collect itself: seen through gc.callbacks)."""
    log = []

    def note(phase, info):
        if phase == "start":
            log.append(("collect", info["generation"]))
    gc.callbacks.append(note)
    yield log
    gc.callbacks.remove(note)


def counters(pool):
    """Device 0's exact counters, those the stats frame leaves out (bytes pending, releasing) too."""
    import types
    return types.SimpleNamespace(**pool._core.stats(0))


def seeded(backend, **settings):
    """A pool holding one cached 1 MiB block (scheme seed: one device allocation per block)."""
    pool = Pool(backend, scheme="seed", **settings)
    pool.allocate(MiB).release()
    backend.log.clear()
    return pool


def test_the_device_refusing_climbs_every_step_then_raises(collections):
    backend = Scripted()
    pool = seeded(backend)
    backend.refuse = 3
    with pytest.raises(xpool.OutOfMemoryError) as info:
        pool.allocate(2 * MiB)
    assert backend.log == [("refused", 2 * MiB), ("free", MiB), ("refused", 2 * MiB), ("refused", 2 * MiB)]
    assert ("collect", 2) in collections                                 # before the last try
    assert info.value.reason == "device" and isinstance(info.value.__cause__, DeviceOutOfMemory)
    s = counters(pool)
    assert (s.oom_errors, s.oom_recoveries, s.bytes_pending, s.bytes_releasing, s.bytes_reserved) == (1, 0, 0, 0, 0)


def test_the_device_refusing_once_is_a_recovery():
    backend = Scripted()
    pool = seeded(backend)
    backend.refuse = 1
    block = pool.allocate(2 * MiB)
    assert backend.log == [("refused", 2 * MiB), ("free", MiB), ("malloc", 2 * MiB)]
    s = counters(pool)
    assert (s.oom_recoveries, s.oom_errors, s.device_mallocs, s.bytes_pending) == (1, 0, 2, 0) and block.size == 2 * MiB


def test_the_limit_climbs_the_same_steps():
    backend = Scripted()
    pool = seeded(backend, limit=2 * MiB)
    block = pool.allocate(2 * MiB)                      # over the limit with the cached 1 MiB: freed, retried
    assert backend.log == [("free", MiB), ("malloc", 2 * MiB)]
    s = counters(pool)
    assert (s.oom_recoveries, s.bytes_cached, s.bytes_reserved) == (1, 0, 2 * MiB)
    with pytest.raises(xpool.OutOfMemoryError) as info:
        pool.allocate(MiB)                              # nothing cached to free: every step refused
    assert info.value.reason == "limit" and info.value.__cause__ is None
    assert counters(pool).bytes_pending == 0
    del block


def test_the_limit_then_the_device_refusing_share_one_ladder(collections):
    backend = Scripted()
    pool = seeded(backend, limit=2 * MiB)
    backend.refuse = 1
    block = pool.allocate(2 * MiB)                      # limit: free the cache; device: collect, retry
    assert backend.log == [("free", MiB), ("refused", 2 * MiB), ("malloc", 2 * MiB)]
    assert collections                                  # the third step collected
    s = counters(pool)
    assert (s.oom_recoveries, s.device_mallocs, s.bytes_pending) == (1, 2, 0)
    del block


def test_a_request_larger_than_the_limit_raises_at_once_and_keeps_the_cache():
    backend = Scripted()
    pool = seeded(backend, limit=3 * MiB)
    with pytest.raises(xpool.OutOfMemoryError) as info:
        pool.allocate(4 * MiB)
    assert info.value.reason == "limit_too_small" and backend.log == []   # nothing freed: nothing could help
    assert "nothing was freed" in str(info.value) and "raise the limit" in str(info.value)
    assert counters(pool).bytes_cached == MiB


def test_a_request_larger_than_the_device_raises_at_once_and_keeps_the_cache():
    backend = Scripted(capacity=8 * MiB)
    pool = seeded(backend)
    with pytest.raises(xpool.errors.RequestTooLargeError):
        pool.allocate(16 * MiB)
    assert backend.log == [] and counters(pool).bytes_cached == MiB


def test_another_error_of_malloc_skips_the_ladder():
    class Broken(Scripted):
        def malloc(self, device, nbytes):
            self.log.append(("broken", nbytes))
            raise RuntimeError("the driver is gone")

    backend = Broken()
    pool = Pool(backend, scheme="seed")
    with pytest.raises(RuntimeError, match="the driver is gone"):
        pool.allocate(MiB)
    assert backend.log == [("broken", MiB)]
    s = counters(pool)
    assert (s.oom_errors, s.bytes_pending, s.device_mallocs) == (0, 0, 0)


def test_a_failing_free_on_the_way_up_stops_the_ladder_with_its_error():
    class FailingFree(Scripted):
        fail = True

        def free(self, device, ptr, nbytes):
            if self.fail:
                self.fail = False
                raise RuntimeError("free failed")
            super().free(device, ptr, nbytes)

    backend = FailingFree()
    pool = seeded(backend)
    backend.refuse = 1
    with pytest.raises(RuntimeError, match="free failed"):
        pool.allocate(2 * MiB)
    s = counters(pool)
    assert (s.bytes_cached, s.bytes_pending, s.bytes_releasing, s.blocks_cached) == (MiB, 0, 0, 1)   # still cached


def assert_exact(pool, backend, device=0):
    s = pool._core.stats(device)
    assert s["bytes_pending"] == s["bytes_releasing"] == 0, s
    assert s["bytes_reserved"] == backend.used(device), (s, backend.used(device))
    assert s["device_mallocs"] - s["device_frees"] == len([1 for d, _ in backend.live().values() if d == device])


def test_a_small_block_that_fits_the_free_memory_is_served():
    backend = HostBackend(capacity=4 * MiB)
    pool = Pool(backend)
    held = pool.allocate(3 * MiB)
    a = pool.allocate(4 * KiB)                      # the 2 MiB segment does not fit; the exact size does
    assert a.size == 4 * KiB and backend.used(0) <= 4 * MiB
    assert_exact(pool, backend)
    del held, a


def test_out_of_memory_for_a_small_block_reports_the_requests_class():
    backend = HostBackend(capacity=4 * MiB)
    pool = Pool(backend)
    held = pool.allocate(4 * MiB - 2 * KiB)
    with pytest.raises(xpool.OutOfMemoryError) as e:
        pool.allocate(4 * KiB)                      # not even the exact size fits
    assert e.value.size == 4 * KiB and "refused 4.00 KiB" in str(e.value) and "2.00 MiB" not in str(e.value)
    assert_exact(pool, backend)
    del held
