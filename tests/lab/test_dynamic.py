"""The dynamic-shape benchmark (xlab.bench.dynamic) without a GPU: names, the order of the arms, rows and their
arithmetic, resuming, each arm's device-call count over stand-ins, the workloads on NumPy and PyTorch's CPU. The
real paths run on a GPU (marked)."""
import math
import os
import sys
import types

import numpy as np
import pandas as pd
import pytest

import xpool
import xpool_twin
from xlab import allocators as registry, summaries
from xlab.bench import dynamic, dynamic_workloads as wl
from xlab.experiments.train import Window


def _window():
    return Window(lambda: None, lambda: None)


# --- names and order

def test_unknown_workloads_and_arms_are_named():
    with pytest.raises(ValueError, match="gpt_b9.*known: cupy_mix"):
        dynamic.resolve(["cupy_mix", "gpt_b9"])
    with pytest.raises(ValueError, match=r"unknown arm\(s\) cupy_poool, rmm"):
        dynamic.resolve(["cupy_mix"], ["cupy_poool", "xpool", "rmm"])
    with pytest.raises(ValueError, match="no arm of torch runs the workloads cupy_mix"):
        dynamic.resolve(["cupy_mix"], ["torch"])


def test_xpool_arms_are_xpools_schemes_and_missing_ones_are_skipped(capsys):
    import xpool
    assert dynamic.xpool_arms() == tuple(f"xpool_{s}" for s in xpool.settings.SCHEMES)
    _, per = dynamic.resolve(["cupy_mix", "torch_fixed"], ["xpool_nosuch", "xpool", "cupy_pool", "torch"])
    assert "skipping xpool_nosuch: this xpool has no such scheme" in capsys.readouterr().out
    assert per == {"cupy": ("xpool", "cupy_pool"), "torch": ("xpool", "torch")}


def test_default_arms_are_the_peers_and_every_scheme():
    _, per = dynamic.resolve()
    assert per["cupy"] == dynamic.PEERS["cupy"] + dynamic.xpool_arms()
    assert per["torch"] == dynamic.PEERS["torch"] + dynamic.xpool_arms()


def test_each_trial_runs_every_arm_once_in_a_rotated_order():
    per = {"cupy": ("a", "b", "c"), "torch": ("d",)}
    opts = dict(steps=None, warmup=None, seed=0)
    jobs, wanted = dynamic.plan(5, ["cupy_mix", "gpt_b4", "torch_fixed"], per, opts)
    assert len(jobs) == 5 * 4 and len(wanted) == 5 * (3 * 2 + 1)
    orders = {t: [(f, a) for f, a, _, trial, _ in jobs if trial == t] for t in range(5)}
    assert orders[0] == [("cupy", "a"), ("cupy", "b"), ("cupy", "c"), ("torch", "d")]
    for t in range(5):
        assert orders[t] == orders[0][t % 4:] + orders[0][:t % 4]
        assert [p for *_, trial, p in jobs if trial == t] == [0, 1, 2, 3]
    assert [orders[t][0][1] for t in range(5)] == ["a", "b", "c", "d", "a"]      # each arm goes first in turn
    assert {tuple(w) for f, _, w, *_ in jobs if f == "cupy"} == {("cupy_mix", "gpt_b4")}


def test_plan_leaves_out_what_is_done():
    per, opts = {"cupy": ("a", "b")}, dict(steps=7, warmup=None, seed=3)
    jobs, wanted = dynamic.plan(2, ["cupy_mix", "gpt_b4"], per, opts, commit="c1")
    done = {k for k in wanted if k[0] == "0" or k[1:3] == ("gpt_b4", "b")}
    jobs2, wanted2 = dynamic.plan(2, ["cupy_mix", "gpt_b4"], per, opts, done, commit="c1")
    assert wanted2 == wanted
    assert [(a, w, t) for _, a, w, t, _ in jobs2] == [("b", ["cupy_mix"], 1), ("a", ["cupy_mix", "gpt_b4"], 1)]
    assert ("0", "cupy_mix", "a", "7", "30", "3", "no", "c1") in wanted     # steps overridden, the workload's warm-up
    pinned, _ = dynamic.plan(2, ["cupy_mix"], per, {**opts, "cpus": {3, 1}}, wanted, commit="c1")
    assert len(pinned) == 4                                              # pinned: another measurement
    assert dynamic.pinned({**opts, "cpus": {3, 1}}) == "1,3" and dynamic.pinned(opts) == "no"


def test_each_trial_is_a_realization_of_its_own_seed_unless_asked_for_one():
    """Note [Trials are realizations]: trial t draws from seed + t, every arm of it alike; same_seed: all on seed."""
    per, opts = {"cupy": ("a", "b"), "torch": ("d",)}, dict(steps=None, warmup=None, seed=10)
    _, wanted = dynamic.plan(3, ["cupy_mix", "torch_varlen"], per, opts)
    seeds = {(k[0], k[2]): k[5] for k in wanted}
    assert seeds == {(str(t), a): str(10 + t) for t in range(3) for a in ("a", "b", "d")}
    _, same = dynamic.plan(3, ["cupy_mix"], per, {**opts, "same_seed": True})
    assert {k[5] for k in same} == {"10"}
    assert dynamic.for_trial(opts, 4)["seed"] == 14 and opts["seed"] == 10        # the run's options untouched
    assert dynamic.for_trial({**opts, "same_seed": True}, 4)["seed"] == 10


def test_rows_carry_their_trials_seed_and_a_bad_seed_is_named():
    df = dynamic.run(["cupy_mix"], trials=2, steps=3, warmup=1, out=None, cpu=True, progress=False, seed=5)
    assert dict(zip(df.trial, df.seed)) == {0: 5, 1: 6}
    same = dynamic.run(["cupy_mix"], trials=2, steps=3, warmup=1, out=None, cpu=True, progress=False, seed=5,
                       same_seed=True)
    assert list(same.seed) == [5, 5]
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="seed"):
            dynamic.run(cpu=True, out=None, seed=bad)


# --- rows and device calls

def _run_dict(**kw):
    d = dict(batch=4, shape="T 256", seconds=0.5, host_seconds=0.45, calls=None, gc_seconds=0.01, reserved=None,
             requested=None, steady=None)
    d.update(kw)
    return d


def test_row_takes_bytes_and_calls_from_the_run_that_counted_them():
    opts = dict(steps=10, warmup=2, seed=0)
    timed = _run_dict(reserved=1000)
    counted = _run_dict(seconds=9.0, calls=30, reserved=999, requested=800)
    row = dynamic.build_row(2, 1, "gpt_b4", "cupy_pool", timed, counted, 0, opts)
    assert row["peak_reserved_bytes"] == 1000 and row["peak_requested_bytes"] == 800
    assert row["reserved_over_requested"] == 1.25
    assert row["device_calls"] == 30 and row["device_calls_per_step"] == 3.0
    assert row["ms_per_step"] == 50.0 and row["gc_ms_per_step"] == 1.0          # time from the timed run
    assert row["counted_in"] == "counting run" and row["dynamic"] is False and row["framework"] == "cupy"
    alone = dynamic.build_row(0, 0, "cupy_mix", "xpool", counted, counted, 0, opts)
    assert alone["counted_in"] == "timed run" and alone["ms_per_step"] == 900.0 and alone["dynamic"] is True
    blank = dynamic.build_row(0, 0, "cupy_mix", "numpy", timed, timed, 0, opts)
    assert math.isnan(blank["device_calls_per_step"]) and math.isnan(blank["reserved_over_requested"])
    assert set(dynamic.COLUMNS) | {"release_on_miss"} == set(row)
    assert row["host_ms_per_step"] == 45.0 and row["bound"] == "" and row["pinned"] == "no"   # no GPU: no bound


def test_row_says_what_bounds_the_step_from_the_threads_cpu_time():
    """A GPU row of a CuPy workload is host-bound when the thread was busy >= 80% of the window (train.step_bound),
    else gpu-bound; a PyTorch row says nothing (its backward runs on the autograd thread)."""
    opts = dict(steps=10, warmup=2, seed=0, gpu=True)
    busy = dynamic.build_row(0, 0, "gpt_b4", "cupy_pool", _run_dict(host_seconds=0.45), _run_dict(), 0, opts)
    idle = dynamic.build_row(0, 0, "gpt_b4", "cupy_pool", _run_dict(host_seconds=0.2), _run_dict(), 0, opts)
    assert (busy["bound"], idle["bound"]) == ("host", "gpu") and idle["host_ms_per_step"] == 20.0
    torch_row = dynamic.build_row(0, 0, "torch_fixed", "torch", _run_dict(host_seconds=0.2), _run_dict(), 0, opts)
    assert torch_row["bound"] == "" and torch_row["host_ms_per_step"] == 20.0    # backward is on another thread
    assert math.isnan(torch_row["gpu_util_mean"])


def test_row_says_what_bounds_the_step_from_nvml_where_it_was_sampled():
    """With NVML's utilisation over the timed window a row's bound is NVML's (train.step_bound: gpu at >= 80% busy),
    a PyTorch row's too, whatever the main thread's time says; a NaN reading falls back as without NVML."""
    opts = dict(steps=10, warmup=2, seed=0, gpu=True)

    def row(workload, util, host_seconds=0.45):
        return dynamic.build_row(0, 0, workload, "torch" if workload.startswith("torch") else "cupy_pool",
                                 _run_dict(host_seconds=host_seconds, gpu_util=util), _run_dict(), 0, opts)
    assert (row("torch_fixed", 41.5)["bound"], row("torch_fixed", 97.0, 0.1)["bound"]) == ("host", "gpu")
    assert row("torch_fixed", 41.5)["gpu_util_mean"] == 41.5
    assert row("gpt_b4", 97.0)["bound"] == "gpu"                 # NVML over the thread's 90% busy
    assert row("gpt_b4", math.nan)["bound"] == "host" and row("torch_fixed", math.nan)["bound"] == ""
    on_cpu = dynamic.build_row(0, 0, "torch_fixed", "torch", _run_dict(gpu_util=50.0), _run_dict(), 0,
                               dict(opts, gpu=False))
    assert on_cpu["bound"] == ""


class _FakeSampler:
    made = []

    def __init__(self, devices):
        self.devices = devices
        _FakeSampler.made.append(self)

    def start(self):
        self.started = True
        return self

    def stop(self):
        return {0: 63.0}


class _FakeAlloc:
    def __init__(self):
        import contextlib
        self.tracking = contextlib.nullcontext

    def sample(self, device):
        pass

    def device_mallocs(self, device):
        return 0

    def peak_reserved(self, device):
        return 10

    def peak_requested(self, device):
        return 8


def test_measure_samples_nvml_over_the_timed_run_only(monkeypatch):
    """On a GPU the timed run's window carries an NVML sampler over device 0 (its mean is the row's gpu_util_mean);
    a counting run, whose probes cost time, has none; on a CPU neither has."""
    def fn(steps, warmup, seed, window, gpu, small, after_step):
        with window:
            after_step()
            window.dispatched()
        return dict(batch=1, shape="x")
    monkeypatch.setattr(dynamic, "UtilSampler", _FakeSampler)
    monkeypatch.setitem(dynamic.WORKLOADS, "gpt_b4", dynamic.Workload("cupy", False, fn, 2, 1))
    _FakeSampler.made.clear()
    opts = dict(steps=None, warmup=None, seed=0, gpu=True, small=True)
    timed = dynamic.measure(_FakeAlloc(), "gpt_b4", opts, lambda: None, probe=False, timed=True)
    counting = dynamic.measure(_FakeAlloc(), "gpt_b4", opts, lambda: None, probe=True, timed=False)
    on_cpu = dynamic.measure(_FakeAlloc(), "gpt_b4", dict(opts, gpu=False), lambda: None, probe=False)
    assert timed["gpu_util"] == 63.0 and math.isnan(counting["gpu_util"]) and math.isnan(on_cpu["gpu_util"])
    assert len(_FakeSampler.made) == 1 and _FakeSampler.made[0].devices == [0] and _FakeSampler.made[0].started


def test_steady_state_starts_after_the_demands_last_new_high():
    # (calls so far, peak requested so far) after each of 8 steps, 2 of them warm-up; the demand last rises at step 4
    probes = [(3, 100), (4, 100), (5, 120), (5, 120), (7, 150), (7, 150), (8, 150), (8, 150)]
    assert dynamic.steady_state(probes, 2) == dict(demand_peak_step=4, steady_steps=3, device_calls_steady=1)
    flat = [(3, 100)] + [(3 + i // 3, 100) for i in range(1, 8)]       # peak at step 0: every timed step counts
    assert dynamic.steady_state(flat, 2) == dict(demand_peak_step=0, steady_steps=6, device_calls_steady=2)
    rising = [(i, 100 + i) for i in range(5)]                          # no step after the last new high
    assert dynamic.steady_state(rising, 1)["steady_steps"] == 0
    assert math.isnan(dynamic.steady_state(rising, 1)["device_calls_steady"])
    for uncounted in ([], [(None, 100), (1, 100)], [(1, None), (1, None)]):
        assert all(math.isnan(v) for v in dynamic.steady_state(uncounted, 1).values())


def test_row_gives_device_calls_per_steady_step():
    opts = dict(steps=6, warmup=2, seed=0)
    probes = [(3, 100), (4, 100), (5, 120), (5, 120), (7, 150), (7, 150), (8, 150), (8, 150)]
    counted = _run_dict(calls=4, reserved=200, requested=150, steady=dynamic.steady_state(probes, 2))
    row = dynamic.build_row(0, 0, "cupy_mix", "xpool", counted, counted, 0, opts)
    assert row["device_calls_per_step"] == 4 / 6 and row["device_calls_per_steady_step"] == 1 / 3
    assert (row["steady_steps"], row["demand_peak_step"], row["device_calls_steady"]) == (3, 4, 1)
    rising = counted | dict(steady=dynamic.steady_state([(i, 100 + i) for i in range(8)], 2))
    none = dynamic.build_row(0, 0, "cupy_mix", "xpool", rising, rising, 0, opts)
    assert math.isnan(none["device_calls_per_steady_step"])


def test_xpool_device_calls_are_its_mallocs_and_frees():
    alloc = object.__new__(registry.XPool)
    alloc.pool = xpool.Pool(xpool_twin.HostBackend())
    blocks = [alloc.pool.allocate(n) for n in (1000, 5 << 20, 300_000, 40 << 20)]
    del blocks
    alloc.pool.empty_cache()
    backend = alloc.pool._backend
    assert backend.frees > 0
    assert dynamic.device_calls(alloc) == backend.mallocs + backend.frees


def test_torch_device_calls_are_num_device_alloc_and_free():
    alloc = object.__new__(registry.CupyTorch)
    stats = {"num_device_alloc": 7, "num_device_free": 3, "segment.all.allocated": 99}
    alloc.torch = types.SimpleNamespace(cuda=types.SimpleNamespace(memory_stats=lambda d: stats))
    assert dynamic.device_calls(alloc) == 10


@pytest.mark.parametrize("arm, expandable", [("torch", True), ("torch_expandable", False),
                                             ("cupy_torch_expandable", False)])
def test_an_arm_of_pytorchs_allocator_whose_setting_did_not_take_fails(arm, expandable):
    """The segments PyTorch made must be expandable exactly when the arm says so (cupy_torch_expandable too: PyTorch's
    expandable segments handing CuPy its blocks), or the arm measured the other allocator."""
    alloc = object.__new__(registry.allocator_class(arm))
    alloc.torch = types.SimpleNamespace(cuda=types.SimpleNamespace(
        memory_snapshot=lambda: [{"is_expandable": expandable}, {"is_expandable": expandable}]))
    dynamic.check_torch_setting(alloc, arm, gpu=False)          # nothing to ask on a CPU
    with pytest.raises(RuntimeError, match=f"arm '{arm}' ran with expandable segments \\[{expandable}\\]"):
        dynamic.check_torch_setting(alloc, arm, gpu=True)
    alloc.torch.cuda.memory_snapshot = lambda: [{"is_expandable": not expandable}]
    dynamic.check_torch_setting(alloc, arm, gpu=True)           # the setting took


def test_pytorchs_expandable_segments_serve_the_cupy_workloads_too():
    assert "cupy_torch_expandable" in dynamic.PEERS["cupy"] and "torch_expandable" in dynamic.PEERS["torch"]
    assert registry.allocator_class("cupy_torch_expandable") is registry.TorchExpandable


def test_rmm_pool_counts_its_upstream(monkeypatch):
    class Stats:
        def __init__(self, upstream):
            self.upstream, self.allocation_counts = upstream, None

    current = ["default"]
    mr = types.SimpleNamespace(StatisticsResourceAdaptor=Stats, CudaMemoryResource=lambda: "cuda",
                               PoolMemoryResource=lambda up, initial_pool_size: ("pool", up, initial_pool_size),
                               get_current_device_resource=lambda: current[0],
                               set_current_device_resource=lambda r: current.__setitem__(0, r))
    fake = types.ModuleType("rmm")
    fake.mr = mr
    allocs = types.ModuleType("rmm.allocators.cupy")
    allocs.rmm_cupy_allocator = lambda n: None
    monkeypatch.setitem(sys.modules, "rmm", fake)
    monkeypatch.setitem(sys.modules, "rmm.mr", mr)
    monkeypatch.setitem(sys.modules, "rmm.allocators", types.ModuleType("rmm.allocators"))
    monkeypatch.setitem(sys.modules, "rmm.allocators.cupy", allocs)
    monkeypatch.setattr(registry.Allocator, "install", lambda self, counting=False: None)
    monkeypatch.setattr(registry.Allocator, "uninstall", lambda self: None)
    alloc = registry.make("rmm_pool")
    assert alloc.upstream.upstream == "cuda" and alloc.pool == ("pool", alloc.upstream, 0)
    assert alloc.top.upstream is alloc.pool                       # requests are counted above the pool
    c = types.SimpleNamespace
    alloc.upstream.allocation_counts = c(total_count=5, current_count=3, peak_bytes=4096)
    alloc.top.allocation_counts = c(total_count=50, current_count=9, peak_bytes=3000)
    assert dynamic.device_calls(alloc) == 5 + 2 and alloc.device_mallocs(0) == 5
    assert (alloc.peak_reserved(0), alloc.peak_requested(0)) == (4096, 3000)
    alloc.install()
    assert current[0] is alloc.top
    alloc.uninstall()
    assert current[0] == "default"


# --- workloads on the CPU

def _record_lengths(monkeypatch):
    import tapegpt
    seen, get_batch = [], tapegpt.get_batch

    def spy(data, batch, T, step, **kw):
        seen.append((batch, T))
        return get_batch(data, batch, T, step, **kw)
    monkeypatch.setattr(tapegpt, "get_batch", spy)
    return seen


def test_lengths_start_longest_vary_and_repeat_from_the_seed():
    a = wl.lengths(40, 64, 512, seed=3)
    assert a == wl.lengths(40, 64, 512, seed=3) and a != wl.lengths(40, 64, 512, seed=4)
    assert a[0] == 512 and min(a) >= 64 and max(a[1:]) <= 512 and len(set(a)) > 20
    assert wl.lengths(5, 256, None, seed=3) == [256] * 5
    b = wl.lengths(40, 64, 512, seed=3, multiple=64)
    assert b[0] == 512 and set(b) <= set(range(64, 513, 64)) and len(set(b)) > 4


@pytest.mark.parametrize("workload, batch", [("torch_varlen", 2), ("gpt_varlen", 16)])
def test_varlen_workloads_train_at_the_seeded_lengths_on_the_cpu(monkeypatch, workload, batch):
    seen = _record_lengths(monkeypatch)
    spec, window = dynamic.WORKLOADS[workload], _window()
    info = spec.fn(4, 2, 5, window, gpu=False, small=True)
    assert window.seconds > 0 and info["batch"] == batch
    lo, hi, *by = (int(x) for x in info["shape"][2:].replace(" by ", "-").split("-"))
    assert [T for _, T in seen] == wl.lengths(6, lo, hi, seed=5, multiple=by[0] if by else 1)
    assert len({T for _, T in seen}) > 1
    assert {b for b, _ in seen} == {batch}


def test_torch_fixed_trains_at_one_length(monkeypatch):
    seen = _record_lengths(monkeypatch)
    info = dynamic.WORKLOADS["torch_fixed"].fn(3, 1, 0, _window(), gpu=False, small=True)
    assert {T for _, T in seen} == {16} and len(seen) == 4 and info["shape"] == "T 16"


def test_resnet_trains_at_the_seeded_sizes_on_the_cpu(monkeypatch):
    import torch
    seen, randn = [], torch.randn
    monkeypatch.setattr(torch, "randn", lambda *a, **k: seen.append(a) or randn(*a, **k))
    info = dynamic.WORKLOADS["resnet_varres"].fn(4, 2, 5, _window(), gpu=False, small=True)
    assert info == dict(batch=2, shape="16-28 px by 4")
    images = [a for a in seen if len(a) == 4 and a[1] == 3]
    assert [a[2] for a in images] == wl.lengths(6, 16, 28, seed=5, multiple=4) and all(a[2] == a[3] for a in images)
    seen.clear()
    assert dynamic.WORKLOADS["resnet_fixed"].fn(2, 1, 0, _window(), gpu=False, small=True)["shape"] == "28 px"
    assert {a[2:] for a in seen if len(a) == 4} == {(28, 28)}


def test_resnet_is_resnet18():
    from torch import nn
    m = wl._resnet18(nn, 64, (2, 2, 2, 2), 1000)
    assert sum(p.numel() for p in m.parameters()) == 11_689_512       # torchvision's resnet18, 1000 classes


def test_cupy_mix_on_numpy_keeps_results_and_repeats_from_the_seed(monkeypatch):
    made = []
    real_sort = np.sort
    monkeypatch.setattr(np, "sort", lambda a: made.append(a.size) or real_sort(a))
    for _ in range(2):
        wl.cupy_mix(20, 2, 1, _window(), gpu=False, small=True)
    half = len(made) // 2
    assert half > 3 and made[:half] == made[half:] and len(set(made)) > 3



def test_cupy_image_runs_its_seeded_crops_through_scipy_ndimage_on_numpy(monkeypatch):
    """scipy.ndimage mirrors cupyx.scipy.ndimage: on a CPU the same calls on the planned crops, step 0 the largest
    (an image and a volume), later steps drawn from the seed, the same on every run."""
    import scipy.ndimage as ndi
    seen, blur = [], ndi.gaussian_filter
    monkeypatch.setattr(ndi, "gaussian_filter", lambda a, s: seen.append((a.shape, s)) or blur(a, s))
    for _ in range(2):
        info = wl.cupy_image(8, 2, 3, _window(), gpu=False, small=True)
    plan = wl.image_plan(10, 3, small=True)
    assert len(seen) == 2 * sum(map(len, plan)) and seen[:len(seen) // 2] == seen[len(seen) // 2:]
    assert seen[0] == ((64, 64), 2.0) and seen[1] == ((16, 16, 16), 2.0)
    sides = {c["side"] for step in plan[1:] for c in step}
    assert len(sides) > 3 and min(sides) >= 16 and max(sides) <= 64
    assert any(c["volume"] for step in plan[1:] for c in step) and info["shape"].startswith("crops 16-64 px")


def test_cupy_fill_requests_its_plan_and_frees_each_array_after_its_last_step(monkeypatch):
    made = []
    xp = types.SimpleNamespace(empty=lambda n, dtype: made.append(n) or np.empty(n, dtype))
    monkeypatch.setattr(wl, "_xp", lambda gpu: xp)
    live = []
    wl.cupy_fill(6, 2, 4, _window(), gpu=False, small=True, after_step=lambda: live.append(sum(made)))
    plan = wl.fill_plan(8, 4, small=True)
    assert made == [b for step in plan for b, _ in step] and len(made) == 8 * wl.FILL_ARRAYS
    assert plan[0][0][0] == wl.FILL_SIZES[1] // 64 and all(wl.FILL_SIZES[0] // 64 <= b <= wl.FILL_SIZES[1] // 64
                                                            for step in plan for b, _ in step)
    assert all(i < last <= i + 32 for i, step in enumerate(plan) for _, last in step)
    assert wl.plan_peak([[(5, 1), (3, 2)], [(4, 1)], [(1, 2)]]) == 12      # 5 + 3 + 4; then 3 + 1
    assert wl.fill_plan(8, 4, scale=3)[5] == [(3 * b, last) for b, last in wl.fill_plan(8, 4)[5]]
    with pytest.raises(ValueError, match="scale must be a whole number"):
        wl.fill_plan(2, 0, scale=0)


@pytest.mark.parametrize("name", ["cupy_image", "cupy_fill"])
def test_the_new_cupy_workloads_are_dynamic_and_met_by_every_cupy_peer(name):
    spec = dynamic.WORKLOADS[name]
    assert (spec.framework, spec.dynamic, spec.held_out) == ("cupy", True, False)
    _, per = dynamic.resolve([name])
    assert {"cupy_pool", "cupy_async", "rmm_pool", "cupy_torch_expandable", "xpool_segments"} <= set(per["cupy"])

# --- the runner end to end (NumPy, CPU)

def test_run_writes_rows_with_provenance_and_resumes(tmp_path):
    out = tmp_path / "dyn.csv"
    kw = dict(workloads=["cupy_mix", "gpt_b4"], trials=2, steps=2, warmup=1, out=out, cpu=True, progress=False)
    df = dynamic.run(**kw)
    assert len(df) == 4 and not df.attrs["failed"]
    for col in dynamic.COLUMNS + ["gpu", "driver", "cuda", "cupy", "torch", "rmm", "commit", "date", "experiment"]:
        assert col in df, col
    assert sorted(zip(df.trial, df.workload)) == [(0, "cupy_mix"), (0, "gpt_b4"), (1, "cupy_mix"), (1, "gpt_b4")]
    assert (df.ms_per_step > 0).all() and (df.steps == 2).all()
    pd.read_csv(out).query("trial == 1").to_csv(out, index=False)          # as if trial 0 were never measured
    again = dynamic.run(**kw)
    assert len(again) == 4 and len(pd.read_csv(out)) == 4
    assert set(again[again.trial == 1].date) == set(df[df.trial == 1].date)     # trial 1 kept, not measured again
    pd.read_csv(out).drop(columns="gpu_util_mean").to_csv(out, index=False)   # rows from before NVML's column
    other = dynamic.run(**{**kw, "steps": 3})                                # other settings: measured anew
    assert len(other) == 4 and len(pd.read_csv(out)) == 8
    assert list(pd.read_csv(out).columns[:len(dynamic.COLUMNS)]) == dynamic.COLUMNS     # the new column in its place


def test_spawned_processes_work_too():
    """A spawned process imports everything itself (what a parent that started CUDA needs)."""
    df = dynamic.run(["gpt_b4"], trials=1, steps=1, warmup=1, out=None, cpu=True, start="spawn", progress=False)
    assert len(df) == 1 and df.start[0] == "spawn" and df.ms_per_step[0] > 0


def test_run_rejects_bad_counts():
    for bad in (dict(trials=0), dict(steps=0), dict(warmup=-1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            dynamic.run(cpu=True, out=None, **bad)


def test_pinned_arms_run_on_their_cpus_and_bad_cpus_are_named(tmp_path):
    """Note [Pinned arms]: every arm's process on the CPUs asked for, the rows saying so; a CPU this process may not
    use, or not a CPU, is refused before anything runs."""
    cpu = max(os.sched_getaffinity(0))
    df = dynamic.run(["cupy_mix"], trials=1, steps=2, warmup=1, out=tmp_path / "d.csv", cpu=True, progress=False,
                     cpus=[cpu])
    assert list(df.pinned) == [str(cpu)] and not df.attrs["failed"]
    for bad in ([], ["x"], [10 ** 6], [True], 7):
        with pytest.raises(ValueError, match="cpus"):
            dynamic.run(cpu=True, out=tmp_path / "bad.csv", cpus=bad)
    assert not (tmp_path / "bad.csv").exists()


def test_summary_from_rows():
    rng = np.random.default_rng(0)
    rows = [dict(trial=t, workload=w, allocator=a, reserved_over_requested=r, device_calls_per_step=c,
                 ms_per_step=ms * rng.uniform(0.99, 1.01))
            for t in range(5) for w in ("gpt_b4", "cupy_mix")
            for a, r, c, ms in (("xpool", 1.02, 0.0, 9.0), ("rmm_pool", 1.4, 0.0, 12.0), ("cupy_pool", 1.8, 0.0, 10.0))]
    s = summaries.dynamic_summary(pd.DataFrame(rows))
    assert list(zip(s.workload, s.allocator))[:3] == [("cupy_mix", "cupy_pool"), ("cupy_mix", "rmm_pool"),
                                                      ("cupy_mix", "xpool")]       # the workloads' and arms' order
    s = s.set_index(["workload", "allocator"])
    assert s.loc[("gpt_b4", "cupy_pool"), "ms vs the fastest peer"] == "the fastest peer"
    assert float(s.loc[("gpt_b4", "rmm_pool"), "ms vs the fastest peer"].split("×")[0]) == pytest.approx(1.2, abs=0.02)
    assert s.loc[("gpt_b4", "xpool"), "ms vs the fastest peer"].endswith("(cupy_pool)")
    assert s.loc[("cupy_mix", "xpool"), "reserved/requested"].startswith("1.020 [")


# --- GPU: the real arms, one trial of a few steps

@pytest.mark.gpu
def test_quick_run_on_the_gpu(tmp_path):
    """Every peer (RMM's where it is installed) and xpool, a few steps each; spawned, since this process (the
    conftest) has started CUDA and a fork could not use it."""
    import importlib.util
    pytest.importorskip("torch")
    arms = ["cupy_pool", "cupy_async", "xpool", "cupy_torch_expandable", "torch", "torch_expandable"] + ["rmm_pool"] * bool(
        importlib.util.find_spec("rmm"))
    df = dynamic.run(["cupy_mix", "gpt_b4", "torch_varlen", "resnet_varres"], arms, trials=1, steps=3, warmup=2,
                     out=tmp_path / "d.csv", start="spawn", progress=False)
    assert not df.attrs["failed"]
    assert len(df) == 2 * (len(arms) - 2) + 2 * 3     # xpool runs the PyTorch workloads too
    assert (df.peak_reserved_bytes >= df.peak_requested_bytes).all() and (df.peak_requested_bytes > 0).all()
    assert (df.device_calls_per_step >= 0).all() and (df.ms_per_step > 0).all()
    assert set(df[df.framework == "cupy"].counted_in) == {"counting run"}     # the probed run
    assert df.steady_steps.notna().all() and df.steady_steps.between(0, 3).all()    # every arm probed
    assert (df.device_calls_steady.fillna(0) <= df.device_calls).all()
    assert (df.device_calls_steady.isna() == (df.steady_steps == 0)).all()   # no steady step: no count
    assert (df[df.allocator == "cupy_async"].device_calls_per_step > 0).all()    # a call per request, warm or not
    assert (df[df.framework == "torch"].reserved_at_start_bytes == 0).all()
    assert df.gpu_util_mean.between(0, 100).all() and set(df.bound) <= {"host", "gpu"}   # NVML over every row



@pytest.mark.gpu
def test_the_new_cupy_workloads_on_the_gpu(tmp_path):
    """#49's cupy_image (cupyx.scipy.ndimage and cuFFT) and cupy_fill under CuPy's pools and xpool's two schemes, a
    few steps each: cupy_fill's peak requested is its plan's under xpool, which counts requests as made (the plan is
    its requests: nothing else allocates on the device)."""
    arms = ["cupy_pool", "cupy_async", "xpool_segments", "xpool_expandable"]
    df = dynamic.run(["cupy_image", "cupy_fill"], arms, trials=1, steps=3, warmup=2, out=tmp_path / "d.csv",
                     start="spawn", progress=False)
    assert not df.attrs["failed"] and len(df) == 2 * len(arms)
    assert (df.peak_reserved_bytes >= df.peak_requested_bytes).all() and (df.peak_requested_bytes > 0).all()
    fill = df[(df.workload == "cupy_fill") & df.allocator.str.startswith("xpool")]
    assert set(fill.peak_requested_bytes) == {wl.plan_peak(wl.fill_plan(5, int(fill.seed.iloc[0])))}

def test_record_dynamic_traces_writes_a_trace_per_seed_and_names_a_bad_seed(tmp_path, capsys):
    """python -m xlab.bench.dynamic_traces --seeds: seed 0 keeps the file name the replays read, seed s > 0 adds
    _s<s>, and each trace says its seed (on a CPU the pool sees no request: the code, not a trace)."""
    from xlab.bench import dynamic_traces as rec
    assert rec.main(["--workloads", "cupy_mix", "--cpu", "--seeds", "0,3", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["memory_trace_dyn_cupy_mix.csv.gz",
                                                          "memory_trace_dyn_cupy_mix_s3.csv.gz"]
    for bad in ("x", "-1", "1,,2"):
        with pytest.raises(SystemExit):
            rec.main(["--workloads", "cupy_mix", "--cpu", "--seeds", bad, "--out", str(tmp_path / "no")])
        assert "--seeds must be whole numbers" in capsys.readouterr().err
    assert not (tmp_path / "no").exists()


def test_cupy_fills_host_trace_is_its_plan_and_replays_like_it(tmp_path, capsys, monkeypatch):
    """--host: cupy_fill's trace is its plan (every planned request in its step, freed after its last one, the rest in
    the teardown), so its live peak is the plan's; cupy_image's is NumPy's stand-in, each free matching an alloc."""
    from xlab.bench import dynamic_traces as rec
    from xlab.bench.dynamic_scale import live_peak
    assert rec.main(["--host", "--workloads", "cupy_fill", "--seeds", "2", "--out", str(tmp_path)]) == 0
    tl = pd.read_csv(tmp_path / "memory_trace_host_dyn_cupy_fill_s2.csv.gz")
    spec = dynamic.WORKLOADS["cupy_fill"]
    plan = wl.fill_plan(spec.warmup + spec.steps, 2)
    allocs = tl[tl.event == "alloc_miss"]
    assert list(allocs.requested) == [b for step in plan for b, _ in step]
    assert list(allocs.step) == [i for i, step in enumerate(plan) for _ in step]
    assert live_peak(tl, 10 ** 6) == wl.plan_peak(plan) and (tl.event == "free").sum() == len(allocs)
    assert set(tl.requests_from) == {"plan"} and set(tl.seed) == {2} and tl.gpu.iloc[0].startswith("none")
    monkeypatch.setitem(rec.TESTS, "cupy_image", ("cupy", partial_image(), 3, 2))
    img = rec.host_trace("cupy_image", 1)
    made = img[img.event == "alloc_miss"]
    assert len(made) > 20 and set(img.step) <= set(range(6)) and set(img.requests_from) == {"numpy"}
    assert set(img.loc[img.event == "free", "ptr"]) <= set(made.ptr)
    with pytest.raises(ValueError, match="name must be one of cupy_fill, cupy_image"):
        rec.host_trace("cupy_mix")
    with pytest.raises(SystemExit):
        rec.main(["--host", "--workloads", "cupy_mix", "--out", str(tmp_path / "no")])
    assert "--host records cupy_fill, cupy_image" in capsys.readouterr().err


def partial_image():
    """cupy_image at its small sizes (the test's stand-in for the benchmark's, which take a minute on a CPU)."""
    def fn(steps, warmup, seed, window, gpu, small, after_step):
        return wl.cupy_image(steps, warmup, seed, window, gpu, True, after_step)
    return fn


def test_the_held_out_workloads_stay_out_of_the_default_set_and_have_targets_of_their_own():
    """The held-out PyTorch programs (other batches, lengths and image sizes than the release rules were chosen on:
    docs/decisions/0001) run only when named, write data/dynamic_heldout.csv, and are judged there."""
    from xlab import targets
    held = [w for w, spec in dynamic.WORKLOADS.items() if spec.held_out]
    assert held == ["torch_varlen_b32", "torch_fixed_b32", "resnet_varres_b64"]
    assert not set(held) & set(dynamic.resolve()[0]) and len(dynamic.resolve()[0]) == 10
    assert dynamic.resolve(held)[0] == held
    for w in held:
        t = targets.BY_KEY[f"dyn_ms_{w}"]
        assert t.kind == targets.DYN_HELD_OUT == "dynamic_heldout" and f"{w} (held out)" in t.text
    assert targets.BY_KEY["dyn_ms_torch_fixed"].kind == targets.DYN


def test_the_held_out_workloads_train_at_their_own_shapes_on_the_cpu(monkeypatch):
    seen = _record_lengths(monkeypatch)
    info = dynamic.WORKLOADS["torch_varlen_b32"].fn(4, 2, 3, _window(), gpu=False, small=True)
    assert info == dict(batch=2, shape="T 4-20 by 4")                   # lo 64, hi 320, by 32, small: / 16, by 4
    assert [T for _, T in seen] == wl.lengths(6, 4, 20, seed=3, multiple=4)
    assert dynamic.WORKLOADS["torch_fixed_b32"].fn(2, 1, 0, _window(), gpu=False, small=True)["shape"] == "T 8"
    assert dynamic.WORKLOADS["resnet_varres_b64"].fn(3, 1, 0, _window(), gpu=False, small=True) == dict(
        batch=2, shape="8-20 px by 4")


def test_summary_says_what_bounds_each_arm_with_nvmls_reading():
    """The summary's bound column: the rows' bounds, with NVML's GPU busy (median [95% interval]) where sampled; a
    mixed verdict shows both; nothing measured: n/a."""
    rows = []
    for t in range(5):
        rows += [dict(trial=t, workload="torch_fixed", allocator="torch", ms_per_step=10.0 + t, bound="host",
                      gpu_util_mean=20.0 + t),
                 dict(trial=t, workload="gpt_b32", allocator="cupy_pool", ms_per_step=30.0,
                      bound="gpu" if t else "host", gpu_util_mean=math.nan),
                 dict(trial=t, workload="gpt_b4", allocator="cupy_pool", ms_per_step=5.0, bound="",
                      gpu_util_mean=math.nan)]
    s = summaries.dynamic_summary(pd.DataFrame(rows)).set_index(["workload", "allocator"])["bound (GPU busy)"]
    assert s[("torch_fixed", "torch")] == "host (22% [20, 24])"
    assert s[("gpt_b32", "cupy_pool")] == "gpu/host" and s[("gpt_b4", "cupy_pool")] == "n/a"
