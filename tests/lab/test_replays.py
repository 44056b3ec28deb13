"""Replays of recorded request traces through the allocator over the tests' host twin (xlab.memory_study): the
H200's runs reproduced to the byte and the call, and what a reserve up front (xlab.reserve) does to them.  The
product's own rule is replayed by the product; the release rules it no longer has, by the lab's research build
(xlab.research).  Moved here from the allocator's tests, which import no lab code."""
import pathlib

import pandas as pd
import pytest

from xpool import Pool
from xlab import memory_study as m

DATA = pathlib.Path(__file__).resolve().parents[2] / "data"
DYN, HELD_OUT = m.DYN_TRACES, m.HELD_OUT_TRACES          # the H200's traces
RESNETS = tuple(w for w in DYN + HELD_OUT if w.startswith("resnet_varres"))


def stats(pool, device=0):
    return pool._core.stats(device)


@pytest.mark.parametrize("trace", ["memory_trace_cupy_path_b32_keep.csv.gz",
                                   "memory_trace_cupy_path_b32_perparam_keep.csv.gz"])
def test_a_loop_keeping_the_previous_step_alive_maps_and_unmaps_nothing_once_warm(trace):
    """The GPT's requests (batch 32, CuPy path) from a loop that rebinds x, y, loss and grads instead of deleting
    them, replayed with 2 MiB pages under the product's one rule (a miss only adds): the same device calls in every
    step from the warm-up on, none of them after it (under the old "high_water" default a miss at the mark unmapped
    pages the next step cut again, 1 map and 3-6 unmaps per step for good)."""
    ev = m._replay_events(pd.read_csv(DATA / trace))
    pool = Pool(m.AddressSpaceBackend(), scheme="expandable", limit=0, timeline=0)
    calls = {}
    live, _ = m._drive(pool, ev, lambda step: calls.__setitem__(step, (stats(pool)["device_maps"],
                                                                        stats(pool)["device_unmaps"])))
    per_step = [calls[s] for s in range(m.WARMUP_STEPS - 1, 10)]
    assert per_step[0][0] > 100 and all(c == per_step[0] for c in per_step), per_step
    assert all(unmaps == 0 for _, unmaps in calls.values()), calls
    live.clear()
    assert pool.empty_cache() > 0 and stats(pool)["bytes_reserved"] == 0


@pytest.mark.parametrize("workload", DYN + HELD_OUT)
def test_the_h200s_traces_replay_to_its_counters_and_the_bound_holds(workload):
    """The H200's request traces (xlab.bench.dynamic_traces): the host twin with 2 MiB pages reproduces the
    recording run's peaks and device calls to the byte under the rule it ran (its release_on_miss column: the
    product's own, or the research build's); under "bounded" (1.05) peak reserved stays within the bound on every
    trace but the CuPy loop's, whose misses spend the give-back budget."""
    tl = m.dyn_trace(workload)
    gpu = tl.iloc[0]
    ran = m.replay_rule(tl, gpu.release_on_miss)
    assert (ran["peak_bytes_reserved"], ran["peak_bytes_requested"], ran["device_calls"], ran["unmatched_frees"]) == \
        (gpu.gpu_peak_bytes_reserved, gpu.gpu_peak_bytes_requested, gpu.gpu_device_calls, 0)
    if not workload.startswith("cupy_mix"):
        bounded = m.replay_rule(tl, "bounded")
        assert bounded["peak_bytes_reserved"] <= 1.05 * bounded["peak_bytes_requested"], bounded


@pytest.mark.parametrize("workload", RESNETS)
def test_a_reserve_of_1_03_times_the_peak_stops_the_resnets_steady_maps(workload):
    """On every realization of the ResNets at varying image sizes (the benchmark's and the held-out one at batch
    64), under "peak" (the research build's rule that enable_torch()'s pool had), the maps of a recurring peak whose
    free space lies in pieces (0-4 in steady state) stop when 1.03 times the program's peak requested bytes are
    reserved up front, for 1.0273 times that peak (the replays of the record at tag record-2026-12-05)."""
    tl = m.dyn_trace(workload)
    plain = m.replay_rule(tl, "peak")
    peak = plain["peak_bytes_requested"]
    reserve = int(1.03 * peak) // m.DYN_PAGE * m.DYN_PAGE
    for after in (0, m.build_events(tl)):                    # before anything, and after the model's build
        got = m.replay_rule(tl, "peak", reserve, after)
        assert got["peak_bytes_requested"] == peak            # the reserve's request is forgotten
        assert got["steady_calls"] == 0 and got["ratio"] <= 1.03, (after, got)
    if workload in ("resnet_varres", "resnet_varres_s2", "resnet_varres_s3", "resnet_varres_b64_s1"):
        assert plain["steady_calls"] >= 2, plain              # what the reserve stops


def test_a_reserve_from_the_peak_so_far_made_mid_run_is_no_reserve_up_front():
    """The reserve needs the peak before the first step (the record at tag record-2026-12-05: NOTES.md, "A reserve
    up front", "Without a dry run?"): on the ResNet at varying sizes, 1.03 times the peak seen after the first step
    (its largest image) leaves the steady maps (the first step's layout is already in pieces), and after the warm-up
    it stops them at about 1.08."""
    tl = m.dyn_trace("resnet_varres_s3")
    so_far = lambda s: int(1.03 * s["peak_bytes_requested"]) // m.DYN_PAGE * m.DYN_PAGE     # noqa: E731
    plain = m.replay_rule(tl, "peak")
    first = m.replay_rule(tl, "peak", so_far, m.events_before_step(tl, 1))
    warm = m.replay_rule(tl, "peak", so_far, m.events_before_step(tl, int(tl["warmup"].iloc[0])))
    assert plain["steady_calls"] == first["steady_calls"] == 4, (plain, first)
    assert warm["steady_calls"] == 0 and warm["ratio"] > 1.07, warm
    assert first["peak_bytes_requested"] == warm["peak_bytes_requested"] == plain["peak_bytes_requested"]


def _probe_rows():
    d = pd.read_csv(DATA / "reserve_probe.csv")
    return [pytest.param(r, id=f"{r.workload}-s{r.seed}-{r.frac}-{r.when}-{r.commit[:7]}") for r in d.itertuples()]


@pytest.mark.parametrize("row", _probe_rows())
def test_every_gpu_run_of_the_reserve_probe_equals_its_replay(row):
    """data/reserve_probe.csv (xlab.bench.reserve on the H200): every run, plain or with a reserve (by
    hand or pool.reserve) before anything ("start") or after the model is built ("build", at the replay's
    build_events), made the peaks and device calls the host twin makes on that seed's trace, to the byte and the
    call."""
    tl = m.dyn_trace(row.workload + (f"_s{row.seed}" if row.seed else ""))
    after = m.build_events(tl) if row.when == "build" else 0
    got = m.replay_rule(tl, row.release_on_miss, int(row.reserve_bytes), after)
    assert (got["peak_bytes_reserved"], got["peak_bytes_requested"], got["steady_calls"], got["device_calls"]) == \
        (row.peak_bytes_reserved, row.peak_bytes_requested, row.steady_calls, row.device_maps + row.device_unmaps)


def test_the_build_of_a_trace_is_its_models_parameters():
    """memory_study.build_events: the ResNet's build ends after its 156th event, when the model's parameters (and
    nothing the first step frees) are in use; the language model's after its 76th."""
    for name, n in (("resnet_varres", 156), ("torch_varlen", 76)):
        tl = m.dyn_trace(name)
        assert m.build_events(tl) == n
        ev = m._replay_events(tl)
        head = ev.iloc[:n]
        assert (head["step"] == 0).all() and head["alloc"].iloc[0] and ev["alloc"].iloc[n:n + 20].any()


@pytest.mark.parametrize("loop", ("test_b4", "test_b32_perparam"))
def test_scheme_segments_made_no_device_call_after_warm_up_on_the_gpu_tests_loop(loop):
    """The H200's timeline of the GPU steady-state test's loop under scheme segments
    (`record_dynamic_traces.py --scheme segments`): every device malloc (a miss) and free (a release) of the run is
    in it, and all fall in the 5 warm-up steps. The host twin does not replay scheme segments exactly on these (its
    addresses are not cudaMalloc's, so best fit breaks ties elsewhere), so the GPU's own events are the evidence."""
    tl = pd.read_csv(DATA / f"segments_trace_dyn_{loop}.csv.gz")
    run = tl.iloc[0]
    assert (run.scheme, run.release_on_miss, run.warmup) == ("segments", "high_water", 5)
    calls = tl[tl["event"].isin(("alloc_miss", "release"))]
    assert len(calls) == run.gpu_device_calls and calls["step"].max() < run.warmup
