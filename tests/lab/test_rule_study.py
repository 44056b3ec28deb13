"""xlab.rule_study (lab): the replays that data/release_rules.csv holds (xpool as at 5bcaad4, every release rule;
the code at the tag record-2026-12-05), the rule per scheme that docs/decisions/0001 records from them, and the
product's replays (data/release_rules_product.csv) that the freeze changed nothing of the chosen rule's."""
import pathlib
import re

import pandas as pd
import pytest

from xlab import memory_study as ms
from xlab import rule_study as rs

ROOT = pathlib.Path(__file__).resolve().parents[2]
CSV = ROOT / "data" / "release_rules.csv"
RECORD = ROOT / "docs" / "decisions" / "0001-one-release-rule-per-scheme.md"
KEYS = ["trace", "scheme", "rule"]
NUMERIC = ["seed", "peak_bytes_requested", "peak_bytes_reserved", "reserved_over_requested", "device_calls",
           "steady_calls", "steady_unmaps", "steady_steps", "steady_calls_per_step", "calls_after_warmup",
           "demand_peak_step", "warmup", "steps", "events", "unmatched_frees"]


@pytest.fixture(scope="module")
def rows():
    return pd.read_csv(CSV)


def test_the_study_refuses_settings_from_the_environment(monkeypatch):
    monkeypatch.setenv("XPOOL_DEBUG", "raise")
    with pytest.raises(ValueError, match="unset XPOOL_DEBUG"):
        rs.trace_rows("gpt_b32_gpu")


def test_a_build_other_than_the_product_is_a_clear_error():
    with pytest.raises(ValueError, match="build must be 'product'.*record-2026-12-05"):
        rs.trace_rows("gpt_b32_gpu", rs.RESEARCH_COMMIT)


def test_the_csv_holds_every_trace_under_every_pair_once(rows):
    expected = {(t, s, r) for t in rs.trace_names() for s, r in rs.pairs(rs.RESEARCH_COMMIT)}
    assert len(rows) == len(expected) and set(map(tuple, rows[KEYS].to_numpy())) == expected
    groups = rows.drop_duplicates("trace")["trace_group"].value_counts().to_dict()
    assert groups == {"tuned": 33, "held_out": len(ms.HELD_OUT_TRACES)}
    assert rows.loc[rows["fixed_shape"], "trace"].nunique() == 16


def test_the_expandable_rows_are_the_gpus_runs(rows):
    """Each dynamic trace, under the rule the H200 ran it with, replays to that run's peaks and device calls."""
    for name in (*ms.DYN_TRACES, *ms.HELD_OUT_TRACES):
        gpu = pd.read_csv(ROOT / "data" / f"memory_trace_dyn_{name}.csv.gz", nrows=1).iloc[0]
        row = rows[(rows["trace"] == name) & (rows["scheme"] == gpu["scheme"]) &
                   (rows["rule"] == gpu["release_on_miss"])].iloc[0]
        assert (row["peak_bytes_reserved"], row["peak_bytes_requested"], row["device_calls"]) == (
            gpu["gpu_peak_bytes_reserved"], gpu["gpu_peak_bytes_requested"], gpu["gpu_device_calls"]), name


def test_the_product_build_replays_one_builtin_rule_per_scheme():
    got = rs.trace_rows("gpt_b32_gpu", rs.PRODUCT)
    assert [(r["scheme"], r["rule"], r["build"]) for r in got] == [
        ("segments", "builtin", "product"), ("expandable", "builtin", "product")]


def test_the_decision_record_states_the_summarys_choice_and_its_table(rows):
    text = RECORD.read_text()
    decision = text.split("## Decision", 1)[1].split("\n## ", 1)[0]
    stated = dict(re.findall(r"^(segments|expandable): (\w+)$", decision, re.M))
    table = rs.summary(rows)
    assert stated == rs.choose(table)
    assert rs.markdown(table) in text.split("## Evidence", 1)[1]


AFTER = ROOT / "data" / "release_rules_product.csv"
SAME = ["peak_bytes_requested", "peak_bytes_reserved", "device_calls", "steady_calls", "steady_unmaps", "steady_steps",
        "calls_after_warmup", "demand_peak_step", "events", "unmatched_frees"]


def test_the_frozen_product_replays_every_trace_as_the_chosen_rule_did_before(rows):
    """Before/after the freeze: data/release_rules_product.csv (the product, rule builtin) holds, on every trace and
    scheme, exactly 5bcaad4's committed rows of the rule chosen for it (never), so the freeze changed no measured
    behaviour of the chosen rule."""
    after = pd.read_csv(AFTER)
    chosen = rs.choose(rs.summary(rows))
    before = rows[rows["rule"] == rows["scheme"].map(chosen)]
    assert set(after["rule"]) == {"builtin"} and len(after) == len(before) == 2 * len(rs.trace_names())
    merged = before.merge(after, on=["trace", "scheme"], suffixes=("", "_after"), validate="one_to_one")
    for col in SAME:
        pd.testing.assert_series_equal(merged[col], merged[f"{col}_after"], check_names=False, check_dtype=False)


def test_two_small_traces_replay_through_the_product_to_its_csvs_rows():
    after = pd.read_csv(AFTER)
    got = pd.DataFrame([r for name in ("gpt_b32_gpu", "cupy_mix_s4") for r in rs.trace_rows(name, rs.PRODUCT)])
    want = got[KEYS].merge(after, on=KEYS, how="left")
    pd.testing.assert_frame_equal(got[NUMERIC], want[NUMERIC], check_exact=True, check_dtype=False)
