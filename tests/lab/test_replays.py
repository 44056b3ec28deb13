"""Replays of recorded request traces through the allocator over the tests' host twin (xlab.memory_study): the
H200's runs reproduced to the byte and the call.  The product's own rule is replayed by the product; the replays of
the release rules it no longer has are committed (data/release_rules.csv: tests/lab/test_rule_study.py).  Moved here
from the allocator's tests, which import no lab code."""
import pathlib

import pandas as pd
import pytest

from xpool import Pool
from xlab import memory_study as m

DATA = pathlib.Path(__file__).resolve().parents[2] / "data"
DYN, HELD_OUT = m.DYN_TRACES, m.HELD_OUT_TRACES          # the H200's traces
# the traces the H200 recorded under the product's rule (gpt_b32's ran under "bounded": its replay is committed)
NEVER = tuple(w for w in DYN + HELD_OUT if m.dyn_trace(w).iloc[0].release_on_miss == "never")


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


@pytest.mark.parametrize("workload", NEVER)
def test_the_h200s_traces_replay_to_its_counters(workload):
    """The H200's request traces (xlab.bench.dynamic_traces) recorded under the product's rule (release_on_miss
    "never"): the host twin with 2 MiB pages reproduces the recording run's peaks and device calls to the byte."""
    tl = m.dyn_trace(workload)
    gpu = tl.iloc[0]
    ran = m.replay_rule(tl, gpu.release_on_miss)
    assert (ran["peak_bytes_reserved"], ran["peak_bytes_requested"], ran["device_calls"], ran["unmatched_frees"]) == \
        (gpu.gpu_peak_bytes_reserved, gpu.gpu_peak_bytes_requested, gpu.gpu_device_calls, 0)


def test_a_rule_the_product_no_longer_has_is_a_clear_error():
    with pytest.raises(ValueError, match="rule must be None or 'never'.*release_rules.csv"):
        m.replay_rule(m.dyn_trace("gpt_b32"), "bounded")


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
