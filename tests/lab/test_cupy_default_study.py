"""xlab.cupy_default_study (lab): the replays behind docs/decisions/0014 (data/cupy_default_replays.csv), each
candidate for CuPy's default scheme beside the best CuPy peer the GPU measured on the same realization."""
import math
import pathlib

import pandas as pd
import pytest

from xlab import cupy_default_study as cds
from xlab import memory_study as ms

ROOT = pathlib.Path(__file__).resolve().parents[2]
CSV = ROOT / "data" / "cupy_default_replays.csv"
NUMERIC = ["peak_bytes_requested", "peak_bytes_reserved", "reserved_over_requested", "device_calls",
           "device_calls_after_warmup", "steady_calls", "steady_steps", "unmatched_frees", "events",
           "measured_best_peer_ratio", "measured_arm_ratio"]


@pytest.fixture(scope="module")
def rows():
    return pd.read_csv(CSV)


def _timeline(events, warmup=1, steps=2):
    """A trace in the replays' columns: (step, alloc?, ptr, requested) per event, device 0, stream 0."""
    return pd.DataFrame([dict(step=s, event="alloc_miss" if a else "free", device=0, stream=0, ptr=p, requested=n,
                              warmup=warmup, steps=steps) for s, a, p, n in events])


def test_a_replay_counts_each_candidates_peaks_and_its_device_calls_after_the_warm_up():
    mib = 1 << 20
    tl = _timeline([(0, True, 1, 8 * mib), (0, False, 1, 8 * mib),          # warm-up: 8 MiB, freed
                    (1, True, 2, 4 * mib), (1, True, 3, 4 * mib),           # two halves of it
                    (2, True, 4, 8 * mib), (2, False, 2, 4 * mib), (2, False, 3, 4 * mib), (2, False, 4, 8 * mib)])
    seg = cds.replay(tl, "segments", warmup=1, steps=2)
    exp = cds.replay(tl, "expandable", warmup=1, steps=2)
    cupy = cds.replay(tl, "cupy_pool_model", warmup=1, steps=2)
    for r in (seg, exp, cupy):
        assert r["peak_bytes_requested"] == 16 * mib and r["events"] == 8 and r["unmatched_frees"] == 0
    # expandable: one map of 8 MiB at warm-up; the halves reuse its pages; the second 8 MiB one map more
    assert (exp["peak_bytes_reserved"], exp["device_calls"], exp["device_calls_after_warmup"]) == (16 * mib, 2, 1)
    # CuPy's pool splits the 8 MiB chunk for the halves, then mallocs 8 MiB more
    assert (cupy["peak_bytes_reserved"], cupy["device_calls_after_warmup"]) == (16 * mib, 1)
    assert seg["peak_bytes_reserved"] >= 16 * mib
    scaled = cds.replay(tl, "expandable", warmup=1, steps=2, scale=3)
    assert scaled["peak_bytes_requested"] == 48 * mib and scaled["peak_bytes_reserved"] == 48 * mib


def test_a_gpu_trace_of_the_new_workloads_joins_the_study_once_recorded(tmp_path):
    """An AWAITED trace in the data folder is replayed as the GPU's (requests "gpu"), the GPU's peers beside it."""
    import shutil
    for f in ("memory_trace_host_dyn_cupy_fill_s3.csv.gz", "dynamic_shapes.csv", "dynamic_scale.csv"):
        shutil.copy(ROOT / "data" / f, tmp_path / f.replace("host_dyn", "dyn"))
    assert cds.traces(tmp_path) == (*(t for t in cds.TRACES if t != "host_cupy_fill_s3"), "cupy_fill_s3")
    rows = pd.DataFrame(cds.trace_rows("cupy_fill_s3", ("expandable",), tmp_path))
    assert list(rows.scale) == [1, 64] and set(rows.realization) == {3}
    assert rows.loc[rows.scale == 1, "requests"].item() == "plan"       # the file says how its requests were had
    gpu = pd.read_csv(tmp_path / "dynamic_shapes.csv").query("workload == 'cupy_fill' and seed == 3")
    peers = gpu[gpu.allocator.isin(cds.PEERS)].groupby("allocator")["reserved_over_requested"].median()
    at1 = rows[rows.scale == 1].iloc[0]
    assert (at1.measured_best_peer, at1.measured_best_peer_ratio) == (peers.idxmin(), peers.min())
    assert at1.measured_arm_ratio == gpu.query("allocator == 'xpool_expandable'")["reserved_over_requested"].median()


@pytest.mark.parametrize("bad", [0, 1.5, True, "2"])
def test_a_bad_scale_or_candidate_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="scale"):
        cds.replay(_timeline([(0, True, 1, 512)]), "expandable", 1, 0, scale=bad)
    with pytest.raises(ValueError, match="candidate must be one of"):
        cds.make_pool("xpool")


def test_the_csv_holds_every_trace_and_candidate_with_provenance(rows):
    assert set(rows["trace"]) == set(cds.traces())
    assert set(rows["candidate"]) == set(cds.CANDIDATES)
    assert not rows.duplicated(["trace", "scale", "candidate"]).any()
    for col in ("gpu", "driver", "cuda", "cupy", "commit", "date", "experiment", "trace_commit"):
        assert rows[col].notna().all(), col
    assert set(rows.loc[rows["scale"] > 1, "workload"]) == set(cds.SCALES)
    by = rows.groupby(["workload", "scale"])["requests"].agg(set)
    assert by[("cupy_mix", 1)] == {"gpu"} and by[("cupy_mix", 216)] == {"scaled"}
    assert by[("cupy_fill", 1)] == by[("cupy_image", 1)] == {"gpu"} and by[("cupy_fill", 64)] == {"plan"}
    assert set(rows.loc[rows["pool"] == "exact", "candidate"]) == {"expandable"}


def test_the_expandable_replays_equal_the_gpus_runs_of_the_same_realization(rows):
    """The traces were recorded on the H200 under scheme expandable's one rule at the commit the benchmark's rows
    carry; scheme expandable's replays are exact there (and CuPy's model on most), so the CSV's measured column is
    the replay's check. Segments' GPU rows are of the rule before 0001 (high_water), so they differ."""
    exact = rows[(rows["candidate"] == "expandable") & (rows["requests"] == "gpu") & rows["measured_arm_ratio"].notna()]
    assert len(exact) >= 10
    assert (exact["reserved_over_requested"] - exact["measured_arm_ratio"]).abs().max() < 1e-9


@pytest.mark.parametrize("trace", ["gpt_b4", "cupy_mix_s3"])
def test_the_committed_rows_are_what_the_replays_give_now(rows, trace):
    fresh = pd.DataFrame(cds.trace_rows(trace)).set_index(["scale", "candidate"])
    old = rows[rows["trace"] == trace].set_index(["scale", "candidate"]).loc[fresh.index]
    for col in NUMERIC:
        a, b = fresh[col].astype(float).to_numpy(), old[col].astype(float).to_numpy()
        assert all((math.isnan(x) and math.isnan(y)) or x == pytest.approx(y, rel=1e-12) for x, y in zip(a, b)), col


def test_the_summary_counts_the_realizations_at_most_the_best_peer_and_at_most_segments():
    df = pd.DataFrame(dict(workload="w", scale=1, trace=["a", "b", "c"] * 2,
                           candidate=["expandable"] * 3 + ["segments"] * 3,
                           reserved_over_requested=[1.0, 1.2, 1.1, 1.05, 1.1, 1.1],
                           measured_best_peer_ratio=[1.1, 1.1, math.nan] * 2, steady_calls=[0, 1, 0] * 2,
                           device_calls_after_warmup=[0, 2, 0] * 2))
    s = cds.summary(df).set_index("candidate").loc["expandable"]
    assert (s.realizations, s.with_peer, s.at_most_best_peer, s.steady_calls) == (3, 2, 1, 1)
    assert s.at_most_segments == 2                          # a: 1.0 <= 1.05, c: 1.1 <= 1.1; b: 1.2 > 1.1


def test_the_placement_model_with_the_products_placement_is_the_product():
    """RangeModel(None) cuts every block from the low end, as scheme expandable does: the same peaks and maps as the
    product over the twin on GPU traces and a plan, so its split_1mib variant differs from the product by the
    placement alone."""
    for name in ("gpt_b4", "cupy_mix_s2", "host_cupy_fill"):
        tl = cds.load_trace(name)
        info = cds.rule_study.trace_info(name, tl)
        product = cds.replay(tl, "expandable", info["warmup"], info["steps"])
        events = ms._replay_events(tl)
        model = cds.RangeModel(None)
        ms._drive(model, ms._rows(events))
        assert (model.peak_reserved[0], model.device_mallocs[0]) == (product["peak_bytes_reserved"],
                                                                    product["device_calls"]), name
        split = cds.replay(tl, "expandable_split_1mib", info["warmup"], info["steps"])
        assert split["peak_bytes_requested"] == product["peak_bytes_requested"]
    b4 = cds.load_trace("gpt_b4")
    info = cds.rule_study.trace_info("gpt_b4", b4)
    assert cds.replay(b4, "expandable_split_1mib", info["warmup"], info["steps"])["reserved_over_requested"] < 1.01


def test_every_trace_named_is_one_the_lab_has():
    recorded = cds.traces()                  # the GPU's traces of cupy_image and cupy_fill, in place of the host's
    assert set(cds.AWAITED) <= set(recorded) and not set(recorded) & set(cds.HOST)
    for name in cds.TRACES:
        assert (name in ms.DYN_TRACES or name in ms.HELD_OUT_TRACES or name in cds.rule_study.FILE_TRACES
                or (name in cds.HOST and (ROOT / "data" / cds.HOST[name]).is_file())), name
