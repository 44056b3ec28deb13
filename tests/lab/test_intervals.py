"""The lab's statistics over trials: medians with bootstrap intervals, paired ratios, verdicts on targets."""
import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from xlab import intervals as iv

finite = st.floats(min_value=0.1, max_value=1e6, allow_nan=False, allow_infinity=False)


@settings(max_examples=60, deadline=None)
@given(st.lists(finite, min_size=2, max_size=12))
def test_interval_contains_the_median_and_lies_within_the_data(values):
    med, lo, hi, n = iv.median_ci(values)
    assert n == len(values) and med == pytest.approx(float(np.median(values)))
    assert min(values) <= lo <= med + 1e-9 * abs(med) and med - 1e-9 * abs(med) <= hi <= max(values)


@settings(max_examples=40, deadline=None)
@given(st.lists(finite, min_size=2, max_size=10), st.floats(min_value=0.5, max_value=4.0))
def test_paired_ratio_of_a_scaled_arm_is_exact(values, k):
    """Arm B = k x arm A trial by trial: every resample gives k, so the interval is the point."""
    r, lo, hi, n = iv.ratio_ci([k * v for v in values], values)
    assert r == pytest.approx(k) and lo == pytest.approx(k) and hi == pytest.approx(k) and n == len(values)


def test_pairing_cancels_drift_shared_by_both_arms():
    drift = np.array([1.0, 1.5, 0.7, 1.2, 0.9])               # each trial's machine state, hitting both arms
    a, b = 2.0 * drift, 1.0 * drift
    r, lo, hi, _ = iv.ratio_ci(a, b)
    assert (r, lo, hi) == pytest.approx((2.0, 2.0, 2.0))
    # unpaired (shuffled) the same numbers give a wide interval
    _, lo2, hi2, _ = iv.ratio_ci(a, b[[3, 0, 4, 1, 2]])
    assert hi2 - lo2 > 0.5


def test_one_or_no_trials_have_no_interval():
    med, lo, hi, n = iv.median_ci([3.0])
    assert med == 3.0 and math.isnan(lo) and math.isnan(hi) and n == 1
    assert math.isnan(iv.median_ci([])[0]) and iv.median_ci([math.nan, math.inf])[3] == 0
    with pytest.raises(ValueError, match="pair"):
        iv.ratio_ci([1.0, 2.0], [1.0])


def test_the_bootstrap_is_reproducible():
    x = [1.0, 5.0, 2.0, 8.0, 3.0]
    assert iv.median_ci(x) == iv.median_ci(x)


def test_judge_on_the_interval():
    assert iv.judge(1.9, 1.88, 1.95, 1.85) == iv.MET
    assert iv.judge(1.5, 1.4, 1.6, 1.85) == iv.MISSED
    assert iv.judge(1.86, 1.80, 1.90, 1.85) == iv.NOISE
    assert iv.judge(1.2, 1.1, 1.25, 1.3, higher_is_better=False) == iv.MET
    assert iv.judge(1.4, 1.35, 1.5, 1.3, higher_is_better=False) == iv.MISSED
    assert iv.judge(1.9, math.nan, math.nan, 1.85).startswith(iv.SINGLE) and "meets" in \
        iv.judge(1.9, math.nan, math.nan, 1.85)
    assert "misses" in iv.judge(1.0, math.nan, math.nan, 1.85)
    assert iv.judge(math.nan, math.nan, math.nan, 1.0) == "not measured"


def test_fmt_ci():
    assert iv.fmt_ci(1.934, 1.9, 1.95, unit="×") == "1.93× [1.90, 1.95]"
    assert iv.fmt_ci(1.5, math.nan, math.nan) == "1.50 (single run)"
    assert iv.fmt_ci(math.nan, 0, 0) == "n/a"


def test_summarize_frames():
    rows = [dict(batch=b, allocator=a, trial=t, tps=base * (1 + 0.1 * t))
            for b in (4, 32) for t in range(5) for a, base in (("raw", 1.0), ("pool", 3.0))]
    s = iv.summarize(pd.DataFrame(rows), ["batch", "allocator"], "tps")
    assert list(s.columns) == ["batch", "allocator", "tps", "tps_lo", "tps_hi", "n_trials"]
    assert len(s) == 4 and (s["n_trials"] == 5).all() and (s["tps_lo"] <= s["tps"]).all()


def test_paired_best_pairs_every_arm_with_the_best_peer_of_each_group():
    rows = [dict(w=w, arm=a, trial=t, ms=ms * (1 + 0.01 * t))
            for w, speeds in (("x", dict(p=10.0, q=8.0, mine=9.0)), ("y", dict(p=5.0, q=6.0, mine=5.5)))
            for a, ms in speeds.items() for t in range(5)]
    df = pd.DataFrame(rows)
    assert iv.best(df[df.w == "x"], "ms", "arm", higher=False) == "q" and iv.best(df[df.w == "x"], "ms", "arm") == "p"
    assert iv.best(df.iloc[:0], "ms", "arm") is None
    r = iv.paired_best(df, "ms", "arm", ("p", "q"), by=["w"], higher=False).set_index(["w", "arm"])
    assert set(r.loc["x", "reference"]) == {"q"} and set(r.loc["y", "reference"]) == {"p"}
    assert r.loc[("x", "mine"), "ratio"] == pytest.approx(9 / 8) and r.loc[("y", "mine"), "ratio"] == pytest.approx(1.1)
    assert r.loc[("x", "q"), "ratio"] == 1.0 and r.loc[("x", "q"), "n_pairs"] == 5
    assert iv.paired_best(df, "ms", "arm", ("none",), by=["w"]).empty
