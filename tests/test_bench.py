"""The allocator microbenchmark's pure logic on fake timings; a quick real run where a GPU is."""
import math

import pandas as pd
import pytest

from xlab.bench import alloc as bench


def fake_samples():
    """cupy_pool 2 µs, xpool 1.6 µs, raw 70 µs at two sizes; thread rows at 64 KiB; three repeats."""
    rows = []
    cost = {"raw": 70.0, "cupy_pool": 2.0, "xpool_k1": 1.6}
    for rep, jitter in enumerate((1.0, 1.1, 0.9)):
        for name, us in cost.items():
            for n in (4096, 1 << 20):
                rows.append(dict(allocator=name, sweep="size", size_bytes=n, threads=1, repeat=rep,
                                 ns=int(us * jitter * 1000 * 1000), pairs=1000))
            for t in (1, 4):
                rows.append(dict(allocator=name, sweep="threads", size_bytes=65536, threads=t, repeat=rep,
                                 ns=int(us * jitter * t * 1000 * 1000), pairs=1000 * t))
    return pd.DataFrame(rows)


def test_summarize_medians_extremes_and_ratios():
    df = bench.summarize(fake_samples(), {("raw", 4096): 1.0, ("xpool_k1", 4096): 0.0})
    assert list(df.columns) == bench.COLUMNS
    row = df[(df.allocator == "xpool_k1") & (df.sweep == "size") & (df.size_bytes == 4096)].iloc[0]
    assert row.us_per_pair == pytest.approx(1.6)
    assert row.us_per_pair_min == pytest.approx(1.6 * 0.9)
    assert row.us_per_pair_max == pytest.approx(1.6 * 1.1)
    assert row.kpairs_per_s == pytest.approx(1000 / 1.6)
    assert row.ratio_vs_cupy_pool == pytest.approx(2.0 / 1.6)      # > 1: faster than CuPy's pool
    assert row.repeats == 3 and row.device_mallocs_per_pair == 0.0
    pool = df[df.allocator == "cupy_pool"]
    assert list(pool.ratio_vs_cupy_pool) == pytest.approx([1.0] * len(pool))
    raw = df[(df.allocator == "raw") & (df.sweep == "size") & (df.size_bytes == 4096)].iloc[0]
    assert raw.ratio_vs_cupy_pool == pytest.approx(2.0 / 70.0) and raw.device_mallocs_per_pair == 1.0


def test_thread_rows_count_all_threads_pairs():
    df = bench.summarize(fake_samples())
    four = df[(df.sweep == "threads") & (df.threads == 4) & (df.allocator == "cupy_pool")].iloc[0]
    # 4000 pairs in 4 * 2 ms = 8 ms: 500 thousand pairs/s, 2 µs of wall time per pair
    assert four.kpairs_per_s == pytest.approx(500.0)
    assert four.us_per_pair == pytest.approx(2.0)
    assert math.isnan(four.device_mallocs_per_pair)


def test_ratio_is_nan_without_cupy_pool():
    s = fake_samples()
    df = bench.summarize(s[s.allocator != "cupy_pool"])
    assert df.ratio_vs_cupy_pool.isna().all()


def test_table_names_every_allocator_size_and_thread_count():
    text = bench.table(bench.summarize(fake_samples()))
    for word in ("raw", "cupy_pool", "xpool_k1", "4 KiB", "1 MiB", "4 thr", "1.25x"):
        assert word in text


def test_calibrated_pairs_targets_the_time_and_clamps():
    assert bench.calibrated_pairs(ns=2_000_000, pairs=1000, target_s=0.05) == 25_000
    assert bench.calibrated_pairs(ns=10**9, pairs=10, target_s=0.05) == 200
    assert bench.calibrated_pairs(ns=1, pairs=10**6, target_s=1.0) == 400_000


def test_csv_carries_provenance_and_params(tmp_path):
    df = bench.with_provenance(bench.summarize(fake_samples()), repeats=3, target_s=0.01, quick=True)
    out = tmp_path / "sub" / "alloc.csv"
    bench.write_csv(df, out)
    back = pd.read_csv(out)
    for col in bench.COLUMNS + ["gpu", "driver", "cuda", "cupy", "commit", "date", "repeats", "target_s", "quick"]:
        assert col in back.columns
    assert len(back) == len(df)


def test_fmt_size():
    assert [bench.fmt_size(n) for n in (4096, 65536, 1 << 20, 12 << 20, 100)] == \
        ["4 KiB", "64 KiB", "1 MiB", "12 MiB", "100 B"]


def test_without_gpu_exits_with_a_message(capsys):
    from xlab.provenance import has_gpu
    if has_gpu():
        pytest.skip("a GPU is visible")
    assert bench.main(["--quick", "--out", "unused.csv"]) == 2
    assert "needs 1 CUDA GPU" in capsys.readouterr().err


@pytest.mark.gpu
def test_quick_run_on_gpu(tmp_path):
    df = bench.run(out=tmp_path / "a.csv", repeats=2, target_s=0.002,
                   allocators=("raw", "cupy_pool", "xpool_k1", "noop"), progress=False)
    size = df[df.sweep == "size"].set_index(["allocator", "size_bytes"])
    assert (size.loc["raw"].device_mallocs_per_pair == 1.0).all()
    assert (size.loc["xpool_k1"].device_mallocs_per_pair == 0.0).all()
    assert (size.loc["cupy_pool"].device_mallocs_per_pair == 0.0).all()
    assert (tmp_path / "a.csv").exists()
