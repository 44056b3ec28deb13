"""The per-device limit: as an argument, a share of each device or a variable; under threads; what counts
against it; what a request larger than it does."""
import threading
import time

import numpy as np
import pytest

import xpool
from faults import FaultyBackend
from xpool import OutOfMemoryError, Pool
from xpool_twin import HostBackend, TwinBackend


P = 1 << 16


def expandable(**kw):
    backend = TwinBackend(n_devices=1, granularity=P)
    return Pool(backend, scheme="expandable", **kw), backend


def test_a_limit_below_one_page_names_the_page_and_frees_nothing():
    pool, backend = expandable(limit=P // 2)
    with pytest.raises(OutOfMemoryError) as e:
        pool.allocate(512, 0, 0)
    err = e.value
    assert err.reason == "limit_too_small" and err.size == P and err.requested == 512
    assert "64.00 KiB this request of 512 B needs" in str(err) and "nothing was freed" in str(err)
    assert "retried" not in str(err) and backend.twin.counters()["maps"] == 0


def test_a_limit_the_ladder_cannot_meet_says_it_freed_and_retried():
    pool, _ = expandable(limit=2 * P)
    held = [pool.allocate(P, 0, 0) for _ in range(2)]
    with pytest.raises(OutOfMemoryError) as e:
        pool.allocate(P, 0, 0)
    assert e.value.reason == "limit" and "the cache was freed and the request retried" in str(e.value)
    del held


KiB, MiB = 1 << 10, 1 << 20


def wait_for(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "the other thread never got there"
        time.sleep(0.001)


# Limit= and XPOOL_MEMORY_LIMIT hold on every device, not only the current one
@pytest.mark.usefixtures("seed_scheme")
def test_limit_argument_holds_on_every_device():
    pool = Pool(HostBackend(n_devices=4), limit=1 * MiB)
    for d in range(4):
        assert pool.get_limit(device=d) == MiB
        with pytest.raises(xpool.OutOfMemoryError) as info:
            pool.allocate(2 * MiB, device=d)
        assert info.value.reason == "limit_too_small"     # larger than the limit itself: refused at once
    assert pool._backend.mallocs == 0


@pytest.mark.usefixtures("seed_scheme")
def test_limit_from_environment_holds_on_every_device(monkeypatch):
    monkeypatch.setenv("XPOOL_MEMORY_LIMIT", "1MiB")
    pool = Pool(HostBackend(n_devices=4))
    assert [pool.get_limit(device=d) for d in range(4)] == [MiB] * 4
    monkeypatch.setenv("XPOOL_MEMORY_LIMIT", "25%")
    pool = Pool(HostBackend(capacity=8 * MiB, n_devices=4))
    assert [pool.get_limit(device=d) for d in (3, 1)] == [2 * MiB] * 2
    with pytest.raises(xpool.OutOfMemoryError, match="limit"):
        pool.allocate(3 * MiB, device=2)
    pool.set_limit(size=4 * MiB, device=2)                 # per device, as before
    assert pool.allocate(3 * MiB, device=2).size == 4 * MiB


# The limit holds when threads share a device and the lock is dropped for the backend
@pytest.mark.usefixtures("seed_scheme")
def test_limit_holds_when_threads_share_a_device():
    backend = FaultyBackend(malloc_delay=0.01)   # a slow malloc: every thread is inside it at once
    threads, limit = 8, 3 * MiB
    pool = Pool(backend, limit=limit)
    barrier = threading.Barrier(threads)
    held, errors = [], []

    def worker():
        try:
            for _ in range(2):
                barrier.wait()
                try:
                    held.append(pool.allocate(MiB))
                except xpool.OutOfMemoryError as e:
                    assert e.reason == "limit"
        except Exception as e:  # noqa: BLE001 - surfaced below
            errors.append(repr(e))

    ts = [threading.Thread(target=worker) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert errors == []
    assert backend.high_water[0] <= limit and len(held) == 3
    st = pool._core.stats(0)
    assert st["peak_bytes_reserved"] <= limit and st["bytes_pending"] == 0
    assert st["bytes_reserved"] == backend.used(0) == 3 * MiB


@pytest.mark.usefixtures("seed_scheme")
def test_blocks_being_given_back_still_count_against_the_limit():
    backend = FaultyBackend(free_delay=0.05)     # the device holds a block until its free returns
    pool = Pool(backend, limit=2 * MiB)
    blocks = [pool.allocate(MiB) for _ in range(2)]
    del blocks                                   # 2 MiB cached
    releaser = threading.Thread(target=pool.empty_cache)
    releaser.start()
    wait_for(lambda: backend.free_calls >= 1)    # empty_cache is inside the first (slow) free
    try:
        pool.allocate(2 * MiB)
    except xpool.OutOfMemoryError as e:          # refusing is right; overshooting is not
        assert e.reason == "limit"
    releaser.join()
    assert backend.high_water[0] <= 2 * MiB
    assert pool._core.stats(0)["bytes_reserved"] == backend.used(0)


# smaller findings
@pytest.mark.usefixtures("seed_scheme")
def test_limit_argument_takes_the_environment_forms_and_names_itself():
    assert Pool(HostBackend(), limit="8GiB").get_limit() == 8 << 30
    assert Pool(HostBackend(capacity=8 * MiB), limit="50%").get_limit(device=5) == 4 * MiB
    for bad in ("lots", -1, 1.5, "200%"):
        with pytest.raises(ValueError, match="limit"):
            Pool(HostBackend(), limit=bad)


@pytest.mark.usefixtures("seed_scheme")
def test_a_tiny_fraction_is_a_tiny_limit_not_none():
    pool = Pool(HostBackend(capacity=8 * MiB))
    pool.set_limit(fraction=1e-15)
    assert pool.get_limit() == 1
    with pytest.raises(xpool.OutOfMemoryError, match="limit"):
        pool.allocate(1)
    pool.set_limit(fraction=np.float64(0.5))
    assert pool.get_limit() == 4 * MiB


@pytest.mark.usefixtures("seed_scheme")
def test_a_request_larger_than_the_limit_leaves_the_cache_alone():
    pool, backend = Pool(FaultyBackend(), limit=2 * MiB), None
    cached = pool.allocate(MiB)
    del cached
    with pytest.raises(xpool.OutOfMemoryError) as info:
        pool.allocate(3 * MiB)
    assert info.value.reason == "limit_too_small"
    st = pool.stats()
    assert (st.blocks_cached, st.device_frees) == (1, 0)


BAD_LIMITS = ["0.5", "0.4B", "1.5", "0.0001KB"]


@pytest.mark.parametrize("text", BAD_LIMITS)
def test_a_limit_of_a_fraction_of_a_byte_is_refused(text, monkeypatch):
    with pytest.raises(ValueError, match=r"\blimit\b.*" + text.replace(".", r"\.")):
        Pool(HostBackend(), limit=text)
    monkeypatch.setenv("XPOOL_MEMORY_LIMIT", text)
    with pytest.raises(ValueError, match="XPOOL_MEMORY_LIMIT"):
        Pool(HostBackend())


def test_limits_that_are_whole_bytes_still_work(monkeypatch):
    assert Pool(HostBackend(), limit="0.5KiB").get_limit(0) == 512
    assert Pool(HostBackend(), limit="1.5KB").get_limit(0) == 1500
    assert Pool(HostBackend(), limit="0").get_limit(0) == 0
