"""Medians with 95% bootstrap intervals over trials, ratios of paired trials, and a verdict on a target: the lab's one
place for statistics over repeated measurements (docs/decisions/0008-how-the-lab-measures.md). Trial t of arm A and
trial t of arm B ran back to back (interleaved: A B C D, A B C D, ...), so a ratio between arms is computed over
those pairs, which cancels the drift they share. The bootstrap is seeded: the same CSV always gives the same
interval. With one trial there is no interval: the bounds are NaN and `judge` says "single run".
"""
from __future__ import annotations

import math
import re

import numpy as np
import pandas as pd

LEVEL = 0.95
RESAMPLES = 2000
SEED = 0

MET, MISSED, NOISE, SINGLE = "met", "missed", "within noise", "single run, no interval"


def _clean(values) -> np.ndarray:
    a = np.asarray(values, dtype=float).ravel()
    return a[np.isfinite(a)]


def _bootstrap(stat, arrays, level, resamples, seed):
    """(stat(*arrays), lo, hi, n) with a percentile-bootstrap interval that resamples the arrays' elements together
    (element t of each: trial t); lo and hi NaN with fewer than two elements, everything with none."""
    n = len(arrays[0])
    if n == 0:
        return math.nan, math.nan, math.nan, 0
    value = float(stat(*arrays, axis=None))
    if n < 2:
        return value, math.nan, math.nan, 1
    idx = np.random.default_rng(seed).integers(0, n, size=(resamples, n))
    lo, hi = np.quantile(stat(*(a[idx] for a in arrays), axis=1), [(1 - level) / 2, (1 + level) / 2])
    return value, float(lo), float(hi), n


def median_ci(values, level: float = LEVEL, resamples: int = RESAMPLES, seed: int = SEED):
    """The median of `values` (one number per trial; NaN and inf dropped) and a percentile-bootstrap interval for it
    at `level` from `resamples` resamples, seeded: (median, lo, hi, n), lo and hi NaN with fewer than two trials."""
    return _bootstrap(np.median, (_clean(values),), level, resamples, seed)


def ratio_ci(numerator, denominator, level: float = LEVEL, resamples: int = RESAMPLES, seed: int = SEED):
    """median(numerator) / median(denominator) of paired trials (element t of each: trial t; a pair with a NaN
    dropped) with a bootstrap interval that resamples the pairs: (ratio, lo, hi, n_pairs), as `median_ci`.
    ValueError: the two differ in length (the trials are not paired)."""
    a, b = np.asarray(numerator, dtype=float).ravel(), np.asarray(denominator, dtype=float).ravel()
    if a.shape != b.shape:
        raise ValueError(f"numerator and denominator must pair trial by trial; got {len(a)} and {len(b)} trials")
    keep = np.isfinite(a) & np.isfinite(b)
    return _bootstrap(lambda x, y, axis: np.median(x, axis=axis) / np.median(y, axis=axis), (a[keep], b[keep]),
                      level, resamples, seed)


def paired(df, value: str, arm: str, reference, by=(), trial: str = "trial"):
    """Every arm's `value` over the `reference` arm's, per group of `by`, paired by `trial` (ratio_ci): a frame of
    the `by` columns, `arm`, ratio, ratio_lo, ratio_hi, n_pairs (the reference left out; empty without it)."""
    by, rows = list(by), []
    for key, g in (df.groupby(by, sort=False, dropna=False) if by else [((), df)]):     # a key per column of by
        ref = g[g[arm] == reference].groupby(trial)[value].median()
        for name, a in ([] if ref.empty else g[g[arm] != reference].groupby(arm, sort=False)):
            mine = a.groupby(trial)[value].median()
            common = mine.index.intersection(ref.index)
            r, lo, hi, n = ratio_ci(mine.loc[common].to_numpy(), ref.loc[common].to_numpy())
            rows.append({**dict(zip(by, key)), arm: name, "ratio": r, "ratio_lo": lo, "ratio_hi": hi, "n_pairs": n})
    return pd.DataFrame(rows, columns=by + [arm, "ratio", "ratio_lo", "ratio_hi", "n_pairs"])


def best(df, value: str, arm: str, higher: bool = True):
    """The `arm` of the highest median `value` over its rows (the lowest with higher=False); None without rows."""
    med = df.groupby(arm)[value].median().dropna()
    return None if med.empty else med.idxmax() if higher else med.idxmin()


def paired_best(df, value: str, arm: str, candidates, by=(), higher: bool = True, trial: str = "trial"):
    """`paired` against the best of `candidates` per group of `by` (`best`; named in a `reference` column), the
    reference itself included with ratio 1: how each arm compares with the fastest of several peers."""
    by, out = list(by), []
    for key, g in (df.groupby(by, sort=False, dropna=False) if by else [((), df)]):
        ref = best(g[g[arm].isin(candidates)], value, arm, higher)
        if ref is not None:
            itself = dict(zip(by, key), ratio=1.0, ratio_lo=1.0, ratio_hi=1.0,
                          n_pairs=g.loc[g[arm] == ref, trial].nunique(), **{arm: ref})
            out.append(pd.concat([paired(g, value, arm, ref, by, trial), pd.DataFrame([itself])],
                                 ignore_index=True).assign(reference=ref))
    cols = by + [arm, "ratio", "ratio_lo", "ratio_hi", "n_pairs", "reference"]
    return pd.concat(out, ignore_index=True)[cols] if out else pd.DataFrame(columns=cols)


def judge(value: float, lo: float, hi: float, target: float, higher_is_better: bool = True,
          exact: bool = False) -> str:
    """Whether a target is met, judged on the interval rather than the median: the report's one rule. "met" when the
    whole interval [lo, hi] of `value` is on the target's side (higher_is_better: >=, else <=), "missed" when all of
    it is on the other, "within noise" when it straddles the target. Measured once (NaN bounds): an `exact` value (a
    count, a bitwise check, a replay's bytes) is judged on itself, a timed one is "single run, no interval (the median
    meets it)" (or "misses it)"; "not measured" for NaN."""
    if value is None or not math.isfinite(value):
        return "not measured"
    if not (math.isfinite(lo) and math.isfinite(hi)):
        if exact:
            lo = hi = value
        else:
            ok = value >= target if higher_is_better else value <= target
            return f"{SINGLE} (the median {'meets' if ok else 'misses'} it)"
    good_lo, good_hi = (lo >= target, hi >= target) if higher_is_better else (hi <= target, lo <= target)
    return MET if good_lo and good_hi else NOISE if good_lo or good_hi else MISSED


def summarize(df, by, value: str, trial: str = "trial"):
    """Median and interval of `value` per group of `by`, groups in order of first appearance: the `by` columns,
    `value`, `value`_lo, `value`_hi and n_trials (NaN bounds for one trial; a CSV without a trial column counts one
    trial per row)."""
    by, rows = list(by), []
    for key, g in df.groupby(by, sort=False, dropna=False):     # by a list: a tuple key, as pandas >= 2 gives
        med, lo, hi, n = median_ci(g[value])
        rows.append({**dict(zip(by, key)), value: med, f"{value}_lo": lo, f"{value}_hi": hi, "n_trials": n})
    return pd.DataFrame(rows, columns=by + [value, f"{value}_lo", f"{value}_hi", "n_trials"])


def fmt_ci(value: float, lo: float, hi: float, fmt: str = "{:.2f}", unit: str = "", goal: float | None = None,
           exact: bool = False) -> str:
    """'1.93× [1.90, 1.95]' (or '1.93× (single run)' without an interval; the value alone when exact). Digits are
    added (up to four) until two bounds that differ print apart, and with a goal until every bound that differs from
    it prints differently from it: '0.998× [0.996, 1.001]', never a '1.00× [1.00, 1.00]' that is an interval of
    width 0.005 or within noise of 1.00. "n/a" for NaN."""
    if value is None or not math.isfinite(value):
        return "n/a"
    bounds = [b for b in (lo, hi) if math.isfinite(b)]
    fmt = digits(fmt, bounds, goal, apart=not exact)
    head = fmt.format(value) + unit
    if exact or len(bounds) < 2:
        return head if exact else f"{head} (single run)"
    return f"{head} [{fmt.format(lo)}, {fmt.format(hi)}]"


def digits(fmt: str, bounds, goal: float | None = None, apart: bool = True) -> str:
    """`fmt` ('{:.2f}', '{:.1e}', ...) with the fewest digits added (up to four) for fmt_ci's rule (`apart`: its
    first half); unchanged where no number of them will do or it is not of that form."""
    m = re.fullmatch(r"\{:([,]?)\.(\d+)([fe])\}", fmt)
    if not m:
        return fmt
    for extra in range(5):
        f = "{:" + m[1] + "." + str(int(m[2]) + extra) + m[3] + "}"
        split = not apart or len(set(bounds)) < 2 or f.format(bounds[0]) != f.format(bounds[1])
        if split and (goal is None or not math.isfinite(goal) or
                      all(f.format(b) != f.format(goal) for b in bounds if b != goal)):
            return f
    return fmt


def fmt_bytes(n: float) -> str:
    """A byte count for people: '64 KiB', '1.5 MiB', '100 B' (binary units): the lab's one byte formatter."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.3g} {unit}"
    return f"{n:.0f} B"
