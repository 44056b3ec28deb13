"""Statistics: a Snapshot of exact counters per device, differenced by steps, peaks and their reset."""
import inspect

import pytest

import xpool
from xpool import Pool
from xpool.counters import COLUMNS, COUNTERS, GAUGES, Snapshot
from xpool_twin import HostBackend, TwinBackend


KiB, MiB = 1 << 10, 1 << 20


def make(capacity=None, **kw):
    backend = HostBackend(capacity=capacity)
    return Pool(backend, **kw), backend


@pytest.mark.usefixtures("seed_scheme")
def test_snapshot_difference_counts_step_activity():
    pool, _ = make()
    keep = [pool.allocate(n) for n in (100, 2000, 3 * MiB)]
    del keep
    s0 = pool.stats()
    step = [pool.allocate(n) for n in (100, 2000, 3 * MiB, 5 * MiB)]
    d = pool.stats() - s0
    assert (d.requests, d.hits, d.misses, d.device_mallocs) == (4, 3, 1, 1)
    assert d.bytes_in_use == sum(b.size for b in step)   # gauges keep the later value
    del step


@pytest.mark.usefixtures("seed_scheme")
def test_stats_frame_schema():
    from xpool.counters import COLUMNS
    pool, _ = make()
    pool.allocate(1)
    pytest.importorskip("pandas")
    df = pool.stats().frame()
    assert tuple(df.columns) == COLUMNS and len(df) == 1
    assert list(xpool.stats().frame().columns) == list(COLUMNS)   # nothing installed: empty, same columns
    assert len(xpool.stats().frame()) == 0


@pytest.mark.usefixtures("seed_scheme")
def test_peaks_and_reset():
    pool, _ = make()
    a, b = pool.allocate(3000), pool.allocate(5000)
    del a, b
    st = pool.stats()
    assert (st.peak_bytes_in_use, st.peak_bytes_requested, st.peak_bytes_reserved) == (8192, 8000, 8192)
    pool.reset_peak_stats()
    st = pool.stats()
    assert (st.peak_bytes_in_use, st.peak_bytes_requested, st.peak_bytes_reserved) == (0, 0, 8192)


def _two_devices():
    pool = Pool(HostBackend(n_devices=3))
    held = [pool.allocate(1000, device=0), pool.allocate(3 << 20, device=2)]
    pool.allocate(5000, device=2).release()
    return pool, held


def test_reset_peak_stats_takes_a_device_alone():
    assert list(inspect.signature(Pool.reset_peak_stats).parameters) == ["self", "device"]
    with pytest.raises(TypeError):
        Pool(HostBackend()).reset_peak_stats(history=True)


def test_stats_without_a_pool_is_empty_and_says_so():
    assert xpool.current() is None
    snap = xpool.stats()
    assert isinstance(snap, Snapshot) and len(snap) == 0 and list(snap) == []
    assert "no xpool pool in use" in repr(snap) and "xpool.install()" in repr(snap)
    assert snap.device_mallocs == 0 and snap["bytes_cached"] == 0


def test_stats_with_a_pool_in_use_is_its_snapshot():
    pool, held = _two_devices()
    with xpool.use(xpool.MemoryPool(backend=HostBackend())) as mp:
        mp.allocate(4096).release()
        assert xpool.stats() == mp.stats() and xpool.stats().requests == 1
    del pool, held


def test_a_snapshot_sums_over_devices_and_gives_each_devices_dict():
    pool, held = _two_devices()
    snap = pool.stats()
    assert list(snap) == [0, 2] and len(snap) == 2
    assert isinstance(snap[0], dict) and snap[0]["requests"] == 1 and snap[2]["requests"] == 2
    for name in COUNTERS + GAUGES:
        assert getattr(snap, name) == snap[name] == snap.total(name) == snap[0][name] + snap[2][name], name
    assert snap.bytes_in_use == 1024 + (3 << 20) and snap.blocks_in_use == 2
    assert pool.stats(2) == Snapshot({2: snap[2]})
    with pytest.raises(KeyError):
        snap[1]
    with pytest.raises(ValueError, match="name must be a counter or gauge"):
        snap["nothing"]
    with pytest.raises(AttributeError, match="'Snapshot' has no attribute 'nothing'"):
        snap.nothing
    del held


def test_a_snapshot_difference_counts_activity_and_keeps_the_later_gauges():
    pool, held = _two_devices()
    before = pool.stats()
    a = pool.allocate(5000, device=2)                  # a hit
    b = pool.allocate(7 << 20, device=0)               # a miss
    d = pool.stats() - before
    assert isinstance(d, Snapshot) and list(d) == [0, 2]
    assert (d[0]["requests"], d[0]["misses"], d[2]["requests"], d[2]["hits"]) == (1, 1, 1, 1)
    assert (d.requests, d.device_mallocs) == (2, 1)
    now = pool.stats()
    assert all(d[dev][g] == now[dev][g] for dev in d for g in GAUGES)   # levels: the later value
    del a, b, held


def test_a_snapshot_frame_is_one_row_per_device():
    pd = pytest.importorskip("pandas")
    pool, held = _two_devices()
    snap = pool.stats()
    df = snap.frame()
    assert isinstance(df, pd.DataFrame) and tuple(df.columns) == COLUMNS and list(df.device) == [0, 2]
    assert df.set_index("device").loc[2, "bytes_cached"] == snap[2]["bytes_cached"]
    assert int(df.requests.sum()) == snap.requests
    del held


def test_a_snapshots_repr_shows_each_device():
    pool, held = _two_devices()
    text = repr(pool.stats())
    assert text.splitlines()[0].split()[:3] == ["device", "requests", "hits"] and len(text.splitlines()) == 3
    del held


P = 1 << 16                     # the twin's default granularity: the scheme's page


def make_expandable(capacity=None, n_devices=2, granularity=P, **kw):
    backend = TwinBackend(capacity=capacity, n_devices=n_devices, granularity=granularity)
    return Pool(backend, scheme="expandable", **kw), backend


def expandable(**kw):
    backend = TwinBackend(n_devices=1, granularity=P)
    return Pool(backend, scheme="expandable", **kw), backend


def test_snapshots_count_maps_and_unmaps():
    pool, backend = make_expandable()
    before = pool.stats()
    pool.allocate(2 * P).release()
    pool.empty_cache()
    d = pool.stats() - before
    assert (d.device_maps, d.device_unmaps, d.device_mallocs, d.device_frees) == (1, 1, 0, 0)
    assert {"device_maps", "device_unmaps"} <= set(pool.stats()[0])
