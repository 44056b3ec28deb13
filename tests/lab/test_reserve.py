"""xlab.reserve.reserve(pool, nbytes, device, stream): a reserve up front, the lab's (no longer a method of xpool's
Pool).  A block of nbytes less the bytes in use is allocated and given back, then the peaks are reset, so requests
that fit it hit with no device call and the peaks are the program's.  Over the tests' host twin (xpool_twin)."""
import pytest

import xpool
from xpool import Pool
from xpool_twin import TwinBackend
from xlab.reserve import reserve

P = 1 << 16                     # the twin's default granularity: the expandable scheme's page


def make(capacity=None, n_devices=2, **kw):
    backend = TwinBackend(capacity=capacity, n_devices=n_devices, granularity=P)
    return Pool(backend, scheme="expandable", **kw), backend


def stats(pool, device=0):
    return pool._core.stats(device)


def audit(pool, backend):
    """Reserved is what the twin maps; nothing in flight; the maps are the twin's."""
    for d in list(pool.stats()):
        s = stats(pool, d)
        assert s["bytes_reserved"] == backend.twin.mapped_bytes(d) == s["bytes_in_use"] + s["bytes_cached"], s
        assert s["bytes_pending"] == s["bytes_releasing"] == 0, s
    assert sum(stats(pool, d)["device_maps"] for d in list(pool.stats())) == backend.twin.counters()["maps"]


def test_a_reserve_up_front_is_one_free_run_that_later_requests_hit_and_the_peaks_forget():
    pool, backend = make()
    assert reserve(pool, 10 * P) == 10 * P
    s = stats(pool)
    assert (s["device_maps"], s["bytes_reserved"], s["peak_bytes_requested"], s["peak_bytes_reserved"]) == \
        (1, 10 * P, 0, 10 * P)
    kept = [pool.allocate(n) for n in (3 * P, P + 12_345, 100_000, 2 * P)]
    s = stats(pool)
    assert (s["device_maps"], s["device_unmaps"], s["hits"]) == (1, 0, 4)
    assert s["peak_bytes_requested"] == 6 * P + 12_345 + 100_000       # the program's requests alone
    assert backend.twin.mapped_bytes(0) == 10 * P
    del kept
    audit(pool, backend)


def test_a_reserve_after_the_model_is_built_holds_the_bytes_in_use_and_a_free_block_of_the_rest():
    """It counts the blocks in use (a model built first): it takes nbytes less them, so the pool holds nbytes in
    all, in one free run after them, and the peaks start from the program's blocks; when they reach nbytes it takes
    nothing and resets nothing."""
    pool, backend = make()
    model = [pool.allocate(n) for n in (P + 4096, 3 * P, 5000)]      # 2 maps; 4 pages and 9,216 B in use
    in_use = stats(pool)["bytes_in_use"]
    assert in_use == 4 * P + 4096 + 5120
    assert reserve(pool, 12 * P) == 12 * P - in_use
    s = stats(pool)
    assert (s["bytes_reserved"], s["device_maps"], s["bytes_in_use"]) == (12 * P, 2 + 1, in_use)
    assert (s["peak_bytes_requested"], s["peak_bytes_in_use"]) == (4 * P + 4096 + 5000, in_use)
    step = [pool.allocate(n) for n in (5 * P, P + 1, 50_000)]         # all in the free run: no map
    assert (stats(pool)["device_maps"], stats(pool)["bytes_reserved"]) == (3, 12 * P)
    del step
    pool.allocate(P).release()
    before = stats(pool)
    assert reserve(pool, in_use) == 0 and reserve(pool, 1) == 0       # nothing to take: nothing reset
    after = stats(pool)
    assert (after["device_maps"], after["peak_bytes_requested"], after["requests"]) == \
        (before["device_maps"], before["peak_bytes_requested"], before["requests"])
    del model
    audit(pool, backend)


def test_a_reserve_on_another_device_and_stream_is_theirs():
    pool, backend = make()
    assert reserve(pool, 4 * P, device=1, stream=7) == 4 * P
    assert backend.twin.mapped_bytes(0) == 0 and backend.twin.mapped_bytes(1) == 4 * P
    a = pool.allocate(3 * P, device=1, stream=7)                     # its stream: a hit
    b = pool.allocate(3 * P, device=1, stream=8)                     # another stream: a miss
    assert (stats(pool, 1)["hits"], stats(pool, 1)["device_maps"]) == (1, 2)
    del a, b
    audit(pool, backend)


@pytest.mark.parametrize("nbytes", [0, -1, 1.5, True, "1", None])
def test_a_reserve_names_a_bad_size_and_takes_nothing(nbytes):
    pool, backend = make()
    with pytest.raises(ValueError, match=r"nbytes must be a positive int, got"):
        reserve(pool, nbytes)
    assert backend.twin.mapped_bytes(0) == 0


@pytest.mark.parametrize("kw, message", [(dict(device=7), r"device must be an int in \[0, 2\)"),
                                         (dict(device="0"), r"device must be an int"),
                                         (dict(stream=-1), r"stream must be a stream handle"),
                                         (dict(stream=1.0), r"stream must be a stream handle")])
def test_a_reserve_names_a_bad_device_or_stream_and_takes_nothing(kw, message):
    pool, backend = make()
    with pytest.raises(ValueError, match=message):
        reserve(pool, 4 * P, **kw)
    assert backend.twin.mapped_bytes(0) == backend.twin.mapped_bytes(1) == 0 and pool.stats()["requests"] == 0


def test_a_reserve_the_device_refuses_raises_out_of_memory_and_keeps_nothing():
    pool, backend = make(capacity=8 * P)
    pool.allocate(P)        # the program's block: its peak gauges stay as they were
    with pytest.raises(xpool.OutOfMemoryError):
        reserve(pool, 64 * P)
    s = stats(pool)
    assert (s["bytes_reserved"], s["peak_bytes_requested"]) == (P, P)
    audit(pool, backend)


@pytest.mark.parametrize("scheme", ["segments", "seed"])
def test_under_the_other_schemes_a_reserve_is_a_cached_block_the_next_request_of_its_size_hits(scheme):
    backend = TwinBackend(n_devices=1, granularity=P)
    pool = Pool(backend, scheme=scheme)
    reserve(pool, 4 << 20)
    s = stats(pool)
    assert (s["device_mallocs"], s["peak_bytes_requested"], s["bytes_in_use"]) == (1, 0, 0)
    assert s["bytes_reserved"] >= 4 << 20
    b = pool.allocate(4 << 20)
    assert (stats(pool)["device_mallocs"], stats(pool)["hits"]) == (1, 1)
    del b


def test_empty_cache_gives_a_reserve_back_like_any_cached_memory():
    pool, backend = make()
    reserve(pool, 6 * P)
    assert pool.empty_cache() == 6 * P and backend.twin.pages() == []
    audit(pool, backend)
