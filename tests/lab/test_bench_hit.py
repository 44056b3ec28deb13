"""The hit-path breakdown (xlab.bench.hit): its arithmetic on fake rows, a CPU run's shape, the GPU arms where a GPU
is. No timing is asserted: the numbers are the benchmark's, not the tests'."""
import ctypes

import pandas as pd
import pytest

from xlab.bench import hit
from xlab import _probes


def fake_rows():
    """Three trials, each trial's drift (x) hitting every arm alike; per pair: floor 1500, core +60, lookup +90,
    old lookup +200, CuPy's pool +400."""
    cost = {"c_noop": 1500, "xpool_core": 1560, "xpool": 1650, "xpool_old_lookup": 1760, "cupy_pool": 1900}
    rows = [dict(arm=a, size_bytes=4096, trial=t, ns=ns * x * 1000, calls=1000, windows=5, trials=3)
            for t, x in enumerate((1.0, 1.2, 0.9)) for a, ns in cost.items()]
    return pd.DataFrame(rows, columns=hit.COLUMNS)


def test_breakdown_subtracts_arms_paired_by_trial():
    arms, diffs = hit.breakdown(fake_rows())
    got = diffs.set_index("difference").ns
    assert got["core in place"] == pytest.approx(60)
    assert got["lookup in place"] == pytest.approx(90)
    assert got["old lookup in place"] == pytest.approx(200)
    assert got["xpool - cupy_pool"] == pytest.approx(-250)
    assert set(arms.arm) == set(fake_rows().arm) and (arms.n_trials == 3).all()


def test_breakdown_leaves_out_differences_whose_arms_did_not_run():
    rows = fake_rows()
    _, diffs = hit.breakdown(rows[rows.arm.isin(["c_noop", "xpool_core"])])   # a CPU run
    assert list(diffs.difference) == ["core in place"]
    assert "core in place" in hit.table(rows)


def test_cpu_run_times_the_floor_and_the_core(tmp_path):
    from xlab.provenance import has_gpu
    if has_gpu():
        pytest.skip("a GPU is visible: the GPU arms run instead (test_gpu_run_has_every_arm)")
    out = tmp_path / "hit.csv"
    df = hit.run(out=str(out), trials=2, sizes=(4096,), window_s=0.0005, progress=False)
    assert set(df.arm) == {"c_noop", "xpool_core", "core_c"} and len(df) == 2 * 3
    assert (df.ns > 0).all() and (df.calls >= 100).all()
    assert {"commit", "path", "window_s"} <= set(pd.read_csv(out).columns)


def test_time_calls_checks_its_arguments_and_passes_the_lookups_error():
    fn = ctypes.CFUNCTYPE(ctypes.c_ssize_t, ctypes.c_int)(lambda device: device)
    addr = ctypes.cast(fn, ctypes.c_void_p).value
    assert _probes.time_calls(addr, 10, 3) >= 0
    with pytest.raises(ValueError, match="fn must be"):
        _probes.time_calls(0, 10)
    with pytest.raises(ValueError, match="calls must be"):
        _probes.time_calls(addr, -1)
    with pytest.raises(ValueError, match="device must be"):
        _probes.time_calls(addr, 1, 64)
    fails = ctypes.cast(ctypes.pythonapi.PyLong_AsSsize_t, ctypes.c_void_p).value   # NULL: SystemError, -1
    with pytest.raises(SystemError):
        _probes.time_calls(fails, 2, 0)


@pytest.mark.gpu
def test_gpu_run_has_every_arm(tmp_path):
    df = hit.run(out=str(tmp_path / "hit.csv"), trials=1, sizes=(4096,), window_s=0.0005, progress=False)
    assert set(df.arm) == {"c_noop", "xpool_core", "xpool", "xpool_old_lookup", "cupy_pool", "core_c",
                           "lookup_c", "old_lookup_c"}
    assert (df.ns > 0).all()
