"""The allocator microbenchmark's pure logic on fake timings; a quick real run where a GPU is."""
import contextlib
import math
import pathlib

import pandas as pd
import pytest

from xlab.bench import alloc as bench

ROOT = pathlib.Path(__file__).resolve().parents[2]


def fake_samples():
    """cupy_pool 2 µs, xpool 1.6 µs, raw 70 µs at two sizes; thread rows at 64 KiB; three trials, each trial's
    drift (jitter) hitting every arm alike."""
    rows = []
    cost = {"raw": 70.0, "cupy_pool": 2.0, "xpool_k1": 1.6}
    for trial, jitter in enumerate((1.0, 1.1, 0.9)):
        for name, us in cost.items():
            for n in (4096, 1 << 20):
                rows.append(dict(allocator=name, sweep="size", size_bytes=n, threads=1, trial=trial,
                                 ns=int(us * jitter * 1000 * 1000), pairs=1000))
            for t in (1, 4):
                rows.append(dict(allocator=name, sweep="threads", size_bytes=65536, threads=t, trial=trial,
                                 ns=int(us * jitter * t * 1000 * 1000), pairs=1000 * t))
    return pd.DataFrame(rows)


def test_trial_rows_and_their_summary():
    rows = bench.trial_rows(fake_samples(), {("raw", 4096): 1.0, ("xpool_k1", 4096): 0.0})
    assert list(rows.columns) == bench.COLUMNS and (rows.trials == 3).all()
    assert len(rows) == 3 * 3 * 4                                    # one row per (trial, allocator, case)
    mine = rows[(rows.allocator == "xpool_k1") & (rows.sweep == "size") & (rows.size_bytes == 4096)]
    # paired per trial: the drift cancels, every trial gives the same ratio
    assert mine.ratio_vs_cupy_pool.tolist() == pytest.approx([2.0 / 1.6] * 3, rel=1e-6)
    df = bench.summary(rows)
    row = df[(df.allocator == "xpool_k1") & (df.sweep == "size") & (df.size_bytes == 4096)].iloc[0]
    assert row.us_per_pair == pytest.approx(1.6)
    assert row.us_per_pair_lo == pytest.approx(1.6 * 0.9) and row.us_per_pair_hi == pytest.approx(1.6 * 1.1)
    assert row.kpairs_per_s == pytest.approx(1000 / 1.6)
    assert row.ratio_vs_cupy_pool == pytest.approx(2.0 / 1.6, rel=1e-6)      # > 1: faster than CuPy's pool
    assert row.ratio_vs_cupy_pool_hi == pytest.approx(2.0 / 1.6, rel=1e-6) and row.n_trials == 3
    assert mine.device_mallocs_per_pair.tolist() == [0.0] * 3
    pool = df[df.allocator == "cupy_pool"]
    assert list(pool.ratio_vs_cupy_pool) == pytest.approx([1.0] * len(pool))
    raw = rows[(rows.allocator == "raw") & (rows.sweep == "size") & (rows.size_bytes == 4096)].iloc[0]
    assert raw.ratio_vs_cupy_pool == pytest.approx(2.0 / 70.0) and raw.device_mallocs_per_pair == 1.0


def test_thread_rows_count_all_threads_pairs():
    df = bench.summary(bench.trial_rows(fake_samples()))
    four = df[(df.sweep == "threads") & (df.threads == 4) & (df.allocator == "cupy_pool")].iloc[0]
    # 4000 pairs in 4 * 2 ms = 8 ms: 500 thousand pairs/s, 2 µs of wall time per pair
    assert four.kpairs_per_s == pytest.approx(500.0)
    assert four.us_per_pair == pytest.approx(2.0)
    assert math.isnan(four.device_mallocs_per_pair)


def test_ratio_is_nan_without_cupy_pool():
    s = fake_samples()
    df = bench.trial_rows(s[s.allocator != "cupy_pool"])
    assert df.ratio_vs_cupy_pool.isna().all()


def test_table_names_every_allocator_size_and_thread_count():
    text = bench.table(bench.summary(bench.trial_rows(fake_samples())))
    for word in ("raw", "cupy_pool", "xpool_k1", "4 KiB", "1 MiB", "4 thr", "1.25x"):
        assert word in text


def test_calibrated_pairs_targets_the_time_and_clamps():
    assert bench.calibrated_pairs(ns=2_000_000, pairs=1000, target_s=0.05) == 25_000
    assert bench.calibrated_pairs(ns=10**9, pairs=10, target_s=0.05) == 200
    assert bench.calibrated_pairs(ns=1, pairs=10**6, target_s=1.0) == 400_000


def test_csv_carries_provenance_and_params(tmp_path):
    df = bench.with_provenance(bench.trial_rows(fake_samples()), target_s=0.01, quick=True)
    out = tmp_path / "sub" / "alloc.csv"
    bench.publish(df, out)
    back = pd.read_csv(out)
    for col in bench.COLUMNS + ["gpu", "driver", "cuda", "cupy", "commit", "date", "trials", "target_s", "quick"]:
        assert col in back.columns
    assert len(back) == len(df)


def test_the_old_single_run_csv_still_summarises():
    import pathlib
    old = pathlib.Path(__file__).resolve().parents[2] / "data" / "alloc_microbench.csv"
    if not old.is_file():
        pytest.skip("no committed CSV")
    s = bench.summary(pd.read_csv(old))
    assert len(s) and s["us_per_pair"].notna().all()


def test_without_gpu_exits_with_a_message(capsys):
    from xlab.provenance import has_gpu
    if has_gpu():
        pytest.skip("a GPU is visible")
    assert bench.main(["--quick", "--out", "unused.csv"]) == 2
    assert "needs 1 CUDA GPU" in capsys.readouterr().err


@pytest.mark.gpu
def test_quick_run_on_gpu(tmp_path):
    df = bench.run(out=tmp_path / "a.csv", trials=2, target_s=0.002,
                   allocators=("raw", "raw_held", "cupy_pool", "xpool_k1", "noop"), progress=False)
    assert set(df.trial) == {0, 1}
    size = df[(df.sweep == "size") & (df.trial == 0)].set_index(["allocator", "size_bytes"])
    assert (size.loc["raw"].device_mallocs_per_pair == 1.0).all()
    assert (size.loc["xpool_k1"].device_mallocs_per_pair == 0.0).all()
    assert (size.loc["cupy_pool"].device_mallocs_per_pair == 0.0).all()
    assert (tmp_path / "a.csv").exists()


@pytest.mark.gpu
def test_torch_arm_hands_cupy_torch_blocks(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch without CUDA")
    import cupy
    from xlab import allocators
    alloc = allocators.make("cupy_torch")
    alloc.install()
    try:
        a = cupy.arange(1000, dtype=cupy.float32)
        assert float(a.sum()) == 499500.0
        assert alloc.peak_requested(0) >= 4000 and alloc.device_mallocs(0) >= 1
        m0 = alloc.device_mallocs(0)
        for _ in range(100):
            b = cupy.empty(4096, cupy.uint8)
            del b
        assert alloc.device_mallocs(0) == m0            # PyTorch's cache serves the repeats
    finally:
        alloc.uninstall()
        alloc.release([0])
    df = bench.run(out=tmp_path / "t.csv", trials=2, target_s=0.002, allocators=("cupy_pool", "torch"),
                   sizes=(4096,), progress=False)
    assert (df[df.allocator == "torch"].us_per_pair > 0).all()


def test_gil_probe_checks_its_arguments_before_touching_a_gpu():
    from xlab.bench import gil
    with pytest.raises(ValueError, match="unknown arms"):
        gil.run(arms=("nope",), out=None)
    with pytest.raises(ValueError, match="threads must be positive"):
        gil.run(arms=("python",), threads=(0, 2), out=None)


def _stand_in_rank(op):
    """A GIL-probe rank without a GPU (a class: each instance is one rank), whose op for an arm is op(arm)."""
    import contextlib
    import types
    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda d: contextlib.nullcontext()))

    class Stream(contextlib.nullcontext):
        def synchronize(self):
            pass

    class Rank:
        cupy, device, stream = fake_cupy, 0, Stream()

        def op(self, arm):
            return op(arm)
    return Rank


def test_gil_probe_loop_counts_every_thread(monkeypatch):
    # _run on stand-in ranks (no GPU): every thread's ops are counted and the CPU time is per thread
    from xlab.bench import gil
    Rank = _stand_in_rank(lambda arm: gil._python_op)
    total, cpu = gil._run([Rank(), Rank()], "python", 0.05)
    assert total >= 2 * 50 and len(cpu) == 2 and all(c > 0 for c in cpu)


def test_eight_argument_buffer_has_cudas_parameter_layout():
    # three pointers, three long longs, an int and a float: offsets 0..40, 48, 52; 56 bytes, as the C struct
    from xlab.bench import gil
    assert gil.EIGHT_ARGS.size == 56
    raw = gil.EIGHT_ARGS.pack(1, 2, 3, 4, 5, 6, 7, 8.0)
    import struct
    assert struct.unpack_from("<q", raw, 40)[0] == 6 and struct.unpack_from("<i", raw, 48)[0] == 7
    assert struct.unpack_from("<f", raw, 52)[0] == 8.0


def test_gil_probe_fails_when_an_op_fails():
    from xlab.bench import gil

    def boom():
        raise RuntimeError("cuLaunchKernel failed")
    Rank = _stand_in_rank(lambda arm: boom)
    with pytest.raises(RuntimeError, match="cuLaunchKernel failed"):
        gil._run([Rank(), Rank()], "launch", 0.05)


def test_rotated_puts_every_arm_in_every_position_once_per_len_trials():
    arms = ["a", "b", "c"]
    orders = [bench.rotated(arms, t) for t in range(3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert all(sorted(o) == arms for o in orders) and bench.rotated(arms, 3) == arms
    for position in range(3):
        assert {o[position] for o in orders} == set(arms)


def test_median_window_keeps_the_median_windows_rate():
    rates = iter([10.0, 99.0, 11.0, 12.0, 10.5])     # one window hit by a burst of other work
    calls = []

    def run(pairs):
        calls.append(pairs)
        return int(next(rates) * pairs), pairs
    ns, pairs = bench.median_window(run, 1000, 5)
    assert calls == [200] * 5 and pairs == 1000
    assert ns / pairs == pytest.approx(11.0)          # the burst moves nothing


class FakeArm:
    """A registry allocator that records what the benchmark does with it; `raw` calls the device when warm."""

    def __init__(self, name, log):
        self.name, self.log = name, log
        self.device_calls_when_warm = name == "raw"

    def install(self, counting=False):
        self.log.append(("install", self.name))

    def uninstall(self):
        self.log.append(("uninstall", self.name))

    def trim(self, devices=()):
        self.log.append(("trim", self.name))

    def release(self, devices=()):
        pass

    def tracking(self):
        import contextlib
        return contextlib.nullcontext()

    def device_mallocs(self, device):
        return None


def fake_bench(monkeypatch, log):
    """bench.measure over FakeArms; every timed call logs ("run", installed arm, pairs) and costs 1 µs a pair."""
    installed = []
    monkeypatch.setattr(bench.registry, "make", lambda name, **kw: FakeArm(name, log))
    orig = bench._installed

    @contextlib.contextmanager
    def Installed(alloc, counting=False):
        installed.append(alloc.name)
        try:
            with orig(alloc, counting) as a:
                yield a
        finally:
            installed.pop()

    def run(pairs):
        log.append(("run", installed[-1] if installed else None, pairs))
        return 1000 * pairs, pairs
    monkeypatch.setattr(bench, "_installed", Installed)
    monkeypatch.setattr(bench, "timer", lambda case: run)
    monkeypatch.setattr(bench, "time_pairs", lambda n, pairs: (1000 * pairs, pairs))


def test_size_sweep_arms_of_one_case_run_back_to_back(monkeypatch):
    """Every (trial, case) times each arm once, in the trial's rotated order, before the next case."""
    fake_bench(monkeypatch, [])
    samples, _ = bench.measure(("cupy_pool", "xpool", "c_noop"), sizes=(4096, 1 << 20), threads=(1,), trials=2,
                               target_s=0.001, progress=False)
    assert len(samples) == 2 * 3 * 3 and (samples[samples.sweep == "size"].windows == bench.WINDOWS).all()
    first = samples[samples.trial == 0]
    assert list(first.allocator[:3]) == ["cupy_pool", "xpool", "c_noop"]       # case 4 KiB, arms together
    assert list(first.size_bytes[:3]) == [4096] * 3
    second = samples[samples.trial == 1]
    assert list(second.allocator[:3]) == ["xpool", "c_noop", "cupy_pool"]      # rotated by one
    import gc
    assert gc.isenabled()                       # off only while windows are timed
    gc.disable()
    try:
        bench.measure(("cupy_pool",), sizes=(4096,), threads=(), trials=1, target_s=0.001, progress=False)
        assert not gc.isenabled()               # and left as the caller had it
    finally:
        gc.enable()


def test_cached_arms_take_turns_window_by_window_and_device_arms_run_alone(monkeypatch):
    log = []
    fake_bench(monkeypatch, log)
    samples, _ = bench.measure(("raw", "cupy_pool", "xpool"), sizes=(4096,), threads=(), trials=1,
                               target_s=0.001, progress=False)
    start = max(i for i, e in enumerate(log) if e[0] == "run" and e[2] == 200) + 1     # after the calibration
    timed = [e for e in log[start:] if e[0] == "run" and e[2] > bench.SWITCH_WARM and e[2] != 50]
    raw = [e[1] for e in timed if e[1] == "raw"]
    assert len(raw) == bench.WINDOWS                                    # raw: its windows in one go ...
    assert [e[1] for e in timed[:bench.WINDOWS]] == ["raw"] * bench.WINDOWS
    trims = [e[1] for e in log[start:log.index(("install", "raw"), start)] if e[0] == "trim"]
    assert set(trims) == {"cupy_pool", "xpool"}                         # ... with the others' caches given back
    turns = [e[1] for e in timed[bench.WINDOWS:]]
    assert len(turns) == 2 * bench.WINDOWS
    assert all({a, b} == {"cupy_pool", "xpool"} for a, b in zip(turns[::2], turns[1::2]))   # one window each
    assert turns[:2] == ["cupy_pool", "xpool"] and turns[2:4] == ["xpool", "cupy_pool"]     # rotated each round
    warm = [log[i - 1] for i, e in enumerate(log) if i > start and e in timed and e[1] != "raw"]
    assert all(w[0] == "run" and w[2] == bench.SWITCH_WARM for w in warm)   # each turn warms its arm first
    assert (samples.windows == bench.WINDOWS).all() and set(samples.allocator) == {"raw", "cupy_pool", "xpool"}


def test_host_mode_times_the_c_core_on_a_cpu(tmp_path):
    out = tmp_path / "host.csv"
    df = bench.run_host(out=out, trials=2, target_s=0.002, sizes=(4096, 12 << 20), progress=False)
    assert list(df.columns[:len(bench.HOST_COLUMNS)]) == bench.HOST_COLUMNS
    assert len(df) == 2 * len(bench.HOST_ARMS) * len(bench.HOST_SCENARIOS) * 2
    assert (df.ns_per_pair > 0).all() and set(df.scenario) == set(bench.HOST_SCENARIOS)
    seed = df[df.allocator == "xpool_seed"]
    assert (seed.ratio_vs_xpool_seed == 1).all()
    assert {"commit", "date", "target_s"} <= set(pd.read_csv(out).columns)


def test_host_pool_busy_leaves_ranges_free_and_in_use():
    pool = bench.host_pool("segments", busy=True)
    s = pool._core.stats(0)
    assert s["blocks_in_use"] == 150 and s["blocks_cached"] > 10


def test_miss_cost_rows_carry_every_configuration_and_provenance(tmp_path):
    """xlab.bench.miss_cost: one row per (build, scheme, layout, n, trial), trials in turns, with provenance; the
    pools hold the fragments asked for; counts are checked on the command line."""
    from xlab.bench import miss_cost
    out = tmp_path / "miss_cost.csv"
    df = miss_cost.run(out=str(out), sizes=(10, 40), trials=2, before=None, misses=3)
    assert out.is_file() and len(df) == 2 * len(miss_cost.KINDS) * 2
    assert list(df.columns[:len(miss_cost.COLUMNS)]) == miss_cost.COLUMNS and (df.us_per_miss > 0).all()
    assert (df.device_calls == 3).all() and {"commit", "date", "gpu", "page"} <= set(df.columns)
    import xpool
    pool, keep = miss_cost._fragmented(xpool, "expandable", "holes", 25)
    st = pool.stats(0)[0]
    assert st["bytes_in_use"] == 25 * miss_cost.PAGE and st["bytes_cached"] == 0 and len(keep) == 25
    summary = miss_cost.summary(df)
    assert set(summary["n"].astype(str)) >= {"10", "40", "40 / 10"}
    with pytest.raises(SystemExit):
        miss_cost.main(["--trials", "0"])


def test_the_committed_miss_costs_grow_only_with_the_research_builds_holes():
    """data/miss_cost_host.csv (issue #43, defect 4): a miss's host cost over the lab's null ops, with 1e3 to 1e5
    fragments cached. The research build (5bcaad4) walked every unmapped hole (133x from 1e3 to 1e5); the product's
    index of unmapped runs keeps every layout within 1.5x, at a constant ~0.3 us a miss above the research build's
    where nothing is fragmented (the index's upkeep; a real miss adds a cudaMalloc or a map of tens of us)."""
    df = pd.read_csv(ROOT / "data" / "miss_cost_host.csv")
    med = df.groupby(["build", "scheme", "layout", "n"]).us_per_miss.median().unstack("n")
    growth = med[med.columns.max()] / med[med.columns.min()]
    assert (growth["product"] < 1.5).all(), growth
    assert growth["5bcaad4", "expandable", "holes"] > 50
    assert (med.loc["product"] - med.loc["5bcaad4"]).drop(("expandable", "holes")).max().max() < 0.5
    assert df.groupby(["build", "scheme", "layout", "n"]).trial.nunique().min() >= 5


def test_the_committed_hit_path_is_no_slower_than_the_research_builds():
    """data/hit_builds_host.csv (issue #42: the hit path no slower after the freeze): malloc+free pairs through CuPy's
    hooks and PyTorch's entry points, the research build (5bcaad4) and the product interleaved in 11 processes. Per
    (path, scheme, size), the median over processes of before / after: CuPy's path faster everywhere; PyTorch's
    within 0.5% (at 64 KiB 0.998 [0.992, 1.000]: the interval's top 2e-5 short of 1, a 0.2% difference)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("hit_builds", ROOT / "scripts" / "hit_builds.py")
    hit_builds = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hit_builds)
    got = hit_builds.ratios(pd.read_csv(ROOT / "data" / "hit_builds_host.csv"))
    assert len(got) == 9 and (got.n_processes >= 5).all()
    assert (got.hi >= 0.995).all() and (got.ratio >= 0.995).all(), got   # nowhere more than 0.5% slower
    assert (got[got.path == "cupy"].lo > 1).all(), got        # CuPy's path: faster (the hit path's helpers inline)


@pytest.mark.parametrize("argv,message", [(["--trials", "0"], "--trials: must be >= 1, got 0"),
                                          (["--sizes", "4096", "0"], "--sizes: must be >= 1, got 0"),
                                          (["--window-s", "0"], "--window-s: must be > 0.0, got 0"),
                                          (["--trials", "two"], "--trials: invalid int value: 'two'")])
def test_counts_on_the_command_line_are_checked_before_anything_runs(argv, message, capsys):
    from xlab.bench import hit
    with pytest.raises(SystemExit):
        hit.main(argv)
    assert message in capsys.readouterr().err
