"""The timeline: a bounded ring of allocation events, what each call shows."""
import pytest

from xpool import Pool
from xpool_twin import HostBackend, TwinBackend


P = 1 << 16


def expandable(**kw):
    backend = TwinBackend(n_devices=1, granularity=P)
    return Pool(backend, scheme="expandable", **kw), backend


def test_a_partly_failed_unmap_counts_as_the_call_the_timeline_shows():
    pool, backend = expandable(timeline=100)
    blocks = [pool.allocate(P, 0, 0) for _ in range(3)]
    del blocks
    backend.twin.fail_unmaps(1, after_pages=1)
    with pytest.raises(RuntimeError, match="injected failure"):
        pool.empty_cache()
    s, events = pool.stats(), pool.timeline()
    unmaps = events[events["event"] == "unmap"]
    assert s.device_unmaps == len(unmaps) == 1 and int(unmaps["size"].sum()) == P
    assert s.bytes_reserved == backend.twin.mapped_bytes(0) == 2 * P and s.bytes_cached == 2 * P
    assert pool.empty_cache() == 2 * P and pool.stats().device_unmaps == 2


def make(capacity=None, **kw):
    backend = HostBackend(capacity=capacity)
    return Pool(backend, **kw), backend


@pytest.mark.usefixtures("seed_scheme")
def test_timeline_records_every_event_in_a_bounded_ring():
    pool, _ = make(timeline=4)
    a = pool.allocate(100)
    del a
    b = pool.allocate(100)
    del b
    pool.empty_cache()
    df = pool.timeline()
    assert list(df.event) == ["free", "alloc_hit", "free", "release"]   # the first miss fell out
    assert df.attrs["dropped"] == 1
    assert (df.t_s.diff().dropna() >= 0).all()
    assert list(df.bytes_reserved) == [512, 512, 512, 0]
    off, _ = make(timeline=0)
    off.allocate(1).release()
    assert len(off.timeline()) == 0 and off.timeline().attrs["dropped"] == 0


def make_expandable(capacity=None, n_devices=2, granularity=P, **kw):
    backend = TwinBackend(capacity=capacity, n_devices=n_devices, granularity=granularity)
    return Pool(backend, scheme="expandable", **kw), backend


def test_the_timeline_records_maps_and_unmaps():
    pool, backend = make_expandable(timeline=1000)
    a = pool.allocate(100_000)
    b = pool.allocate(3 * P)
    first = a.ptr
    a.release()
    pool.empty_cache()
    tl = pool.timeline()
    assert list(tl.event) == ["map", "alloc_miss", "map", "alloc_miss", "free", "unmap"]
    maps, unmaps = tl[tl.event == "map"], tl[tl.event == "unmap"]
    assert maps["size"].sum() - unmaps["size"].sum() == backend.twin.mapped_bytes(0)
    assert list(maps.origin) == ["", ""] and (maps.ptr.iloc[0], maps["size"].iloc[0]) == (first, 2 * P)
    assert tl.bytes_reserved.iloc[0] == 2 * P             # the map counted with its block
    assert tl.bytes_reserved.iloc[-1] == backend.twin.mapped_bytes(0) == 4 * P
    del b
