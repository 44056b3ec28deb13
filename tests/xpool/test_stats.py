"""Statistics: a Snapshot of exact counters per device, differenced by steps, peaks and their reset."""
import pytest

import xpool
from xpool import Pool
from xpool_twin import HostBackend


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
