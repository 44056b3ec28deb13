"""Figures from the measurement CSVs alone: each function takes a DataFrame as read from data/*.csv and
returns a matplotlib Figure; `save` writes figures/NAME.png and .svg.

Figures are drawn on the Agg canvas without pyplot: no global state, no display needed, the same
pixels in a notebook, a script or CI.  Every figure has a title, axis labels with units, and a caption
naming the machine, software and date the numbers come from (the CSV's provenance columns).  Every timed
number is the median over trials with its 95% bootstrap interval as an error bar (xlab.intervals); a CSV with
one run per configuration is drawn without bars and the caption says so.
"""
from __future__ import annotations

import os
import pathlib
import re

import matplotlib
import numpy as np
import pandas as pd
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from . import intervals

PROVENANCE = ("gpu", "driver", "cuda", "cupy", "commit", "date")

# Before (no pool) in grey, the peers in blues, xpool in warm colours and thicker lines.
ALLOCATORS = {
    "raw": dict(label="raw cudaMalloc/cudaFree (no pool)", color="#7f7f7f", marker="x", ls="-", lw=1.6),
    "cupy_pool": dict(label="CuPy MemoryPool (default)", color="#1f77b4", marker="o", ls="-", lw=1.6),
    "cupy_async": dict(label="CuPy MemoryAsyncPool", color="#6baed6", marker="s", ls="-", lw=1.4),
    "raw_held": dict(label="raw, one small block held alive", color="#bdbdbd", marker="+", ls=":", lw=1.4),
    "torch": dict(label="PyTorch caching allocator", color="#17becf", marker="P", ls="-", lw=1.4),
    "xpool": dict(label="xpool (segments: best fit, split, merge)", color="#d62728", marker="D", ls="-", lw=2.6),
    "xpool_norelease": dict(label="xpool, segments never given back on a miss", color="#e377c2", marker="P",
                            ls=":", lw=1.8),
    "xpool_release_all": dict(label="xpool, every whole free segment given back on a miss", color="#ff9896",
                              marker="X", ls="--", lw=1.8),
    "xpool_seed": dict(label="xpool_seed (the design's classes: powers of two)", color="#8c564b", marker="h",
                       ls="-.", lw=2.0),
    "cupy_pool_model": dict(label="CuPy MemoryPool (model, replayed)", color="#1f77b4", marker="o", ls="--", lw=1.6),
    "xpool_k1": dict(label="xpool, 1 class per doubling", color="#d62728", marker="D", ls="-", lw=2.6),
    "xpool_k4": dict(label="xpool, 4 classes per doubling", color="#ff7f0e", marker="^", ls="--", lw=2.6),
    "xpool_k1_debug": dict(label="xpool, debug mode (poison + canaries)", color="#9467bd", marker="v", ls="-.",
                           lw=1.6),
    "cupy_pool_graph": dict(label="CuPy MemoryPool, step as a CUDA graph (private pool)", color="#1f77b4",
                            marker="s", ls="--", lw=1.6, hatch="//"),
    "xpool_graph": dict(label="xpool, step as a CUDA graph (private pool)", color="#d62728", marker="s", ls="--",
                        lw=2.6, hatch="//"),
    "noop": dict(label="floor: Python allocator doing no work", color="#000000", marker="", ls=":", lw=1.2),
    "c_noop": dict(label="floor: C allocator doing no work", color="#555555", marker="", ls="--", lw=1.2),
}
_OTHER_COLORS = ["#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#bcbd22"]
MODES = {"single": "one GPU", "threads": "one thread per GPU (one process)",
         "processes": "one process per GPU"}
PASS_COLOR, FAIL_COLOR = "#2ca02c", "#d62728"


# ---------------------------------------------------------------------------------------------------------
# Shared pieces


def style(allocator: str) -> dict:
    """Label, colour, marker and line for an allocator (stable across every figure).

    Args:
        allocator: a registry name.

    Returns:
        A dict with label, color, marker, ls and lw.
    """
    if allocator in ALLOCATORS:
        return ALLOCATORS[allocator]
    i = sum(map(ord, allocator)) % len(_OTHER_COLORS)
    return dict(label=allocator, color=_OTHER_COLORS[i], marker="o", ls="-", lw=1.4)


def ordered(allocators) -> list[str]:
    """Allocators in the house order (before → peers → xpool), unknown ones last.

    Args:
        allocators: registry names.

    Returns:
        A list.
    """
    known = [a for a in ALLOCATORS if a in set(allocators)]
    return known + sorted(set(allocators) - set(known))


def _short_date(values) -> str:
    days = sorted({str(v)[:10] for v in values if isinstance(v, str) and v})
    if not days:
        return "unknown date"
    return days[0] if len(days) == 1 else f"{days[0]} to {days[-1]}"


def provenance_summary(df: pd.DataFrame) -> dict:
    """Each provenance column's distinct values joined by ' / ' ('unknown' where the column is absent).

    Args:
        df: a measurement frame.

    Returns:
        A dict: gpu, driver, cuda, cupy, commit, date (a day or a range of days) and n_gpus.
    """
    out = {}
    for col in PROVENANCE + ("n_gpus",):
        if col not in df:
            out[col] = "unknown"
        elif col == "date":
            out[col] = _short_date(df[col].dropna())
        else:
            vals = [str(v) for v in pd.unique(df[col].dropna())]
            vals = [v[:-2] if v.endswith(".0") and col == "n_gpus" else v for v in vals]
            out[col] = " / ".join(vals) if vals else "unknown"
    return out


def _machine(p: dict) -> str:
    if p["gpu"] == "none":
        return f"a CPU, no GPU (NumPy) · CuPy {p['cupy']} · commit {p['commit']} · {p['date']}"
    return (f"{p['gpu']} · driver {p['driver']} · CUDA {p['cuda']} · CuPy {p['cupy']} · commit {p['commit']} · "
            f"{p['date']}")


def caption(df: pd.DataFrame, note: str = "") -> str:
    """Lines naming the machine and software the figure's numbers were measured with (one per machine).

    Args:
        df: the frame the figure is drawn from.
        note: a last line (what a point is, what was measured).

    Returns:
        The caption's text.
    """
    if "gpu" in df and df["gpu"].nunique() > 1:
        lines = [f"Measured on {_machine(provenance_summary(g))}" for _, g in df.groupby("gpu", sort=False)]
    else:
        lines = [f"Measured on {_machine(provenance_summary(df))}"]
    return "\n".join(lines + ([note] if note else []))


def _figure(nrows: int = 1, ncols: int = 1, size=(10, 5), **kw):
    fig = Figure(figsize=size, layout="constrained", dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(nrows, ncols, squeeze=False, **kw)
    return fig, axes


def _finish(fig, title: str, df: pd.DataFrame, note: str = "", legend_from=None, ncol: int = 4):
    """Title, caption (machine and date) and, from the axes `legend_from`, one legend for every panel."""
    if legend_from is not None:
        # The figure legend carries the title: constrained layout stacks one 'outside' artist cleanly.
        handles, labels = legend_from.get_legend_handles_labels()
        fig.legend(handles, labels, loc="outside upper center", ncol=min(len(labels), ncol), fontsize=9,
                   frameon=False, title=title, title_fontproperties=dict(size=13, weight="bold"))
    else:
        fig.suptitle(title, fontsize=13, fontweight="bold")
    # supxlabel: the layout engine keeps room for it, so the caption never overlaps axis labels.
    fig.supxlabel(caption(df, note), x=0.005, ha="left", fontsize=8, color="0.3", multialignment="left")
    return fig


def fmt_bytes(n: float) -> str:
    """A byte count for people: '64 KiB', '1.5 MiB', '100 B' (binary units): the lab's one byte formatter.

    Args:
        n: bytes.

    Returns:
        A string.
    """
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.3g} {unit}"
    return f"{n:.0f} B"


def fmt_si(v: float) -> str:
    """A count with k or M: '91.2k', '1.5M'.

    Args:
        v: the number.

    Returns:
        A string.
    """
    for suffix, scale in (("M", 1e6), ("k", 1e3)):
        if abs(v) >= scale:
            return f"{v / scale:.3g}{suffix}"
    return f"{v:.3g}"


def _label_bars(ax, bars, fmt, fontsize=7.5):
    for b in bars:
        h = b.get_height()
        if np.isfinite(h):
            ax.annotate(fmt(h), (b.get_x() + b.get_width() / 2, h), xytext=(0, 2), textcoords="offset points",
                        ha="center", va="bottom", fontsize=fontsize)


def _grouped_bars(ax, table: pd.DataFrame, fmt=fmt_si, log=False, lo=None, hi=None):
    """Bars of table (rows: groups on the x axis, columns: allocators), labelled with their values; lo/hi
    (tables of the same shape) draw each bar's interval."""
    allocs = list(table.columns)
    width = min(0.8 / max(len(allocs), 1), 0.22)      # few allocators: keep bars bar-shaped
    x = np.arange(len(table.index))
    for i, a in enumerate(allocs):
        st = style(a)
        vals = table[a].to_numpy(dtype=float)
        yerr = None
        if lo is not None and hi is not None and a in lo:
            yerr = np.nan_to_num(np.vstack([vals - lo[a].to_numpy(dtype=float),
                                            hi[a].to_numpy(dtype=float) - vals]), nan=0.0).clip(min=0)
        bars = ax.bar(x + (i - (len(allocs) - 1) / 2) * width, vals, width, color=st["color"], label=st["label"],
                      edgecolor="black" if a.startswith("xpool") else "none", linewidth=0.8, yerr=yerr,
                      hatch=st.get("hatch"), error_kw=dict(elinewidth=1, capsize=2, ecolor="0.15"))
        _label_bars(ax, bars, fmt)
    ax.set_xticks(x)
    ax.set_xlim(-0.5, len(x) - 0.5)
    if log:
        ax.set_yscale("log")
    ax.margins(y=0.15)
    ax.grid(axis="y", alpha=0.3)


def _end_labels(ax, points, fmt, min_gap=0.045, log_x=False):
    """Label line ends (x, y, colour) to their right, nudged apart so close values stay readable."""
    lo, hi = ax.get_ylim()
    xlo, xhi = ax.get_xlim()
    gap = min_gap * (hi - lo)
    placed = []
    for x, y, color in sorted(points, key=lambda p: p[1]):
        ty = max(y, placed[-1] + gap) if placed else y
        placed.append(ty)
        tx = x * (xhi / xlo) ** 0.02 if log_x else x + 0.02 * (xhi - xlo)
        ax.text(tx, ty, fmt(y), va="center", fontsize=8, color=color)
    return placed


def _empty(ax, text):
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


def _median(df, keys, cols):
    """Median over trials: one row per key combination."""
    cols = [c for c in cols if c in df]
    return df.groupby(keys, sort=False)[cols].median().reset_index()


def _stat(df, keys, col):
    """Median of `col` over trials with its 95% interval (col_lo, col_hi; NaN for a single run) per key."""
    return intervals.summarize(df, keys, col)


def _yerr(s: pd.DataFrame, col: str) -> np.ndarray:
    """matplotlib's yerr (2 x n, distances below and above) from col_lo/col_hi; 0 where there is no interval."""
    lo = (s[col] - s[f"{col}_lo"]).to_numpy(dtype=float)
    hi = (s[f"{col}_hi"] - s[col]).to_numpy(dtype=float)
    return np.nan_to_num(np.vstack([lo, hi]), nan=0.0).clip(min=0)


def trials_note(df: pd.DataFrame, keys) -> str:
    """The caption's sentence on what a point is: a median of n trials with an interval, or a single run.

    Args:
        df: the frame a panel is drawn from.
        keys: the columns naming one point.

    Returns:
        A sentence.
    """
    n = df.groupby(list(keys), sort=False).size() if len(df) else pd.Series([], dtype=int)
    if "trial" not in df or not len(n) or n.max() < 2:
        return "One row per point in this CSV (measured before every trial was kept): no interval."
    lo, hi = int(n.min()), int(n.max())
    count = f"{lo}" if lo == hi else f"{lo}-{hi}"
    return f"Median of {count} interleaved trials per point; bars: 95% bootstrap interval."


# ---------------------------------------------------------------------------------------------------------
# 01: correctness

_PARAM = re.compile(r"^(wte|wpe|lm_head\.\w+|ln_f\.\w+|h\.\d+\.\S+)$")


def _check_group(name: str) -> str:
    """Per-parameter checks ('torch grad float64 h.0.ln_1.w') collapse to one row showing the worst."""
    head, _, last = name.rpartition(" ")
    return f"{head} (worst parameter)" if head and _PARAM.match(last) else name


def with_device(df: pd.DataFrame) -> pd.DataFrame:
    """A copy with a `device` column ('cpu'/'gpu') filled in where a CSV lacks it, from the array module.

    Args:
        df: correctness rows.

    Returns:
        A new DataFrame.
    """
    df = df.copy()
    guess = (df["xp"].astype(str) == "cupy").map({True: "gpu", False: "cpu"}) if "xp" in df else "cpu"
    df["device"] = df["device"].fillna(guess) if "device" in df else guess
    return df


def correctness(df: pd.DataFrame) -> Figure:
    """Each check's measured error as a multiple of its threshold (log scale; left of 1 passes).

    Exact checks (threshold 0: bitwise identity, mismatch counts) get a row with their verdict instead of
    a bar. Per-parameter checks collapse to their worst parameter. One panel per device ('cpu', 'gpu').

    Args:
        df: correctness rows of one or both devices, as read from the CSV (one row per trial, or the old one row per configuration).

    Returns:
        A matplotlib Figure (Agg canvas).
    """
    df = with_device(df)
    devices = list(pd.unique(df["device"]))
    df["group"] = df["check"].map(_check_group)
    df["ratio"] = np.where(df["threshold"] > 0, df["measured"] / df["threshold"].where(df["threshold"] > 0), 0.0)
    df.loc[df["ratio"].isna(), "ratio"] = np.inf        # NaN never passes: draw it past the line
    df["exact"] = df["threshold"] <= 0
    rows = df.groupby(["device", "group"], sort=False).agg(ratio=("ratio", "max"), passed=("passed", "all"),
                                                           exact=("exact", "all"), measured=("measured", "max"))
    sizes = [len(rows.loc[d]) for d in devices]
    fig = Figure(figsize=(10, 1.3 + 0.2 * sum(sizes) + 0.6 * len(devices)), layout="constrained", dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(devices), 1, squeeze=False, sharex=True, gridspec_kw=dict(height_ratios=sizes))
    finite = df["ratio"][np.isfinite(df["ratio"]) & (df["ratio"] > 0)]
    lo = min(1e-6, finite.min() / 3) if len(finite) else 1e-6
    hi = max(10.0, finite.max() * 3) if len(finite) else 10.0
    for ax, dev in zip(axes[:, 0], devices):
        sub = df[df["device"] == dev]
        ax.set_title(f"{dev.upper()}: {int(sub['passed'].sum())} of {len(sub)} checks pass", fontsize=10, loc="left")
        w = rows.loc[dev].iloc[::-1]
        y = np.arange(len(w))
        tol = ~w["exact"].to_numpy()
        ratios = w["ratio"].clip(lower=lo, upper=hi).to_numpy()
        colors = np.array([PASS_COLOR if p else FAIL_COLOR for p in w["passed"]])
        ax.barh(y[tol], ratios[tol] - lo, left=lo, color=colors[tol], height=0.7)
        for yi, r, exact, passed, measured in zip(y, w["ratio"], w["exact"], w["passed"], w["measured"]):
            if exact:
                txt = "exact: measured 0 ✓" if passed else f"exact: measured {measured:g}, must be 0 ✗"
                ax.annotate(txt, (lo, yi), xytext=(3, 0), textcoords="offset points", va="center", fontsize=7,
                            color=PASS_COLOR if passed else FAIL_COLOR, fontweight="bold")
                continue
            txt = "0" if r == 0 else ("NaN" if not np.isfinite(r) else f"{r:.1g}")
            ax.annotate(txt, (max(min(r, hi), lo), yi), xytext=(3, 0), textcoords="offset points",
                        va="center", fontsize=7)
        ax.set_yticks(y, [g if len(g) <= 70 else g[:67] + "..." for g in w.index], fontsize=7.5)
        ax.set_xscale("log")
        ax.set_xlim(lo, hi)
        ax.set_ylim(-0.7, len(w) - 0.3)
        ax.axvline(1.0, color="black", lw=1.2)
        ax.text(1.15, 0.99, "threshold", transform=ax.get_xaxis_transform(), va="top", fontsize=8)
        ax.grid(axis="x", alpha=0.3)
        ax.tick_params(labelbottom=True)
    axes[-1, 0].set_xlabel("measured error / threshold (dimensionless, log scale; below 1 passes)")
    return _finish(fig, "Correctness gate: every check's error against its threshold", df,
                   "Bars: each check's error in multiples of its threshold (per-parameter checks: the worst "
                   "parameter); green passes, red fails.")


# ---------------------------------------------------------------------------------------------------------
# 02: allocator microbenchmark


def _size_axis(ax, sizes):
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [fmt_bytes(s) for s in sizes])
    ax.xaxis.set_minor_formatter(NullFormatter())


def _sweep(df: pd.DataFrame, name: str) -> pd.DataFrame:
    """The rows of one sweep of xlab.bench.alloc ('size' or 'threads'). The two sweeps both have a
    one-thread 64 KiB case, timed differently (main thread vs a worker), so they must not be pooled."""
    if "sweep" in df:
        return df[df["sweep"] == name]
    return df[df["threads"] == df["threads"].min()] if name == "size" else df


def alloc_cost(df: pd.DataFrame) -> Figure:
    """µs per alloc/free pair against request size (one thread), and each allocator's time over CuPy's pool's
    in the same trial; medians over trials with 95% intervals.

    Args:
        df: xlab.bench.alloc rows, as read from the CSV (one row per trial, or the old one row per configuration).

    Returns:
        A matplotlib Figure (Agg canvas).
    """
    one = _sweep(df, "size")
    m = _stat(one, ["allocator", "size_bytes"], "us_per_pair")
    if "ratio_vs_cupy_pool" in one:
        rel_df = _stat(one.assign(time_vs_cupy_pool=1 / one["ratio_vs_cupy_pool"]), ["allocator", "size_bytes"],
                       "time_vs_cupy_pool")
    else:
        rel_df = pd.DataFrame(columns=["allocator", "size_bytes", "time_vs_cupy_pool", "time_vs_cupy_pool_lo",
                                       "time_vs_cupy_pool_hi"])
    has_ref = (m["allocator"] == "cupy_pool").any()
    sizes = sorted(m["size_bytes"].unique())
    fig, axes = _figure(1, 2, size=(13, 5.2))
    ax, rel = axes[0]
    for a in ordered(m["allocator"].unique()):
        s = m[m["allocator"] == a].sort_values("size_bytes")
        st = style(a)
        kw = dict(color=st["color"], marker=st["marker"], ls=st["ls"], lw=st["lw"], label=st["label"], capsize=2)
        ax.errorbar(s["size_bytes"], s["us_per_pair"], yerr=_yerr(s, "us_per_pair"), **kw)
        r = rel_df[rel_df["allocator"] == a].sort_values("size_bytes")
        if a not in ("raw", "raw_held", "cupy_pool") and r["time_vs_cupy_pool"].notna().any():
            rel.errorbar(r["size_bytes"], r["time_vs_cupy_pool"], yerr=_yerr(r, "time_vs_cupy_pool"), **kw)
    _size_axis(ax, sizes)
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("request size (bytes, log scale)")
    ax.set_ylabel("µs per alloc/free pair (log scale; lower is faster)")
    ax.set_title("Cost of a = cupy.empty(n, uint8); del a, one thread")
    ax.grid(alpha=0.3, which="both")
    _size_axis(rel, sizes)
    if has_ref:
        rel.axhline(1.0, color=style("cupy_pool")["color"], lw=1.6)
        rel.text(0.01, 1.0, "CuPy MemoryPool = 1", transform=rel.get_yaxis_transform(), ha="left", va="bottom",
                 fontsize=8, color=style("cupy_pool")["color"])
        rel.set_ylim(bottom=0)
    else:
        _empty(rel, "CuPy MemoryPool not measured: no reference")
    rel.set_xlabel("request size (bytes, log scale)")
    rel.set_ylabel("time per pair / CuPy MemoryPool's, same trial (below 1: faster)")
    rel.set_title("Relative to the default CuPy pool (raw cudaMalloc left out: off the scale)")
    rel.grid(alpha=0.3)
    return _finish(fig, "Allocator cost per allocation: xpool against its peers and raw cudaMalloc", df,
                   trials_note(one, ["allocator", "size_bytes"]) + " Each point times many alloc/free pairs "
                   "through CuPy's array path.", legend_from=ax)


def _thread_size(df, size_bytes):
    if size_bytes is not None and (df["size_bytes"] == size_bytes).any():
        return size_bytes
    multi = df.groupby("size_bytes")["threads"].nunique()
    multi = multi[multi == multi.max()]
    return 65536 if 65536 in multi.index else int(multi.index[len(multi) // 2])


def alloc_threads(df: pd.DataFrame, size_bytes: int | None = None) -> Figure:
    """Thousands of alloc/free pairs per second (all threads together) against threads on one GPU.

    Args:
        df: xlab.bench.alloc rows.
        size_bytes: the request size to draw (default: 64 KiB, or the size measured at most thread counts).

    Returns:
        A matplotlib Figure (Agg canvas).
    """
    df = _sweep(df, "threads")
    size = _thread_size(df, size_bytes)
    sized = df[df["size_bytes"] == size]
    s = _stat(sized, ["allocator", "threads"], "kpairs_per_s")
    threads = sorted(s["threads"].unique())
    fig, axes = _figure(1, 1, size=(9, 5.2))
    ax = axes[0][0]
    ends = []
    for a in ordered(s["allocator"].unique()):
        t = s[s["allocator"] == a].sort_values("threads")
        st = style(a)
        ax.errorbar(t["threads"], t["kpairs_per_s"], yerr=_yerr(t, "kpairs_per_s"), color=st["color"],
                    marker=st["marker"] or "o", ls=st["ls"], lw=st["lw"], label=st["label"], capsize=2)
        last = t.iloc[-1]
        ends.append((last["threads"], last["kpairs_per_s"], st["color"]))
    ax.set_xscale("log", base=2)
    ax.set_xticks(threads, [str(t) for t in threads])
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_ylim(0, 1.08 * np.nanmax(np.r_[s["kpairs_per_s"], s["kpairs_per_s_hi"]]))
    ax.set_xlim(min(threads) / 1.15, max(threads) * 1.3)
    _end_labels(ax, ends, lambda v: f"{v:.0f}k", log_x=True)
    ax.set_xlabel("threads allocating on the same GPU")
    ax.set_ylabel("thousand alloc/free pairs per second (all threads)")
    ax.set_title(f"{fmt_bytes(size)} requests; higher is better, flat or rising means no lock contention")
    ax.grid(alpha=0.3)
    return _finish(fig, "Several threads on one GPU: allocation throughput", df,
                   trials_note(sized, ["allocator", "threads"]), legend_from=ax, ncol=3)


# ---------------------------------------------------------------------------------------------------------
# 03: single GPU


def _by_batch(df, col):
    """(median, lo, hi) tables: rows batch (largest first), columns allocators in house order."""
    s = _stat(df, ["batch", "allocator"], col)
    out = []
    for c in (col, f"{col}_lo", f"{col}_hi"):
        t = s.pivot(index="batch", columns="allocator", values=c).sort_index(ascending=False)
        out.append(t[ordered(t.columns)])
    return out


def single_gpu(df: pd.DataFrame) -> Figure:
    """Tokens/s, GPU utilisation, device mallocs per step and peak reserved/requested, per allocator and batch.

    Args:
        df: single_gpu rows, as read from the CSV (one row per trial, or the old one row per configuration).

    Returns:
        A matplotlib Figure (Agg canvas).
    """
    d = df[df["mode"] == "single"] if "mode" in df and (df["mode"] == "single").any() else df
    fig, axes = _figure(3, 2, size=(13, 12.5))
    panels = [
        ("tokens_per_s", "tokens per second (higher is better)", "Training throughput", fmt_si, False),
        ("host_ms_per_step", "ms of the dispatching thread's CPU time per step",
         "Host work per step (thread CPU time)", lambda v: f"{v:.0f}", False),
        ("gpu_ms_per_step", "ms per step on the GPU's stream (CUDA events)",
         "Step span on the GPU stream (= wall time when host-bound)", lambda v: f"{v:.0f}", False),
        ("gpu_util_mean", "mean GPU utilisation (%)", "GPU busy (NVML utilisation, mean over timed steps)",
         lambda v: f"{v:.0f}%", False),
        ("device_mallocs_per_step", "cudaMalloc calls per step (log scale)",
         "Device mallocs per training step (after warm-up)", lambda v: f"{v:.4g}", True),
        ("reserved_over_requested", "peak reserved / peak requested bytes",
         "Memory overhead: reserved vs requested at the peak", lambda v: f"{v:.2f}", False),
    ]
    for ax, (col, ylabel, title, fmt, log) in zip(axes.flat, panels):
        if col not in d or d[col].isna().all():
            _empty(ax, f"no {col} in the CSV")
            ax.set_title(title)
            continue
        t, lo, hi = _by_batch(d, col)
        if log:
            t, lo, hi = t.clip(lower=0.5), None, None  # exact counts: no interval; 0 drawn as a stub, relabelled
        _grouped_bars(ax, t, fmt=(lambda v: "0" if v <= 0.5 else fmt(v)) if log else fmt, log=log, lo=lo, hi=hi)
        ax.set_xticklabels([f"batch {b}" for b in t.index])
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        if col == "tokens_per_s":
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt_si(v)))
        if log:
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        if col == "reserved_over_requested":
            ax.axhline(1.0, color="black", lw=0.8)
            ax.set_ylim(bottom=min(0.9, float(np.nanmin(t.to_numpy())) - 0.05))
    return _finish(fig, "One GPU: the small GPT's training step under each allocator", df,
                   trials_note(d, ["batch", "allocator"]) + " Each trial times the steps after warm-up; a pool's "
                   "0 mallocs per step are drawn as a stub.", legend_from=axes[0][0])


# ---------------------------------------------------------------------------------------------------------
# 04: several GPUs


def _modes(df):
    return [m for m in ("threads", "processes") if m in set(df["mode"])] or list(pd.unique(df["mode"]))


def _scaling_frame(df):
    """Multi-GPU rows plus, for every mode, the single-GPU rows as its world=1 point."""
    d = df.copy()
    single = d[d["mode"] == "single"]
    parts = [d[d["mode"] != "single"]]
    for m in _modes(d[d["mode"] != "single"]) if (d["mode"] != "single").any() else []:
        have1 = ((d["mode"] == m) & (d["world"] == 1)).any()
        if not have1 and len(single):
            parts.append(single.assign(mode=m))
    return pd.concat(parts, ignore_index=True)


def ddp_scaling(df: pd.DataFrame) -> Figure:
    """Tokens/s and speedup against the number of GPUs: one column per mode (threads, processes); medians over
    trials with 95% intervals (a speedup is trial t on N GPUs over trial t on one).

    Args:
        df: ddp_scaling rows (single_gpu rows may stand in for world 1), as read from the CSV (one row per trial, or the old one row per configuration).

    Returns:
        A matplotlib Figure (Agg canvas).
    """
    d = _scaling_frame(df)
    modes = _modes(d)
    fig, axes = _figure(2, len(modes), size=(6.5 * len(modes), 8.5), sharey="row")
    worlds = sorted(d["world"].unique())
    ends = []                                 # (column, world, speedup, colour) of each line's last point
    for j, mode in enumerate(modes):
        sub = d[d["mode"] == mode]
        tps = _stat(sub, ["allocator", "world"], "tokens_per_s")
        spd = _stat(sub, ["allocator", "world"], "speedup")
        top, bottom = axes[0][j], axes[1][j]
        for a in ordered(tps["allocator"].unique()):
            st = style(a)
            kw = dict(color=st["color"], marker=st["marker"] or "o", ls=st["ls"], lw=st["lw"], label=st["label"],
                      capsize=2)
            s = tps[tps["allocator"] == a].sort_values("world")
            top.errorbar(s["world"], s["tokens_per_s"], yerr=_yerr(s, "tokens_per_s"), **kw)
            s = spd[spd["allocator"] == a].sort_values("world")
            bottom.errorbar(s["world"], s["speedup"], yerr=_yerr(s, "speedup"), **kw)
            last = s.iloc[-1]
            ends.append((j, last["world"], last["speedup"], st["color"]))
        bottom.plot(worlds, worlds, color="black", ls="--", lw=0.8, label="ideal (linear)")
        top.set_title(MODES.get(mode, mode), fontsize=11)
        for ax in (top, bottom):
            ax.set_xticks(worlds, [str(w) for w in worlds])
            ax.set_xlabel("GPUs")
            ax.grid(alpha=0.3)
            ax.set_xlim(min(worlds) - 0.2, max(worlds) + 0.5)
        top.yaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt_si(v)))
    axes[0][0].set_ylim(0, 1.08 * d["tokens_per_s"].max())
    axes[1][0].set_ylim(0, 1.08 * max(d["speedup"].max(), max(worlds)))
    for j in range(len(modes)):
        _end_labels(axes[1][j], [(w, v, c) for jj, w, v, c in ends if jj == j], lambda v: f"{v:.2f}×")
    axes[0][0].set_ylabel("tokens per second, all GPUs (higher is better)")
    axes[1][0].set_ylabel("speedup over the same allocator on 1 GPU (×)")
    batch = ", ".join(str(b) for b in sorted(d["batch"].unique())) if "batch" in d else "?"
    return _finish(fig, "Several GPUs: data-parallel training throughput and speedup", df,
                   f"Batch {batch} per GPU; gradients all-reduced with NCCL each step. "
                   + trials_note(d, ["mode", "allocator", "world"]), legend_from=axes[1][0], ncol=3)


def ddp_before_after(df: pd.DataFrame) -> Figure:
    """Before/after at the largest world: speedup and GPU utilisation per mode and allocator.

    Args:
        df: ddp_scaling rows, as read from the CSV (one row per trial, or the old one row per configuration).

    Returns:
        A matplotlib Figure (Agg canvas).
    """
    d = _scaling_frame(df)
    d = d[d["mode"] != "single"]
    world = int(d["world"].max())
    top = d[d["world"] == world]
    modes = _modes(top)
    fig, axes = _figure(1, 2, size=(13, 5.2))
    sp, ut = axes[0]
    for ax, col, ylabel, fmt in ((sp, "speedup", f"speedup on {world} GPUs over 1 GPU (×)", lambda v: f"{v:.2f}×"),
                                 (ut, "gpu_util_mean", "mean GPU utilisation (%)", lambda v: f"{v:.0f}%")):
        if col not in top or top[col].isna().all():
            _empty(ax, f"no {col} in the CSV")
            continue
        st = _stat(top, ["mode", "allocator"], col)
        t, lo, hi = [st.pivot(index="mode", columns="allocator", values=c) for c in (col, f"{col}_lo", f"{col}_hi")]
        keep = [m for m in modes if m in t.index]
        cols = ordered(t.columns)
        _grouped_bars(ax, t.loc[keep, cols], fmt=fmt, lo=lo.loc[keep, cols], hi=hi.loc[keep, cols])
        ax.set_xticklabels([MODES.get(m, m) for m in t.index], fontsize=9)
        ax.set_ylabel(ylabel)
    sp.axhline(world, color="black", ls="--", lw=0.8)
    sp.text(-0.45, world, f"ideal {world}×", va="bottom", fontsize=8)
    sp.set_title(f"Speedup on {world} GPUs: before (raw cudaMalloc) → after (a pool)", fontsize=10)
    ut.set_title(f"GPU utilisation on {world} GPUs", fontsize=10)
    ut.set_ylim(0, 110)
    return _finish(fig, f"{world} GPUs: what the allocator changes", df, trials_note(top, ["mode", "allocator"]),
                   legend_from=sp)


# ---------------------------------------------------------------------------------------------------------
# 04: batch sweep


def batch_sweep(df: pd.DataFrame) -> Figure:
    """Threads on N GPUs against 1, by per-GPU batch: the speedup (median, 95% interval), and the one-GPU step's
    host work against its GPU work, whose crossing is where the host bound ends.

    Args:
        df: batch_sweep rows, as read from the CSV (one row per trial, or the old one row per configuration).

    Returns:
        A matplotlib Figure (Agg canvas).
    """
    d = df[df["mode"] == "threads"] if "mode" in df else df
    world = int(d["world"].max())
    fig, axes = _figure(1, 2, size=(13, 5.4))
    sp, ms = axes[0]
    top = d[d["world"] == world]
    spd = _stat(top, ["allocator", "batch"], "speedup")
    batches = sorted(d["batch"].unique())
    for a in ordered(spd["allocator"].unique()):
        s = spd[spd["allocator"] == a].sort_values("batch")
        st = style(a)
        sp.errorbar(s["batch"], s["speedup"], yerr=_yerr(s, "speedup"), color=st["color"], marker=st["marker"] or "o",
                    ls=st["ls"], lw=st["lw"], label=st["label"], capsize=2)
    sp.axhline(world, color="black", ls="--", lw=0.8)
    sp.text(batches[0], world, f" ideal {world}×", va="bottom", fontsize=8)
    sp.set_ylim(0, 1.15 * np.nanmax(np.r_[world, spd["speedup"], spd["speedup_hi"]]))
    sp.set_ylabel(f"speedup, {world} GPUs over 1 (same trial)")
    sp.set_title(f"One thread per GPU, {world} GPUs: speedup by per-GPU batch", fontsize=10)
    one = d[d["world"] == 1]
    pools = [a for a in ordered(one["allocator"].unique()) if a != "raw"]
    if pools and {"host_ms_per_step", "gpu_busy_ms_per_step"} <= set(one.columns):
        a = pools[-1] if any(p.startswith("xpool") for p in pools) else pools[0]
        a = next((p for p in pools if p.startswith("xpool")), a)
        mine = one[one["allocator"] == a]
        for col, label, color in (("host_ms_per_step", "host: dispatching thread's CPU time", "#6a3d9a"),
                                  ("gpu_busy_ms_per_step", "GPU: busy time (wall x NVML utilisation)", "#33a02c")):
            s = _stat(mine, ["batch"], col).sort_values("batch")
            ms.errorbar(s["batch"], s[col], yerr=_yerr(s, col), color=color, marker="o", label=label, capsize=2)
        ms.set_title(f"Where the host bound ends: one GPU, {style(a)['label']}", fontsize=10)
        ms.legend(fontsize=8, loc="upper left")
        ms.set_yscale("log")
        ms.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
        ms.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ms.yaxis.set_minor_formatter(NullFormatter())
    else:
        _empty(ms, "no host/GPU ms per step in the CSV")
    ms.set_ylabel("ms per step (log scale)")
    for ax in (sp, ms):
        ax.set_xscale("log", base=2)
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("sequences per GPU per step (log scale)")
        ax.grid(alpha=0.3)
    return _finish(fig, "Batch sweep: where one thread per GPU starts to scale", df,
                   "Two threads share one GIL: while a step's host work exceeds half its GPU work the speedup stays "
                   "near 1. " + trials_note(d, ["allocator", "world", "batch"]), legend_from=sp, ncol=3)


# ---------------------------------------------------------------------------------------------------------
# 05: memory


def memory_waste(df: pd.DataFrame) -> Figure:
    """Waste per size-class setting: class bytes over requested bytes, and peak reserved over peak requested.

    Args:
        df: memory_waste rows (measured, or replayed).

    Returns:
        A matplotlib Figure (Agg canvas).
    """
    src = "measured" if "source" in df and (df["source"] == "measured").any() else None
    d = df[df["source"] == src] if src else df
    d = d.groupby("k", sort=True)[["class_over_requested", "reserved_over_requested"]].median()
    fig, axes = _figure(1, 1, size=(9, 5.2))
    ax = axes[0][0]
    x = np.arange(len(d.index))
    w = 0.38
    for off, col, color, label in (
            (-w / 2, "class_over_requested", "#ff7f0e", "size classes: bytes handed out / bytes requested, "
                                                        "one step's requests"),
            (w / 2, "reserved_over_requested", "#d62728", "peak bytes reserved / peak bytes requested, "
                                                          "whole run")):
        waste = 100 * (d[col].to_numpy(dtype=float) - 1)
        bars = ax.bar(x + off, waste, w, color=color, label=label)
        _label_bars(ax, bars, lambda v: f"{v:.1f}%" if v >= 1 else f"{v:.2g}%", fontsize=8.5)
    ax.set_xticks(x, [f"k = {k}" for k in d.index])
    ax.set_xlabel("size classes per doubling above 1 MiB (xpool's classes_per_doubling)")
    ax.set_ylabel("waste: bytes beyond the request (% of requested)")
    ax.set_title("Bytes the pool holds beyond what the arrays asked for (lower is better)", fontsize=10)
    ax.set_ylim(bottom=0)
    ax.margins(y=0.15)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8.5, loc="upper right")
    how = "measured with xpool installed" if src else "replayed on the CPU from the recorded request trace"
    return _finish(fig, "Memory waste by size-class setting on the GPT training run", df,
                   f"Numbers {how}.")


def trace_label(name: str) -> str:
    """A recorded trace's name as a short two-line tick label: 'gpt_b32_perparam_numpy' -> 'b32 perparam\n(NumPy)'."""
    base = name[4:] if name.startswith("gpt_") else name
    for suffix, where in (("_cupy_path_numpy", "CuPy path"), ("_numpy", "NumPy"), ("_gpu", "GPU")):
        if base.endswith(suffix):
            return f"{base[:-len(suffix)].replace('_', ' ')}\n({where})"
    return base.replace("_", " ")


def memory_schemes(df: pd.DataFrame) -> Figure:
    """Per recorded trace and allocator: peak reserved over peak requested (replayed), and ns per
    alloc+free pair over the host backend (xpool's schemes only)."""
    traces = list(dict.fromkeys(df["trace"]))
    labels = [trace_label(t) for t in traces]
    allocs = [a for a in ordered(df["allocator"].unique())]
    fig, axes = _figure(1, 2, size=(14, 5.6))
    ax, cost = axes[0]
    waste = df.pivot_table(index="trace", columns="allocator", values="reserved_over_requested",
                           aggfunc="median").reindex(index=traces, columns=allocs)
    # log scale: the seed scheme's 50-170% beside the segments' 0.2-3% would flatten the bars that matter
    _grouped_bars(ax, (100 * (waste - 1)).clip(lower=0.01), fmt=lambda v: f"{v:.0f}%" if v >= 10 else f"{v:.1f}%",
                  log=True)
    ax.set_xticklabels(labels, fontsize=8.5)
    ax.set_ylabel("peak reserved / peak requested − 1 (%, log)")
    ax.set_title("Memory held beyond the arrays' peak, replayed on the CPU", fontsize=10)
    c = df.dropna(subset=["ns_per_pair"])
    if len(c):
        med = c.pivot_table(index="trace", columns="allocator", values="ns_per_pair").reindex(index=traces)
        lo = c.pivot_table(index="trace", columns="allocator", values="ns_per_pair_min").reindex(index=traces)
        hi = c.pivot_table(index="trace", columns="allocator", values="ns_per_pair_max").reindex(index=traces)
        cols = [a for a in allocs if a in med.columns]
        width = min(0.8 / max(len(cols), 1), 0.22)
        x = np.arange(len(traces))
        for i, a in enumerate(cols):
            st = style(a)
            m = med[a].to_numpy(dtype=float)
            err = np.vstack([m - lo[a].to_numpy(dtype=float), hi[a].to_numpy(dtype=float) - m])
            bars = cost.bar(x + (i - (len(cols) - 1) / 2) * width, m, width, yerr=err, capsize=3,
                            color=st["color"], edgecolor="black", linewidth=0.8)
            _label_bars(cost, bars, lambda v: f"{v:.0f}")
        cost.set_xticks(x, labels, fontsize=8.5)
        cost.margins(y=0.15)
        cost.grid(axis="y", alpha=0.3)
        cost.set_ylabel("ns per alloc+free pair, C core (Python floor subtracted)")
        cost.set_title("Cost of the last step's requests once warm, host backend\n"
                       "(CuPy's pool needs a GPU: see the allocator microbenchmark)", fontsize=10)
    else:
        _empty(cost, "no cost measured")
    return _finish(fig, "Memory waste and allocation cost of each scheme on the recorded request traces", df,
                   "Waste: every trace replayed, in order, through each pool (CuPy's as a model of its arena); "
                   "cost: median with min–max over interleaved repeats.", legend_from=ax)


def _requested_in_use(tl: pd.DataFrame) -> np.ndarray:
    """Requested bytes held by live blocks after each event (allocs add, frees subtract)."""
    sign = np.select([tl["event"].isin(["alloc_hit", "alloc_miss"]), tl["event"] == "free"], [1, -1], 0)
    return np.cumsum(sign * tl["requested"].to_numpy(dtype=float))


def memory_timeline(df: pd.DataFrame, step: int | None = None) -> Figure:
    """Bytes reserved, in use and requested over the recorded run (by event), and over one step (in time).

    Args:
        df: a memory_timeline frame (xpool's timeline with a step column; the first k if several).
        step: the step to zoom into (default: the last).

    Returns:
        A matplotlib Figure (Agg canvas).
    """
    tl = df
    if "k" in tl and tl["k"].nunique() > 1:
        tl = tl[tl["k"] == tl["k"].iloc[0]]
    tl = tl.reset_index(drop=True)               # the CSV keeps the timeline's own (recorded) order
    req = _requested_in_use(tl) / 2**30
    steps = sorted(tl["step"].unique()) if "step" in tl else [0]
    step = steps[-1] if step is None else step
    fig, axes = _figure(2, 1, size=(12, 8.5))
    whole, zoom = axes[0][0], axes[1][0]

    def draw(ax, sel, x):
        ax.fill_between(x, 0, tl["bytes_in_use"][sel] / 2**30, step="post", color="#fdae6b", alpha=0.8,
                        label="in use: size-class bytes of live blocks")
        ax.step(x, req[sel.to_numpy()], where="post", color="#2171b5", lw=1.2, label="requested by live arrays")
        ax.step(x, tl["bytes_reserved"][sel] / 2**30, where="post", color="#d62728", lw=2,
                label="reserved from the device (in use + cached)")
        miss = (tl["event"][sel] == "alloc_miss").to_numpy()
        if miss.any():          # a rug along the top: where the pool had to call cudaMalloc
            ax.plot(np.asarray(x)[miss], np.full(int(miss.sum()), 0.985), "|", color="black", ms=6, alpha=0.5,
                    transform=ax.get_xaxis_transform(), label="cudaMalloc (a pool miss), rug along the top")
        ax.set_ylabel("GiB")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)

    everything = pd.Series(True, index=tl.index)
    draw(whole, everything, tl.index.to_numpy())
    whole.set_xlabel("allocator events (allocs and frees), in order")
    if "step" in tl:
        for s in steps:
            first = tl.index[tl["step"] == s]
            if len(first):
                whole.axvline(first[0], color="0.4", lw=0.8, ls=":")
                whole.text(first[0], 0.03, "setup " if s < 0 else f" step {s}", transform=whole.get_xaxis_transform(),
                           fontsize=8, va="bottom", ha="right" if s < 0 else "left", color="0.25")
    whole.set_title("Whole recording: building the model and optimizer, then training steps "
                    "(dotted lines: where each begins)", fontsize=10)
    whole.legend(fontsize=8, loc="best")
    sel = tl["step"] == step if "step" in tl else everything
    if sel.any():
        t = tl["t_s"][sel]
        draw(zoom, sel, ((t - t.iloc[0]) * 1e3).to_numpy())
        zoom.set_xlabel("time from the step's first allocation (ms, host clock)")
        n_alloc = int((sel & tl["event"].isin(["alloc_hit", "alloc_miss"])).sum())
        n_miss = int((sel & (tl["event"] == "alloc_miss")).sum())
        zoom.set_title(f"The recorded training step (step {step}): {n_alloc} allocations, {n_miss} cudaMalloc",
                       fontsize=10)
    else:
        _empty(zoom, f"no events in step {step}")
    k = int(tl["k"].iloc[0]) if "k" in tl else None
    return _finish(fig, "Device memory during training, from xpool's allocation timeline", df,
                   f"xpool with {k} size class{'es' if k != 1 else ''} per doubling." if k else "")


# ---------------------------------------------------------------------------------------------------------
# Saving, and every figure from data/


def save(fig: Figure, name: str, figures_dir: str | os.PathLike = "figures"):
    """Write figures/NAME.png and figures/NAME.svg (no timestamps inside, so unchanged data gives unchanged
    files); returns both paths.

    Args:
        fig: the figure.
        name: the file name without extension.
        figures_dir: the folder (made if missing).

    Returns:
        (png path, svg path).
    """
    out = pathlib.Path(figures_dir)
    out.mkdir(parents=True, exist_ok=True)
    png, svg = out / f"{name}.png", out / f"{name}.svg"
    with matplotlib.rc_context({"svg.hashsalt": "xpool", "svg.fonttype": "none"}):
        fig.savefig(png, dpi=110, metadata={"Software": None})
        fig.savefig(svg, metadata={"Date": None, "Creator": None})
    return png, svg


# name -> (CSV names it needs, all of them, function of the concatenated frame)
# ---------------------------------------------------------------------------------------------------------
# CUDA graphs: the step's host work


def graph_steps(df: pd.DataFrame) -> Figure:
    """Eager steps against steps captured as CUDA graphs (issue 13): threads on the largest world at batch 32,
    the host's work per step on one GPU (thread CPU time of a step started on an idle device), and GPU
    utilisation on one GPU at the smallest batch.

    Args:
        df: training rows (train.COLUMNS) of data/graph/: single-GPU rows at two batches and threads rows.

    Returns:
        A matplotlib Figure (Agg canvas).
    """
    fig, axes = _figure(1, 3, size=(16, 5.4))
    sp, disp, util = axes[0]
    thr = df[(df["mode"] == "threads") & (df["world"] == df["world"].max())] if "mode" in df else df.iloc[:0]
    single = df[df["mode"] == "single"] if "mode" in df else df.iloc[:0]
    panels = [(sp, thr, "speedup", "batch", lambda v: f"{v:.2f}×"),
              (disp, single, "dispatch_ms_per_step", "batch", lambda v: f"{v:.1f}"),
              (util, single[single["batch"] == single["batch"].min()] if len(single) else single, "gpu_util_mean",
               "batch", lambda v: f"{v:.0f}%")]
    for ax, d, col, group, fmt in panels:
        if not len(d) or col not in d or d[col].isna().all():
            _empty(ax, f"no {col} rows")
            continue
        st = _stat(d, [group, "allocator"], col)
        t, lo, hi = [st.pivot(index=group, columns="allocator", values=c) for c in (col, f"{col}_lo", f"{col}_hi")]
        cols = ordered(t.columns)
        _grouped_bars(ax, t[cols], fmt=fmt, lo=lo[cols], hi=hi[cols], log=ax is disp)
        ax.set_xticklabels([f"batch {b}" for b in t.index], fontsize=9)
    if len(thr):
        world = int(thr["world"].max())
        sp.axhline(world, color="black", ls="--", lw=0.8)
        sp.set_ylabel(f"speedup, {world} GPUs over 1 (×)")
        sp.set_title(f"One thread per GPU, {world} GPUs", fontsize=10)
    disp.set_ylabel("host ms per step (thread CPU time, idle device; log)")
    disp.set_title("One GPU: the host's work per step", fontsize=10)
    util.set_ylabel("GPU utilisation, NVML (%)")
    util.set_ylim(0, 110)
    util.set_title("One GPU, smallest batch: how busy the GPU is", fontsize=10)
    keys = ["mode", "world", "batch", "allocator"] if "mode" in df else ["batch", "allocator"]
    return _finish(fig, "The training step as a CUDA graph: eager against captured", df,
                   trials_note(df, [k for k in keys if k in df]), legend_from=sp, ncol=3)


FIGURES = {
    "correctness": (("correctness_cpu", "correctness_gpu"), correctness),
    "alloc_cost": (("alloc_microbench",), alloc_cost),
    "alloc_threads": (("alloc_microbench",), alloc_threads),
    "single_gpu": (("single_gpu",), single_gpu),
    "ddp_scaling": (("ddp_scaling",), ddp_scaling),
    "ddp_before_after": (("ddp_scaling",), ddp_before_after),
    "batch_sweep": (("batch_sweep",), batch_sweep),
    "memory_waste": (("memory_waste",), memory_waste),
    "memory_timeline": (("memory_timeline",), memory_timeline),
    "memory_schemes": (("memory_schemes",), memory_schemes),
    "graph_steps": (("graph/single_gpu", "graph/single_gpu_b4", "graph/ddp_scaling"), graph_steps),
}


def load_for(name: str, data_dir: str | os.PathLike = "data") -> pd.DataFrame | None:
    """The frame figure `name` is drawn from: its CSVs concatenated (those present), or None.

    Args:
        name: a key of FIGURES.
        data_dir: the CSV folder.

    Returns:
        A DataFrame, or None.
    """
    frames = [pd.read_csv(p) for csv in FIGURES[name][0] if (p := pathlib.Path(data_dir) / f"{csv}.csv").is_file()]
    return pd.concat(frames, ignore_index=True) if frames else None


def build_all(data_dir: str | os.PathLike = "data", figures_dir: str | os.PathLike = "figures") -> dict:
    """Every figure whose CSV exists; returns name -> PNG path, or the reason it was skipped.

    Args:
        data_dir: the CSV folder.
        figures_dir: where the PNG and SVG files go.

    Returns:
        A dict: figure name -> PNG path, or a string saying why it was skipped or failed.
    """
    out = {}
    for name, (csvs, fn) in FIGURES.items():
        df = load_for(name, data_dir)
        if df is None:
            out[name] = f"skipped: {' / '.join(c + '.csv' for c in csvs)} missing"
            continue
        try:
            out[name] = save(fn(df), name, figures_dir)[0]
        except Exception as e:                # one bad CSV must not cost the other figures
            out[name] = f"failed: {type(e).__name__}: {e}"
    return out
