"""Summaries of the benchmarks' CSVs, for the report, the figures and notebook 06 (the analysis floor: it reads
rows, never runs a benchmark): the dynamic-shape benchmark's table (dynamic_summary) and the scaled runs' (issue
#46: scale_summary, defaults_vs_peers, cap_summary, cap_grid, trials_said, requested, said).

    python -m xlab.summaries dynamic data/dynamic_shapes.csv
    python -m xlab.summaries scale data/dynamic_scale.csv data/memory_cap.csv
"""
from __future__ import annotations

import math
import sys

import pandas as pd

from xlab import intervals, sources
from xlab.shared import (DYNAMIC_PEERS as PEERS_ALL, DYNAMIC_PEERS_BY_FRAMEWORK as PEERS, GIB, INTERVAL_TRIALS,
                         FRONT_END_NAMES, SCALE_TRIALS as TRIALS, SCALED, WORKLOADS, default_arm, ordered)


# --- the dynamic-shape benchmark (xlab.bench.dynamic)
def dynamic_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per (workload, allocator): medians [95% intervals], and ms per step over the fastest peer's (paired)."""
    keys = ["workload", "allocator"]
    order = ordered(df["allocator"])
    df = df.sort_values(keys, key=lambda c: c.map(list(WORKLOADS).index if c.name == "workload" else order.index),
                        kind="stable")
    out = df[keys].drop_duplicates().reset_index(drop=True)
    for col, label, fmt in (("reserved_over_requested", "reserved/requested", "{:.3f}"),
                            ("device_calls_per_step", "calls/step", "{:.3g}"),
                            ("device_calls_per_steady_step", "calls/steady step", "{:.3g}"),
                            ("ms_per_step", "ms/step", "{:.2f}")):
        if col not in df:                      # a CSV from before the steady-state probes
            continue
        s = intervals.summarize(df, keys, col)
        out[label] = [_median(g[col], fmt) for _, g in df.groupby(keys, sort=False)]

    def ratios(r):                             # the arm's ms over the peer's, per trial: the values under 5 pairs
        return [1 / x for x in _pair_ratios(df[df["workload"] == r.workload], r.allocator, r.reference)] \
            if r.n_pairs < INTERVAL_TRIALS else ()
    ratio = {(r.workload, r.allocator): "the fastest peer" if r.allocator == r.reference else
             f"{_ci(r.ratio, r.ratio_lo, r.ratio_hi, r.n_pairs, '{:.3f}', '×', ratios(r))} ({r.reference})" for r in
             intervals.paired_best(df, "ms_per_step", "allocator", PEERS_ALL, ["workload"], False).itertuples()}
    out["ms vs the fastest peer"] = [ratio.get(k, "n/a") for k in zip(out["workload"], out["allocator"])]
    if "bound" in df:
        out["bound (GPU busy)"] = [_bound_label(g) for _, g in df.groupby(keys, sort=False)]
    return out.assign(trials=s["n_trials"])


def _bound_label(g: pd.DataFrame) -> str:
    """What bounds one (workload, allocator)'s steps: its rows' bounds ("host", "gpu", both as "gpu/host"), with NVML's
    GPU utilisation, median [95% interval], where it was sampled: 'host (12% [8, 15])'; "n/a" without either."""
    kinds = sorted({b for b in g["bound"].dropna().astype(str) if b})
    util = g["gpu_util_mean"].dropna() if "gpu_util_mean" in g else pd.Series(dtype=float)
    busy = _median(util, "{:.0f}", "%") if len(util) else ""
    label = "/".join(kinds)
    return (f"{label}, busy {busy}" if "(" in busy else f"{label} ({busy})") if label and busy else \
        label or busy or "n/a"


# --- the scaled runs (xlab.bench.dynamic_scale)
SUMMARY_METRICS = (("reserved_over_requested", "reserved/requested", "{:.3f}"),
                   ("device_calls_per_steady_step", "calls/steady step", "{:.3g}"),
                   ("ms_per_step", "ms/step", "{:.2f}"))
# what measures the rows on a GPU, for a page or notebook that has none of them yet
HOW_TO_MEASURE = "`bash scripts/gpu_suite.sh scale` (`python -m xlab.bench.dynamic_scale`) on one H200"


def _ci(value: float, lo: float, hi: float, n: int, fmt: str, unit: str = "", values=()) -> str:
    """intervals.fmt_ci's 'median [interval]'; over fewer than INTERVAL_TRIALS trials no interval but the values,
    sorted, as the targets print them: '1.022 (no interval: 2 trials, 1.020, 1.024)' (one trial: its value alone)."""
    if n >= INTERVAL_TRIALS or not math.isfinite(value):
        return intervals.fmt_ci(value, lo, hi, fmt, unit)
    if n < 2 or not len(values):
        return f"{fmt.format(value)}{unit}"
    return (f"{fmt.format(value)}{unit} (no interval: {n} trials, "
            + ", ".join(fmt.format(v) for v in sorted(values)) + ")")


def _median(values, fmt: str = "{:.3f}", unit: str = "") -> str:
    clean = [float(v) for v in values if math.isfinite(float(v))]
    return _ci(*intervals.median_ci(values), fmt, unit, clean)


def _pair_ratios(g: pd.DataFrame, arm: str, ref: str, value: str = "ms_per_step") -> list:
    """Per trial both ran: the reference's median `value` over the arm's (the paired ratios behind a speed-up)."""
    per = g[g["allocator"].isin([arm, ref])].groupby(["trial", "allocator"])[value].median().unstack()
    per = per.dropna(subset=[c for c in (arm, ref) if c in per])
    return [] if arm not in per or ref not in per else list(per[ref] / per[arm])


def _ordered(df: pd.DataFrame, keys) -> pd.DataFrame:
    """The rows by `keys`, workloads in SCALED's order and arms in the arms table's."""
    rank = {"workload": list(SCALED).index, "allocator": ordered(df["allocator"]).index}
    return df.sort_values(list(keys), key=lambda c: c.map(rank[c.name]) if c.name in rank else c, kind="stable")


def scale_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per scaled workload and arm: whether it is its front end's default, medians [95% intervals] of memory held,
    device calls per steady step and ms per step, the speed-up over the fastest peer (its ms per step over the arm's,
    paired by trial: above 1 the arm is faster), what bounds the steps (their `bound`, NVML's GPU busy) and the
    trials; an interval "n/a" over fewer than INTERVAL_TRIALS trials."""
    speed, rows = _speedups(df), []
    for (w, a), g in _ordered(df, ["workload", "allocator"]).groupby(["workload", "allocator"], sort=False):
        rows.append({"workload": w, "allocator": a, "xpool's default": "yes" if a == default_arm(g["framework"].iloc[0])
                     else "", **{label: _median(g[col], fmt) for col, label, fmt in SUMMARY_METRICS},
                     "speed-up over the fastest peer": speed.get((w, a), "n/a"), "bound (GPU busy)": _bound(g),
                     "trials": g["trial"].nunique()})
    return pd.DataFrame(rows)


def _speedups(df: pd.DataFrame) -> dict:
    """{(workload, arm): 'speed-up [interval] (the fastest peer)'}, the fastest peer itself 'the fastest peer'."""
    out = {}

    def ratios(r):
        return _pair_ratios(df[df["workload"] == r.workload], r.allocator, r.reference) \
            if r.n_pairs < INTERVAL_TRIALS else ()
    for r in intervals.paired_best(df, "ms_per_step", "allocator", PEERS_ALL, ["workload"], False).itertuples():
        out[r.workload, r.allocator] = "the fastest peer" if r.allocator == r.reference else \
            f"{_ci(1 / r.ratio, 1 / r.ratio_hi, 1 / r.ratio_lo, r.n_pairs, '{:.3f}', '×', ratios(r))} ({r.reference})"
    return out


def _bound(g: pd.DataFrame) -> str:
    """What bounds these rows' steps: their `bound`s ('gpu', 'host', 'gpu/host') and NVML's GPU busy share,
    'gpu (97% [95, 98])'; "n/a" without either."""
    kinds = "/".join(sorted({b for b in g["bound"].dropna().astype(str) if b}))
    util = g["gpu_util_mean"].dropna()
    busy = _median(util, "{:.0f}", "%") if len(util) else ""
    return (f"{kinds}, busy {busy}" if "(" in busy else f"{kinds} ({busy})") if kinds and busy else \
        kinds or busy or "n/a"


def defaults_vs_peers(df: pd.DataFrame) -> pd.DataFrame:
    """Per scaled workload, xpool's default for its front end (default_arm) against the best peer (the lowest
    median reserved/requested), paired by trial: in how many trials the default reserved no more, and both
    reserved/requested medians [95% intervals] (issue #46: no more in at least 4 of 5, and at most 1.05x)."""
    rows = []
    for w, g in df.groupby("workload", sort=False):
        framework = g["framework"].iloc[0]
        mine = g[g["allocator"] == default_arm(framework)]
        peers = g[g["allocator"].isin(PEERS[framework])]
        peer = intervals.best(peers, "reserved_over_requested", "allocator", higher=False)
        if mine.empty or peer is None:
            continue
        theirs = peers[peers["allocator"] == peer]
        a, b = (x.groupby("trial")["peak_reserved_bytes"].median() for x in (mine, theirs))
        trials = a.index.intersection(b.index)
        rows.append({"workload": w, "default": default_arm(framework), "best_peer": peer,
                     "trials_no_more": int((a[trials] <= b[trials]).sum()), "trials": len(trials),
                     "reserved/requested": _median(mine["reserved_over_requested"]),
                     "peer reserved/requested": _median(theirs["reserved_over_requested"])})
    return pd.DataFrame(rows, columns=["workload", "default", "best_peer", "trials_no_more", "trials",
                                       "reserved/requested", "peer reserved/requested"])


def cap_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per (workload, cap, allocator): how many trials finished under the cap, of how many ran (issue #46: under a
    1.10x cap the default finishes every trial of every workload, and no peer finishes more)."""
    keys = ["workload", "cap_over_peak_requested", "allocator"]
    out = (df.assign(completed=df["completed"].astype(bool))
           .groupby(keys, sort=False).agg(is_default=("is_default", "first"), completed=("completed", "sum"),
                                          trials=("trial", "nunique")).reset_index())
    return _ordered(out, keys).reset_index(drop=True)


def cap_grid(df: pd.DataFrame, framework: str) -> pd.DataFrame:
    """cap_summary of `framework`'s workloads as a grid: a row per workload and cap, a column per arm (its front
    end's default named so), each cell the trials it finished of those it ran, 'k/n' ('' where it did not run)."""
    s = cap_summary(df[df["framework"] == framework])
    if s.empty:
        return pd.DataFrame()
    s = s.assign(cell=s["completed"].astype(str) + "/" + s["trials"].astype(str),
                 cap=[f"{c:.2f}×" for c in s["cap_over_peak_requested"]])
    grid = s.pivot_table(index=["workload", "cap"], columns="allocator", values="cell", aggfunc="first", sort=False)
    default = default_arm(framework)
    grid = grid[ordered(grid.columns)].fillna("").rename(columns={default: f"{default}: {FRONT_END_NAMES[framework]}"})
    return grid.reset_index().rename_axis(columns=None)


def trials_said(df: pd.DataFrame) -> str:
    """How many trials the rows hold: '5 trials', or for a run under way '2 of 5 trials so far', with the spread
    per workload and arm (and cap) where it differs, and, where some have fewer than INTERVAL_TRIALS, that they
    have no interval."""
    n = df["trial"].nunique()
    per = df.groupby([c for c in ("workload", "allocator", "cap_over_peak_requested") if c in df])["trial"].nunique()
    text = f"{n} trials" if n >= TRIALS else f"{n} of {TRIALS} trials so far"
    if per.min() != per.max():
        each = "workload, arm and cap" if "cap_over_peak_requested" in df else "workload and arm"
        text += f" ({per.min()}-{per.max()} per {each})"
    if per.min() < INTERVAL_TRIALS:
        text += f"; an interval needs {INTERVAL_TRIALS} trials: none where fewer ran"
    return text


def requested(df: pd.DataFrame) -> str:
    """The peak requested bytes the rows ran at, in GiB: '33-40 GiB requested' ('34 GiB requested': one size)."""
    peaks = df["peak_requested_bytes"].dropna()
    if peaks.empty:
        return "no peak requested counted"
    lo, hi = (f"{v / GIB:.2g}" for v in (peaks.min(), peaks.max()))
    return f"{lo if lo == hi else f'{lo}-{hi}'} GiB requested"


def said(df: pd.DataFrame | None, name: str = "dynamic_scale") -> str:
    """What the rows of data/NAME.csv (dynamic_scale or memory_cap) are, for the report and notebook 06: their CSV
    and commit, machine and date, their trials (a run under way: how many so far) and caps; without rows, that none
    is measured yet and what measures them (HOW_TO_MEASURE)."""
    if df is None or not len(df):
        return f"Not measured yet: {HOW_TO_MEASURE} writes `data/{name}.csv`."
    caps = (f"; caps of {', '.join(f'{c:.2f}×' for c in sorted(df['cap_over_peak_requested'].unique()))} the peak "
            "requested" if "cap_over_peak_requested" in df else "")
    return f"Rows: {sources.sources(df)} ({sources.where(df)}), {trials_said(df)}{caps}."




def main(argv=None) -> int:
    """`dynamic CSV` or `scale CSV [CAP_CSV]`: the tables the report shows of those rows."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] not in ("dynamic", "scale") or len(args) < 2:
        print(__doc__)
        return 2
    df = pd.read_csv(args[1])
    if args[0] == "dynamic":
        print(dynamic_summary(df).to_string(index=False))
        return 0
    if len(df):
        print(scale_summary(df).to_string(index=False))
        vs = defaults_vs_peers(df)
        print(vs.to_string(index=False) if len(vs) else "(no default and peer ran the same workload)")
    caps = pd.read_csv(args[2]) if len(args) > 2 else pd.DataFrame()
    for framework in caps["framework"].unique() if len(caps) else ():
        print(cap_grid(caps, framework).to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
