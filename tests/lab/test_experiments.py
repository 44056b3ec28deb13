"""Training-experiment logic on a CPU: flatten round trip, host all-reduce, the checks (and that they fail
when they should), rows and ratios, counters, the sampler, the --cpu-smoke CLI. Quick GPU runs are marked."""
import gc
import math
import threading

import numpy as np
import pandas as pd
import pytest

from xlab.experiments import __main__ as cli
from xlab import allocators, nvml
from xlab.experiments import ddp, runner, train
from tapegpt import GPT, AdamW, load_corpus

TINY = train.make_config("tiny")


# --- flatten / unflatten

def test_flatten_unflatten_round_trip_with_loss():
    rng = np.random.default_rng(0)
    grads = {"a": rng.normal(size=(3, 4)), "b": rng.normal(size=(5,)), "c": rng.normal(size=(2, 1, 2))}
    loss = np.array(2.5)
    flat = train.flatten(grads, loss)
    assert flat.shape == (12 + 5 + 4 + 1,)
    back, back_loss = train.unflatten(flat, grads)
    assert list(back) == list(grads)
    for k in grads:
        assert back[k].shape == grads[k].shape
        np.testing.assert_array_equal(back[k], grads[k])
        assert np.shares_memory(back[k], flat)          # views: scaling the buffer scales the grads
    assert float(back_loss) == 2.5


def test_unflatten_without_loss_gives_none():
    grads = {"w": np.ones((2, 2), np.float32)}
    back, loss = train.unflatten(train.flatten(grads), grads)
    assert loss is None and back["w"].dtype == np.float32


# --- host communicator

def test_host_comm_allreduce_sums_and_bcast_copies_rank0():
    world = 3
    comm = train.HostComm(world)

    def rank(r):
        buf = np.full(4, float(r + 1))
        comm.rank(r).allreduce(buf)
        b = np.full(2, float(r))
        comm.rank(r).bcast(b, 0)
        return buf, b

    out = runner.run_threads(world, rank)
    for buf, b in out:
        np.testing.assert_array_equal(buf, np.full(4, 6.0))
        np.testing.assert_array_equal(b, np.zeros(2))


def test_fenced_meets_before_and_waits_after_each_collective():
    calls = []

    class Comm:
        def allreduce(self, buf):
            calls.append("allreduce")

        def bcast(self, buf, root=0):
            calls.append(f"bcast{root}")

    f = train.Fenced(Comm(), lambda: calls.append("barrier"), lambda: calls.append("sync"))
    f.allreduce(None)
    f.bcast(None, 0)
    assert calls == ["barrier", "allreduce", "sync", "barrier", "bcast0", "sync"]
    calls.clear()
    f.armed = False                     # a warm pool: the all-reduce runs unfenced, the check's bcast never does
    f.allreduce(None)
    f.bcast(None, 0)
    assert calls == ["allreduce", "barrier", "bcast0", "sync"]


class _Counting(allocators.Host):
    """NumPy stand-in that says whether it calls the device once warm."""

    def __init__(self, device_calls_when_warm):
        super().__init__()
        self.device_calls_when_warm = device_calls_when_warm


@pytest.mark.parametrize("device_calls", [True, False])
def test_fence_is_armed_in_warmup_and_only_where_needed_after(device_calls):
    """Warm-up steps are fenced for every allocator; timed steps only for one that still calls the device."""
    data = load_corpus()
    host = train.HostComm(2)
    barriers = [0, 0]

    def rank(r):
        def count():
            barriers[r] += 1
        fenced = train.Fenced(host.rank(r), count, lambda: None)
        out = train.run_rank(_Counting(device_calls), TINY, data, 2, 3, 2, rank=r, world=2, comm=fenced)
        assert fenced.armed                                  # re-armed after the window, for the checks
        return out

    out = runner.run_threads(2, rank)
    # 2 warm-up all-reduces + (3 timed all-reduces if armed) + 1 bcast of the parameter check
    assert barriers == [2 + 3 * device_calls + 1] * 2
    assert all(o["fenced"] == device_calls for o in out)
    assert out[0]["losses"] == out[1]["losses"]


def test_merge_ranks_gathers_each_allocators_runs():
    per_rank = [[(t, dict(allocator=a, counted_steps=3, timed=[f"t{a}{r}{t}"],
                          counted=[f"c{a}{r}"] if t == 0 else None))
                 for t, a in runner.interleaved(2, "xy")] for r in range(2)]
    merged = ddp.merge_ranks(per_rank)
    assert [(t, m["allocator"]) for t, m in merged] == [(0, "x"), (0, "y"), (1, "x"), (1, "y")]
    assert merged[1][1]["timed"] == ["ty00", "ty10"] and merged[0][1]["counted"] == ["cx0", "cx1"]
    assert merged[3][1]["counted"] is None and merged[3][1]["timed"] == ["ty01", "ty11"]


def test_interleaved_order_and_bad_arguments():
    assert runner.interleaved(2, ["a", "b"]) == [(0, "a"), (0, "b"), (1, "a"), (1, "b")]
    with pytest.raises(ValueError, match="trials"):
        runner.interleaved(0, ["a"])
    with pytest.raises(ValueError, match="arms"):
        runner.interleaved(2, [])


def test_run_arm_counts_once_and_releases(monkeypatch):
    made = []

    class Fake(allocators.Host):
        free_counting = False

        def __init__(self):
            super().__init__()
            self.released = False
            made.append(self)

        def release(self, devices=()):
            self.released = True

    import dataclasses
    from xlab import shared
    # the arms table names each arm's class of xlab.allocators (its `make`): the numpy arm made by Fake here
    monkeypatch.setattr(allocators, "Fake", Fake, raising=False)
    monkeypatch.setitem(shared._TABLE, "numpy", dataclasses.replace(shared._TABLE["numpy"], make="Fake", exact=False))
    steps = []
    ranks = lambda alloc, n: steps.append((alloc.counting, n)) or [{"n": n}]      # noqa: E731
    m = runner.run_arm("numpy", ranks, 5, 2, [0], count=True)
    assert steps == [(False, 5), (True, 2)] and m["counted_steps"] == 2 and m["counted"] == [{"n": 2}]
    m = runner.run_arm("numpy", ranks, 5, 2, [0], count=False)
    assert m["counted"] is None and m["counted_steps"] == 0
    assert len(made) == 3 and all(a.released for a in made)


def test_run_threads_reraises_a_rank_failure():
    def fn(r):
        if r == 1:
            raise ValueError("boom")
        return r

    with pytest.raises(RuntimeError, match="rank 1"):
        runner.run_threads(2, fn)


# --- checks

def test_loss_rel_diff():
    assert train.loss_rel_diff([1.0, 2.0], [1.0, 2.0]) == 0.0
    assert train.loss_rel_diff([1.0, 2.0 + 2e-6], [1.0, 2.0]) == pytest.approx(1e-6)
    assert train.loss_rel_diff([1.0, 2.0, 9.0], [1.0, 2.0]) == 0.0          # the common prefix
    assert math.isnan(train.loss_rel_diff([1.0, float("nan")], [1.0, 2.0]))


def test_checks_fail_when_they_should():
    assert train.checks_passed(0.0, 0.0)
    assert train.checks_passed(1e-7, 9e-7)
    assert train.checks_passed(None, None)                     # nothing checked
    assert not train.checks_passed(2e-6, 0.0)                  # loss off
    assert not train.checks_passed(0.0, 1e-6)                  # params must be strictly under 1e-6
    assert not train.checks_passed(math.nan, None)             # a diverged loss never passes
    assert not train.checks_passed(None, math.nan)


# --- the data-parallel step on NumPy: matches one process on the global batch

def test_ddp_on_host_threads_matches_single_process_on_global_batch():
    data = load_corpus()
    ref = ddp.reference_losses(TINY, data, batch=8, steps=3, warmup=1, cpu=True)
    ((trial, m),) = ddp.threads_arms(2, ("numpy",), TINY, data, batch=4, steps=3, warmup=1, count_steps=1,
                                     cpu=True, progress=False, trials=1)
    assert trial == 0
    assert len(m["timed"]) == 2
    row = train.build_row("threads", m, 2, 4, TINY, 3, 1, ref_losses=ref)
    assert row["loss_rel_diff_max"] < 1e-12 and row["param_rank_diff_max"] < 1e-12
    assert row["checks_passed"]


class NoAverage:
    """A broken communicator: each rank keeps its own gradients (no all-reduce), bcast works."""

    def __init__(self, host_rank):
        self.host = host_rank

    def allreduce(self, buf):
        pass

    def bcast(self, buf, root=0):
        self.host.bcast(buf, root)


def test_checks_catch_a_missing_allreduce():
    data = load_corpus()
    ref = ddp.reference_losses(TINY, data, batch=8, steps=3, warmup=1, cpu=True)
    host = train.HostComm(2)
    alloc = allocators.make("numpy")
    timed = runner.run_threads(2, lambda r: train.run_rank(
        alloc, TINY, data, 4, 3, 1, rank=r, world=2, comm=NoAverage(host.rank(r))))
    m = dict(allocator="numpy", timed=timed, counted=timed, counted_steps=3)
    row = train.build_row("threads", m, 2, 4, TINY, 3, 1, ref_losses=ref)
    assert row["loss_rel_diff_max"] > 1e-6
    assert row["param_rank_diff_max"] > 1e-6
    assert not row["checks_passed"]


def test_train_step_without_comm_is_plain_training():
    data = load_corpus()
    model = GPT(TINY, seed=0)
    opt = AdamW(model.params)
    before = {k: v.copy() for k, v in model.params.items()}
    x, y = __import__("tapegpt", fromlist=["get_batch"]).get_batch(data, 2, TINY.block_size, 0)
    loss = train.train_step(model, opt, x, y)
    assert np.isfinite(float(loss))
    assert any(not np.array_equal(before[k], model.params[k]) for k in before)


# --- rows and ratios

def fake_measure(name, seconds, world=1, mallocs=(0,), counted_steps=10, reserved=(100,), requested=(80,)):
    timed = [dict(rank=r, device=r, seconds=seconds, host_seconds=seconds / 2, gpu_ms_per_step=150.0,
                  gc_seconds=0.01, gc_collections=2, device_mallocs=mallocs[r], util={r: 90.0 + r},
                  losses=[5.0, 4.0], param_rank_diff=0.0 if world > 1 else None,
                  peak_reserved=reserved[r], peak_requested=requested[r], n_params=123) for r in range(world)]
    return dict(allocator=name, timed=timed, counted=timed, counted_steps=counted_steps)


def test_build_row_formulas():
    cfg = train.make_config("small")
    m = fake_measure("xpool_k1", 2.0, world=2, mallocs=(3, 1), reserved=(110, 120), requested=(100, 100))
    row = train.build_row("threads", m, 2, 8, cfg, steps=10, warmup=2, ref_losses=[5.0, 4.0])
    assert row["tokens_per_s"] == pytest.approx(2 * 8 * cfg.block_size * 10 / 2.0)
    assert row["ms_per_step"] == pytest.approx(200.0)
    assert row["device_mallocs_per_step"] == pytest.approx(4 / (10 * 2))      # per GPU per step
    assert row["peak_reserved_bytes"] == 120 and row["peak_requested_bytes"] == 100
    assert row["reserved_over_requested"] == pytest.approx(1.2)
    assert row["gpu_util_mean"] == pytest.approx(90.5)
    assert row["loss_rel_diff_max"] == 0.0 and row["checks_passed"]
    assert row["count_steps"] == 10
    assert row["host_ms_per_step"] == pytest.approx(100.0) and row["gpu_ms_per_step"] == 150.0
    assert row["gpu_busy_ms_per_step"] == pytest.approx(200.0 * 0.905) and row["bound"] == "gpu"
    assert row["gc_ms_per_step"] == pytest.approx(1.0) and row["gc_collections"] == 2 and row["gc"]
    assert row["trial"] == 0 and set(row) == set(train.COLUMNS)


def test_step_bound():
    assert train.step_bound(95.0, 10.0, 100.0) == "gpu"
    assert train.step_bound(40.0, 99.0, 100.0) == "host"
    assert train.step_bound(math.nan, 90.0, 100.0) == "host"       # no NVML: the thread's CPU time decides
    assert train.step_bound(math.nan, 30.0, 100.0) == "gpu"
    assert train.step_bound(math.nan, math.nan, 100.0) == ""


def test_gc_pauses_are_timed():
    with train.GcPauses() as p:
        gc.collect()
    assert p.collections == 1 and p.seconds > 0
    gc.collect()
    assert p.collections == 1                                      # no longer listening


def test_ratios_pair_each_trial_with_its_own_reference():
    rows = []
    for trial, (raw, pool) in enumerate([(3.0, 1.0), (6.0, 1.5)]):
        for name, secs in (("raw", raw), ("cupy_pool", pool)):
            m = fake_measure(name, secs)
            rows.append(train.build_row("single", m, 1, 32, TINY, 10, 2, trial=trial))
    df = train.frame(rows).set_index(["allocator", "trial"])
    assert df.loc[("cupy_pool", 0), "speedup_vs_raw"] == pytest.approx(3.0)
    assert df.loc[("cupy_pool", 1), "speedup_vs_raw"] == pytest.approx(4.0)


def test_build_row_without_counters_gives_nan():
    m = fake_measure("cupy_async", 1.0, mallocs=(None,), reserved=(None,), requested=(None,))
    row = train.build_row("single", m, 1, 4, TINY, 5, 1)
    assert math.isnan(row["device_mallocs_per_step"]) and math.isnan(row["reserved_over_requested"])
    assert math.isnan(row["loss_rel_diff_max"]) and row["checks_passed"]
    m = dict(fake_measure("raw", 1.0), counted=None, counted_steps=0)       # a later trial: not counted
    row = train.build_row("single", m, 1, 4, TINY, 5, 1, trial=3)
    assert math.isnan(row["device_mallocs_per_step"]) and row["count_steps"] == 0 and row["trial"] == 3


def test_frame_ratios_and_column_order():
    rows = []
    for mode, world, name, secs in [("threads", 1, "raw", 3.0), ("threads", 1, "cupy_pool", 1.0),
                                    ("threads", 1, "xpool_k1", 0.9), ("threads", 2, "xpool_k1", 0.5),
                                    ("threads", 2, "raw", 3.0), ("processes", 2, "cupy_pool", 0.5)]:
        m = fake_measure(name, secs, world=world, mallocs=(0,) * world, reserved=(1,) * world,
                         requested=(1,) * world)
        rows.append({**train.build_row(mode, m, world, 32, TINY, 10, 2), "gpu": "fake", "commit": "abc"})
    df = train.frame(rows)
    assert list(df.columns[:len(train.COLUMNS)]) == train.COLUMNS and "gpu" in df.columns
    get = df.set_index(["mode", "allocator", "world"])
    assert get.loc[("threads", "xpool_k1", 2), "speedup"] == pytest.approx(2 * 0.9 / 0.5)
    assert get.loc[("threads", "xpool_k1", 1), "speedup_vs_raw"] == pytest.approx(3.0 / 0.9)
    assert get.loc[("threads", "xpool_k1", 1), "ratio_vs_cupy_pool"] == pytest.approx(1.0 / 0.9)
    assert math.isnan(get.loc[("processes", "cupy_pool", 2), "speedup"])      # no world-1 row
    assert math.isnan(get.loc[("threads", "xpool_k1", 2), "ratio_vs_cupy_pool"])


def test_configs():
    assert train.make_config(None).n_layer == 12 and train.make_config("small").n_layer == 4
    assert train.make_config({"n_layer": 1, "n_head": 1, "n_embd": 8, "n_ffn": 8}).n_layer == 1
    with pytest.raises(ValueError):
        train.make_config("huge")


# --- counters and the sampler

def test_unknown_allocator_is_named():
    with pytest.raises(ValueError, match="known"):
        allocators.make("jemalloc")


def test_raw_counter_sees_free_through_owner_death():
    live = allocators._Live()
    live._allocated(0, 100)
    owner = allocators._Freed(live, 0, 100, memptr=None)
    live._allocated(0, 50)
    del owner
    gc.collect()
    assert live.mallocs[0] == 2 and live.live[0] == 50 and live.peak[0] == 150


def test_cupy_hook_counts_device_mallocs_and_requested_bytes():
    pytest.importorskip("cupy")
    hook = allocators._hook_class()()
    hook.alloc_preprocess(device_id=0, mem_size=1024)
    hook.malloc_postprocess(device_id=0, size=1000, mem_size=1024, mem_ptr=1, pmem_id=11)
    hook.malloc_postprocess(device_id=0, size=10, mem_size=512, mem_ptr=2, pmem_id=12)
    hook.free_postprocess(device_id=0, mem_size=1024, mem_ptr=1, pmem_id=11)
    hook.malloc_postprocess(device_id=0, size=20, mem_size=512, mem_ptr=3, pmem_id=13)
    assert hook.live.mallocs[0] == 1
    assert hook.live.peak[0] == 1010 and hook.live.live[0] == 30


def test_window_counts_and_times():
    counter = iter([5, 9])
    calls = []
    w = train.Window(lambda: next(counter), lambda: calls.append("sync"), lambda: calls.append("barrier"))
    with w:
        pass
    assert w.device_mallocs == 4 and w.seconds >= 0 and calls == ["sync", "barrier", "sync", "barrier"]


def test_window_stopped_by_an_error_stops_its_sampler():
    s = nvml.UtilSampler([0], interval=0.001, read=lambda: {0: 50.0})
    w = train.Window(lambda: 0, lambda: None, sampler=s)
    with pytest.raises(MemoryError):
        with w:
            raise MemoryError("out of memory")
    assert s._thread is None and math.isnan(w.seconds) and w.util == {}


def test_sampler_means_per_device():
    readings = iter([{0: 50.0, 1: 10.0}, {0: 100.0, 1: 30.0}] + [{0: 75.0, 1: 20.0}] * 1000)
    s = nvml.UtilSampler([0, 1], interval=0.001, read=lambda: next(readings))
    with s:
        threading.Event().wait(0.02)
    assert set(s.means) == {0, 1} and 50.0 <= s.means[0] <= 100.0 and 10.0 <= s.means[1] <= 30.0


def test_sampler_without_nvml_gives_nan():
    s = nvml.UtilSampler([0], read=None)
    s._read = None
    s.start()
    assert math.isnan(s.stop()[0])


# --- the CLI

def test_cpu_smoke_single_writes_the_schema(tmp_path):
    out = tmp_path / "single.csv"
    assert cli.main(["single", "--cpu-smoke", "--no-progress", "--out", str(out)]) == 0
    df = pd.read_csv(out)
    assert list(df.columns[:len(train.COLUMNS)]) == train.COLUMNS
    assert set(df["mode"]) == {"single"} and set(df["world"]) == {1} and df["checks_passed"].all()
    for col in ("gpu", "driver", "cuda", "cupy", "commit", "date"):
        assert col in df.columns


def test_cpu_smoke_ddp_has_the_same_schema(tmp_path):
    out = tmp_path / "ddp.csv"
    assert cli.main(["ddp", "--cpu-smoke", "--no-progress", "--out", str(out)]) == 0
    df = pd.read_csv(out)
    assert list(df.columns[:len(train.COLUMNS)]) == train.COLUMNS
    assert sorted(df["world"]) == [1, 1, 2, 2] and df["checks_passed"].all()
    assert sorted(df["trial"]) == [0, 0, 1, 1]
    assert (df["loss_rel_diff_max"] < 1e-12).all()
    assert (df.loc[df.world == 1, "speedup"] == 1.0).all()


def test_cpu_smoke_sweep(tmp_path):
    out = tmp_path / "sweep.csv"
    assert cli.main(["sweep", "--cpu-smoke", "--no-progress", "--out", str(out)]) == 0
    df = pd.read_csv(out)
    assert list(df.columns[:len(train.COLUMNS)]) == train.COLUMNS
    assert len(df) == 2 * 2 * 2 and set(df["batch"]) == {2, 4} and df["checks_passed"].all()
    # interleaved: trial 0 of every (batch, world) comes before any trial 1
    assert list(df["trial"]) == [0, 0, 0, 0, 1, 1, 1, 1]


def test_sweep_steps_shrink_with_batch():
    from xlab.experiments import sweep
    steps = [sweep.steps_for(b) for b in sweep.BATCHES]
    assert steps == sorted(steps, reverse=True) and min(steps) >= 2
    assert sweep.steps_for(128, 0.1) == 2

def test_quick_and_smoke_flags():
    a = cli.parse(["single", "--quick"])
    assert (a.steps, a.warmup, a.trials) == (3, 2, 2)
    assert cli.parse(["single"]).trials == 5 and cli.parse(["ddp"]).steps == 6
    with pytest.raises(SystemExit):
        cli.parse(["single", "--trials", "0"])
    b = cli.parse(["ddp", "--cpu-smoke"])
    assert b.config == "tiny" and b.out is None


def test_without_gpu_the_cli_says_so(capsys):
    from xlab.provenance import has_gpu
    if has_gpu():
        pytest.skip("a GPU is visible")
    assert cli.main(["single", "--quick", "--no-progress"]) == 2
    assert cli.main(["ddp", "--quick", "--no-progress"]) == 2
    assert "needs" in capsys.readouterr().err


# --- quick real runs

@pytest.mark.gpu
def test_single_gpu_quick(tmp_path):
    from xlab.experiments import single_gpu
    df = single_gpu.run(allocators=("raw", "cupy_pool", "xpool_k1"), batches=(4,), steps=3, warmup=2,
                        count_steps=2, config="small", out=tmp_path / "s.csv", progress=False, trials=2)
    assert len(df) == 6 and (df["host_ms_per_step"] > 0).all() and (df["gpu_ms_per_step"] > 0).all()
    assert set(df["bound"]) <= {"host", "gpu"}
    by = df[df["trial"] == 0].set_index("allocator")
    assert by.loc["xpool_k1", "device_mallocs_per_step"] == 0
    assert by.loc["raw", "device_mallocs_per_step"] > 0
    assert by.loc["raw", "reserved_over_requested"] == 1.0
    assert by.loc["cupy_pool", "peak_requested_bytes"] > 0
    assert df["checks_passed"].all()


@pytest.fixture
def short_hang_limit(monkeypatch):
    """A rank that hangs (a deadlock inside NCCL) fails the test in two minutes instead of the suite's stage."""
    monkeypatch.setattr(runner, "RANK_TIMEOUT", 120.0)
    monkeypatch.setattr(ddp, "BARRIER_TIMEOUT", 120)


@pytest.mark.multigpu
@pytest.mark.parametrize("mode", ["threads", "processes"])
def test_ddp_quick(tmp_path, mode, short_hang_limit):
    df = ddp.run(modes=(mode,), worlds=(1, 2), allocators=("raw", "xpool_k1"), batch=4, steps=3, warmup=2,
                 count_steps=2, config="small", out=tmp_path / "d.csv", progress=False, trials=2)
    assert len(df) == 8 and df["checks_passed"].all()
    two = df[df["world"] == 2].set_index("allocator")
    if mode == "threads":        # raw keeps the fence in the timed steps, a warm pool drops it
        assert two.loc["raw", "fenced"].all() and not two.loc["xpool_k1", "fenced"].any()


@pytest.mark.multigpu
def test_sweep_quick(tmp_path, short_hang_limit):
    from xlab.experiments import sweep
    df = sweep.run(allocators=("raw", "xpool_k1"), batches=(4, 8), warmup=2, steps_scale=0.3, config="small",
                   out=tmp_path / "b.csv", progress=False, trials=2)
    assert len(df) == 2 * 2 * 2 * 2 and df["checks_passed"].all()
    assert df["speedup"].notna().all()


def test_adamw_form_is_recorded_and_foreach_trains_the_same(tmp_path, monkeypatch):
    monkeypatch.delenv(train.ADAMW_ENV, raising=False)
    assert train.adamw_form() == "foreach"                # the flat-buffer AdamW is the experiments' default
    monkeypatch.setenv(train.ADAMW_ENV, "per_param")    # so the variable main() sets is undone afterwards
    rows = {}
    for form in ("per_param", "foreach"):
        out = tmp_path / f"{form}.csv"
        assert cli.main(["single", "--cpu-smoke", "--no-progress", "--adamw", form, "--out", str(out)]) == 0
        rows[form] = pd.read_csv(out)
        assert set(rows[form]["adamw"]) == {form}
    # the tiny config is float64 and foreach is bit-identical: the same losses to the last bit
    assert rows["foreach"]["loss_last"].tolist() == rows["per_param"]["loss_last"].tolist()
    monkeypatch.setenv(train.ADAMW_ENV, "fused")
    with pytest.raises(ValueError, match="XPOOL_ADAMW"):
        train.adamw_form()


# --- registry names (the pool itself needs a GPU: its arguments are checked here)

def test_registry_names_map_to_pool_arguments(monkeypatch):
    made = []

    class FakePool:
        def __init__(self, **kwargs):
            made.append(kwargs)
            self.debug = kwargs.get("debug")

    monkeypatch.setattr("xpool.MemoryPool", FakePool)
    names = ["xpool", "xpool_segments", "xpool_seed", "xpool_k4", "xpool_k1_debug", "xpool_seed_debug"]
    got = {n: allocators.make(n) for n in names}
    assert [g.name for g in got.values()] == names
    assert made == [dict(debug=False, scheme=allocators.DEFAULT_SCHEME), dict(debug=False, scheme="segments"),
                    dict(debug=False, classes_per_doubling=1, scheme="seed"),
                    dict(debug=False, classes_per_doubling=4, scheme="seed"),
                    dict(debug="raise", classes_per_doubling=1, scheme="seed"),
                    dict(debug="raise", classes_per_doubling=1, scheme="seed")]
    assert all(g.free_counting and g.can_capture and not g.device_calls_when_warm for g in got.values())
    assert allocators.arm("raw").device_calls_when_warm and allocators.arm("cupy_async").device_calls_when_warm
    with pytest.raises(ValueError, match="known"):
        allocators.make("xpool_k")


def test_the_arms_table_is_the_one_place_names_are_known():
    """Every arm named by a committed CSV is in the table (after the legacy renames), with a label and a colour;
    a bad name is refused at the command line, naming it; an arm that is not a CuPy allocator cannot be made."""
    import argparse
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[2]
    for path in (root / "data").rglob("*.csv"):
        df = allocators.canonical(pd.read_csv(path))
        for col in ("allocator", "arm"):
            for name in df.get(col, pd.Series(dtype=str)).dropna().unique():
                a = allocators.arm(name)
                assert a.label and a.color.startswith("#"), (path, name)
    assert allocators.parse("xpool") == ("xpool",) and allocators.parse(["raw", "xpool_k8_graph"])
    with pytest.raises(argparse.ArgumentTypeError, match="unknown allocator 'jemallok'"):
        allocators.arg("jemallok")
    with pytest.raises(ValueError, match="not an allocator the lab installs"):
        allocators.make("cupy_pool_model")
    legacy = pd.DataFrame(dict(allocator=["torch", "raw"], bench="alloc"))
    assert list(allocators.canonical(legacy)["allocator"]) == ["cupy_torch", "raw"]
    assert allocators.ordered(["xpool_graph", "zz", "xpool", "raw"]) == ["raw", "xpool", "xpool_graph", "zz"]


def test_an_interrupted_run_is_finished_not_restarted(tmp_path, monkeypatch):
    """--resume keeps what an earlier run of this commit and settings wrote and measures only the rest."""
    from xlab.experiments import single_gpu, sweep
    out = tmp_path / "s.csv"
    kw = dict(config="tiny", batches=(2,), steps=2, warmup=1, out=out, cpu=True, progress=False, trials=3)
    full = single_gpu.run(**kw)
    full.iloc[:1].to_csv(out, index=False)                    # stopped after trial 0
    calls = []
    real = runner.run_arm
    monkeypatch.setattr(runner, "run_arm", lambda *a, **k: calls.append(1) or real(*a, **k))
    again = single_gpu.run(**kw, resume=True)
    assert len(calls) == 2 and sorted(again["trial"]) == [0, 1, 2]
    assert again.loc[again.trial == 0, "tokens_per_s"].item() == full.loc[full.trial == 0, "tokens_per_s"].item()
    pd.read_csv(out).assign(commit="another").to_csv(out, index=False)
    calls.clear()
    single_gpu.run(**kw, resume=True)                          # another commit's rows are never mixed in
    assert len(calls) == 3
    out2 = tmp_path / "w.csv"
    kw2 = dict(config="tiny", batches=(2,), steps_scale=0.3, warmup=1, out=out2, cpu=True, progress=False, trials=2)
    sweep.run(**kw2)
    calls.clear()
    assert len(sweep.run(**kw2, resume=True)) == 4 and calls == []
