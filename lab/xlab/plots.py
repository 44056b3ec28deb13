"""Figures from the measurement CSVs alone: each function takes the rows xlab.sources gives for its figure and
returns a matplotlib Figure (the Agg canvas, no pyplot); `build(name)` is the one writer of figures/NAME.png, .svg.

Arms are labelled and styled from the arms table. A timed number is the median over trials with its 95% bootstrap
interval as an error bar (seaborn draws them with xlab.intervals' median and interval: a bar is the number the
report prints). Every figure has a title, axis labels with units and a caption naming its CSVs, machine, software
and date; tests/lab/test_figures.py reads every bar and point back from the axes and checks it against the CSV.
"""
from __future__ import annotations

import io
import os
import pathlib
import re
import textwrap

import matplotlib
import numpy as np
import pandas as pd
import seaborn as sns
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.colors import LinearSegmentedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

from . import intervals, shared, sources, summaries, targets
from .intervals import fmt_bytes

PROVENANCE = ("gpu", "driver", "cuda", "cupy", "commit", "date")
MODES = {"single": "one GPU", "threads": "one thread per GPU (one process)", "processes": "one process per GPU"}
PASS_COLOR, FAIL_COLOR = "#2ca02c", "#d62728"


# --- shared pieces
def fmt_si(v: float) -> str:
    """A count with k or M: '91.2k', '1.5M'."""
    for suffix, scale in (("M", 1e6), ("k", 1e3)):
        if abs(v) >= scale:
            return f"{v / scale:.3g}{suffix}"
    return f"{v:.3g}"


def provenance_summary(df: pd.DataFrame) -> dict:
    """Each provenance column's values joined by ' / ' ('unknown' where absent); dates as a day or range."""
    out = {}
    for col in PROVENANCE + ("n_gpus",):
        vals = [str(v) for v in pd.unique(df[col].dropna())] if col in df else []
        out[col] = (sources.day_range(vals) if col == "date" else
                    " / ".join(v.removesuffix(".0") if col == "n_gpus" else v for v in vals) or "unknown")
    return out


def caption(df: pd.DataFrame, note: str = "") -> str:
    """The CSVs a figure's rows come from (with their commits), each machine and its software, and a note."""
    lines = textwrap.wrap(f"Data: {sources.sources(df)}".replace("`", ""), 190) if "csv" in df else []
    for _, g in (df.groupby("gpu", sort=False) if "gpu" in df else [(None, df)]):
        p = provenance_summary(g)
        where = ("a CPU, no GPU (NumPy)" if str(p["gpu"]).startswith("none") else
                 f"{p['gpu']} · driver {p['driver']} · CUDA {p['cuda']}")
        lines.append(f"Measured on {where} · CuPy {p['cupy']} · commit {p['commit']} · {p['date']}")
    return "\n".join(lines + textwrap.wrap(note, 190))


def trials_note(df: pd.DataFrame, keys) -> str:
    """What a point is: a median of n trials with an interval, or a single run."""
    n = df.groupby(list(keys), sort=False).size() if len(df) else pd.Series([], dtype=int)
    if "trial" not in df or not len(n) or n.max() < 2:
        return "One row per point in this CSV (measured before every trial was kept): no interval."
    lo, hi = int(n.min()), int(n.max())
    return f"Median of {lo if lo == hi else f'{lo}-{hi}'} interleaved trials per point; bars: 95% bootstrap interval."


def _figure(nrows=1, ncols=1, size=(10, 5), **kw):
    fig = Figure(figsize=size, layout="constrained", dpi=110)
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols, squeeze=False, **kw)


def _finish(fig, title, df, note="", legend_from=(), ncol=2):
    """Title, one legend of the entries of the axes `legend_from` (theirs removed), and the caption."""
    entries = {}
    for ax in legend_from:
        for handle, text in zip(*ax.get_legend_handles_labels()):
            entries.setdefault(text, handle)
        if ax.get_legend():
            ax.get_legend().remove()
    if entries:
        fig.legend(entries.values(), entries.keys(), loc="outside upper center", ncol=min(len(entries), ncol),
                   fontsize=8.5, frameon=False, title=title, title_fontproperties=dict(size=13, weight="bold"))
    else:
        fig.suptitle(title, fontsize=13, fontweight="bold")
    fig.supxlabel(caption(df, note), x=0.005, ha="left", fontsize=7.5, color="0.3", multialignment="left")
    return fig


def _ci(values):
    """seaborn's errorbar: xlab.intervals' 95% bootstrap interval of the median (NaN for one trial)."""
    return intervals.median_ci(values)[1:3]


def _ci_of(least: int):
    """seaborn's errorbar: _ci's interval, none (NaN) over fewer than `least` trials."""
    return lambda values: _ci(values) if np.isfinite(np.asarray(values, dtype=float)).sum() >= least else \
        (np.nan, np.nan)


def labelled(df: pd.DataFrame, col: str = "allocator", named: pd.DataFrame | None = None) -> pd.DataFrame:
    """The rows with `arm` and `label`: the arm's one name (xlab.shared.row_labels: its front end's where it is a
    default, what its rows measured other than the product as it ships, and, where the figure's rows hold several
    runs, each arm's run in place; the caption names each CSV, its commit and its arms). `named`: the measured rows
    the names are read from, where `df` is computed from them (a speed-up's frame keeps no rule, date or front end)."""
    df = df.copy()
    df["arm"] = df[col].astype(str)
    src = df if named is None else named.assign(arm=named[col].astype(str))
    names = shared.row_labels(src, "arm", runs=True)
    df["label"] = df["arm"].map(names)
    return df


def _hue(df):
    """hue_order, palette and (label -> arm) of a labelled frame."""
    arms = {lab: a for a, lab in zip(df["arm"], df["label"])}
    order = sorted(arms, key=lambda lab: (shared.ordered(arms.values()).index(arms[lab]), lab))
    return order, {lab: shared.arm(arms[lab]).color for lab in order}, arms


def bars(ax, df, x, y, order, fmt=fmt_si, labels=None, log=False, rotate=0, span=None, errorbar=_ci):
    """Grouped bars of y by x and arm, medians with intervals (`errorbar`'s, or `span`'s columns), values labelled."""
    hue_order, palette, arms = _hue(df)
    sns.barplot(df, x=x, y=y, hue="label", order=order, hue_order=hue_order, palette=palette, ax=ax,
                estimator=np.median, errorbar=None if span else errorbar, err_kws=dict(linewidth=1, color="0.15"),
                capsize=0.15, saturation=1)
    for box, lab in zip(ax.containers, hue_order) if span else ():
        r = df[df["label"] == lab].groupby(x)[[y, *span]].median().reindex(order)
        for p, (v, lo, hi) in zip(box.patches, r.to_numpy()):
            ax.plot([p.get_x() + p.get_width() / 2] * 2, [lo, hi], color="0.15", lw=1)
    if log:
        ax.set_yscale("log")
    tops, width = {}, max((p.get_width() for p in ax.patches), default=0)
    for ln in ax.lines:      # the error bars: seaborn draws a bar's interval and its caps as one line
        x, y = (np.asarray(v, dtype=float) for v in ln.get_data())
        ok = np.isfinite(x) & np.isfinite(y)
        if ok.any() and np.ptp(x[ok]) <= width:
            key = round(float(np.mean(x[ok])), 6)
            tops[key] = max(tops.get(key, -np.inf), float(y[ok].max()))
    for c, lab in zip(ax.containers, hue_order):
        a = shared.arm(arms[lab])
        for p in c.patches:
            h, xc = p.get_height(), p.get_x() + p.get_width() / 2
            p.set_hatch(a.hatch)
            p.set_edgecolor("black" if a.name.startswith("xpool") else "none")
            if np.isfinite(h):        # the value, above its interval
                ax.annotate(fmt(h), (xc, max(h, tops.get(round(xc, 6), h))), xytext=(0, 3), fontsize=7,
                            textcoords="offset points", ha="center", va="bottom", rotation=rotate)
    for handle, text in zip(*ax.get_legend_handles_labels()):     # what every legend of the figure is made from
        if text in arms:
            handle.set_hatch(shared.arm(arms[text]).hatch)
    if labels:
        ax.set_xticks(range(len(order)), [labels(v) for v in order], fontsize=8.5)
    ax.set_xlabel("")
    ax.margins(y=0.15)
    ax.grid(axis="y", alpha=0.3)


def lines(ax, df, x, y):
    """Lines of y against x per arm: medians with their intervals, styled from the arms table."""
    hue_order, palette, arms = _hue(df)
    markers = {lab: shared.arm(arms[lab]).marker or "." for lab in hue_order}
    dashes = {lab: {"-": "", "--": (4, 2), ":": (1, 2), "-.": (4, 1, 1, 1)}[shared.arm(arms[lab]).ls]
              for lab in hue_order}
    sns.lineplot(df, x=x, y=y, hue="label", style="label", hue_order=hue_order, style_order=hue_order,
                 palette=palette, markers=markers, dashes=dashes, estimator=np.median, errorbar=_ci,
                 err_style="bars", err_kws=dict(capsize=2), ax=ax)
    ax.grid(alpha=0.3)


def _log2(ax, ticks, fmt=str):
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [fmt(t) for t in ticks])
    ax.xaxis.set_minor_formatter(NullFormatter())


def _logy(ax):
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(subs=(1, 2, 5)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def _empty(ax, text):
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")
    ax.set(xticks=[], yticks=[])


# --- correctness
_FAMILIES = ((r"^transparency: ", "bitwise transparency: an allocator = raw cudaMalloc"),
             (r"^grad GPT loss", "gradient of the GPT loss by finite differences"),
             (r"^grad ", "op gradients by finite differences (float64)"),
             (r"^fused .* (float\d+) vs NumPy$", r"fused kernels against NumPy, \1"),
             (r"^torch grad (float\d+(?: fused| unfused)?) \S+$", r"PyTorch parity: every parameter's gradient, \1"),
             (r"^torch AdamW", "PyTorch parity: AdamW steps"), (r"^torch ", "PyTorch parity: logits and loss"))


def family(check: str) -> str:
    """The group a check belongs to in the figure (every row stays in the CSV and the notebook's table)."""
    for pattern, name in _FAMILIES:
        if re.match(pattern, check):
            return re.sub(pattern, name, check) if "\\" in name else name
    return check


def correctness(df: pd.DataFrame) -> Figure:
    """Per device and family of checks: the worst error over its threshold (a point on a log axis), and how many
    pass."""
    df = sources.with_device(df)
    df["group"] = df["check"].map(family)
    df["ratio"] = np.where(df["threshold"] > 0, df["measured"] / df["threshold"].where(df["threshold"] > 0), 0.0)
    df.loc[df["ratio"].isna(), "ratio"] = np.inf        # NaN never passes: draw it past the line
    df["exact"] = df["threshold"] <= 0
    rows = df.groupby(["device", "group"], sort=False).agg(ratio=("ratio", "max"), passed=("passed", "sum"),
                                                           n=("passed", "size"), exact=("exact", "all"),
                                                           measured=("measured", "max"))
    devices = sorted(pd.unique(df["device"]), key=lambda d: (d != "cpu", d))
    sizes = [len(rows.loc[d]) for d in devices]
    fig, axes = _figure(len(devices), 1, size=(10, 1.6 + 0.24 * sum(sizes) + 0.6 * len(devices)), sharex=True,
                        gridspec_kw=dict(height_ratios=sizes))
    finite = df["ratio"][np.isfinite(df["ratio"]) & (df["ratio"] > 0)]
    lo = min(1e-6, finite.min() / 3) if len(finite) else 1e-6
    hi = max(10.0, finite.max() * 3) if len(finite) else 10.0
    for ax, dev in zip(axes[:, 0], devices):
        sub = df[df["device"] == dev]
        ax.set_title(f"{dev.upper()}: {int(sub['passed'].sum())} of {len(sub)} checks pass", fontsize=10, loc="left")
        w = rows.loc[dev].iloc[::-1]
        y = np.arange(len(w))
        ok = (w["passed"] == w["n"]).to_numpy()
        tol = ~w["exact"].to_numpy()
        # a point, not a bar: on a log axis a bar's length is set by where the axis starts; 0 has no point there
        shown = tol & (w["ratio"].to_numpy() > 0)
        ax.scatter(w["ratio"].clip(upper=hi).to_numpy()[shown], y[shown], s=36, zorder=3,
                   color=np.where(ok, PASS_COLOR, FAIL_COLOR)[shown])
        for yi, r, exact, good, measured in zip(y, w["ratio"], w["exact"], ok, w["measured"]):
            zero = measured == 0            # one label for a zero, exact check or not
            txt = ("measured 0 ✓" if zero and good else f"measured {measured:g}, must be 0 ✗" if exact else
                   "NaN" if not np.isfinite(r) else f"{r:.1g}")
            ax.annotate(txt, (lo if zero or exact else min(r, hi), yi), xytext=(5, 0), textcoords="offset points",
                        va="center", fontsize=7, color=(PASS_COLOR if good else FAIL_COLOR) if zero or exact
                        else "black")
        ax.set_yticks(y, [f"{g} ({int(p)} of {int(n)})" for g, p, n in zip(w.index, w["passed"], w["n"])],
                      fontsize=7.5)
        ax.set(xscale="log", xlim=(lo, hi), ylim=(-0.7, len(w) - 0.3))
        ax.axvline(1.0, color="black", lw=1.2)
        ax.text(1.15, 0.99, "threshold", transform=ax.get_xaxis_transform(), va="top", fontsize=8)
        ax.grid(axis="x", alpha=0.3)
        ax.tick_params(labelbottom=True)
    axes[-1, 0].set_xlabel("worst measured error / threshold in the family (log scale; below 1 passes)")
    return _finish(fig, "Correctness gate: every check's error against its threshold", df,
                   "A point: the worst check of a family, in multiples of its threshold (checks passing of the family "
                   "in brackets); green: every check passes, red: one fails. Every check is a row of the CSV.")


# --- the allocator microbenchmark
def alloc_cost(df: pd.DataFrame) -> Figure:
    """µs per alloc/free pair by request size, and each arm's time over CuPy's pool's in the same trial."""
    d = labelled(df)
    sizes = sorted(d["size_bytes"].unique())
    fig, [[ax, rel]] = _figure(1, 2, size=(13.5, 6.2))
    lines(ax, d, "size_bytes", "us_per_pair")
    _log2(ax, sizes, fmt_bytes)
    _logy(ax)
    ax.set(xlabel="request size (bytes, log scale)", ylabel="µs per alloc/free pair (log scale; lower is faster)",
           title="Cost of a = cupy.empty(n, uint8); del a, one thread")
    r = d[~d["arm"].isin(["raw", "raw_held", "cupy_pool"])].dropna(subset=["ratio_vs_cupy_pool"])
    if len(r):
        lines(rel, r, "size_bytes", "ratio_vs_cupy_pool")
        rel.axhline(1.0, color=shared.arm("cupy_pool").color, lw=1.6)
        rel.text(0.01, 1.0, "CuPy's MemoryPool = 1", transform=rel.get_yaxis_transform(), va="bottom", fontsize=8)
        rel.set_ylim(bottom=0)
    else:
        _empty(rel, "CuPy's MemoryPool not measured: no reference")
    _log2(rel, sizes, fmt_bytes)
    rel.set(xlabel="request size (bytes, log scale)", ylabel="speed-up over CuPy's MemoryPool (×; above 1: faster)",
            title="Relative to CuPy's MemoryPool (raw cudaMalloc left out: off the scale)")
    return _finish(fig, "Allocator cost per allocation: xpool against its peers and raw cudaMalloc", d,
                   trials_note(d, ["arm", "size_bytes", "csv"]) + " Each point times many alloc/free pairs "
                   "through CuPy's array path. Right: speed-up = CuPy's MemoryPool's time / the arm's in the same trial, the "
                   "median of the per-trial ratios.", legend_from=[ax, rel])


def alloc_threads(df: pd.DataFrame, size_bytes: int = 65536) -> Figure:
    """Thousands of alloc/free pairs per second (all threads together) against threads on one GPU."""
    d = labelled(df[df["size_bytes"] == size_bytes])
    fig, [[ax]] = _figure(1, 1, size=(10, 6.4))
    lines(ax, d, "threads", "kpairs_per_s")
    _log2(ax, sorted(d["threads"].unique()))
    ax.set(ylim=(0, None), xlabel="threads allocating on the same GPU",
           ylabel="thousand alloc/free pairs per second (all threads)",
           title=f"{fmt_bytes(size_bytes)} requests; higher is better, flat or rising means no lock contention")
    return _finish(fig, "Several threads on one GPU: allocation throughput", d,
                   trials_note(d, ["arm", "threads", "csv"]), legend_from=[ax])


def torch_interop(df: pd.DataFrame) -> Figure:
    """PyTorch through xpool against its own allocator: µs per torch.empty+del by size, and tokens/s. The arm
    `xpool` is the pool enable_torch() made: named by its scheme where the rows say it (`scheme`), so a CSV from
    after the torch default became expandable is not drawn as the default scheme's."""
    d = labelled(shared.by_scheme(df), "arm")
    fig, [[left, right]] = _figure(1, 2, size=(12, 5.2))
    e = d[d["case"] == "empty_del"]
    sizes = sorted(e["size_bytes"].unique())
    bars(left, e, "size_bytes", "value", sizes, fmt=lambda v: f"{v:.2f}", labels=lambda n: fmt_bytes(n))
    left.set(ylabel="µs per torch.empty + del pair (lower is better)", title="Allocation cost through PyTorch")
    t = d[d["case"] == "train_step"].assign(k=lambda f: f["value"] / 1e3, case="training step")
    bars(right, t, "case", "k", ["training step"], fmt=lambda v: f"{v:.1f}k")
    right.set(ylabel="thousand tokens per second (higher is better)", title="PyTorch's training step (parity model)")
    return _finish(fig, "CuPy and PyTorch in one pool: PyTorch through xpool", d,
                   trials_note(d, ["arm", "case", "size_bytes"]), legend_from=[left, right])


# --- one GPU
SINGLE_PANELS = (
    ("tokens_per_s", "tokens per second (higher is better)", "Training throughput", fmt_si),
    ("host_ms_per_step", "ms of the dispatching thread's CPU time per step", "Host work per step (thread CPU time)",
     lambda v: f"{v:.0f}"),
    ("gpu_ms_per_step", "ms per step on the GPU's stream (CUDA events)",
     "Step span on the GPU stream (= wall time when host-bound)", lambda v: f"{v:.0f}"),
    ("gpu_util_mean", "mean GPU utilisation (%)", "GPU busy (NVML; a 10-step window at batch 4 reads low)",
     lambda v: f"{v:.0f}%"),
    ("device_mallocs_per_step", "cudaMalloc calls per step (symlog scale)",
     "Device mallocs per training step (after warm-up)", lambda v: f"{v:.4g}"),
    ("reserved_over_requested", "peak reserved / peak requested bytes", "Memory held at the peak over what was asked",
     lambda v: f"{v:.3f}"),
)


def single_gpu(df: pd.DataFrame) -> Figure:
    """Per arm and batch: tokens/s, host and GPU ms, utilisation, device mallocs, reserved/requested."""
    d = labelled(df[df["mode"] == "single"] if "mode" in df else df)
    batches = sorted(d["batch"].unique(), reverse=True)
    fig, axes = _figure(3, 2, size=(13.5, 13.5))
    for ax, (col, ylabel, title, fmt) in zip(axes.flat, SINGLE_PANELS):
        ax.set_title(title, fontsize=10)
        if col not in d or d[col].isna().all():
            _empty(ax, f"no {col} in the CSV")
            continue
        bars(ax, d.dropna(subset=[col]), "batch", col, batches, fmt=fmt, labels=lambda b: f"batch {b}")
        ax.set_ylabel(ylabel)
        if col == "tokens_per_s":
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt_si(v)))
        if col == "device_mallocs_per_step":
            ax.set_yscale("symlog", linthresh=1)      # 0 is a bar of height 0, labelled 0
        if col == "reserved_over_requested":
            ax.axhline(1.0, color="black", lw=0.8)
            ax.set_ylim(bottom=0)
    return _finish(fig, "One GPU: the small GPT's training step under each allocator", d,
                   trials_note(d, ["batch", "arm", "csv"]) + " Each trial times the steps after warm-up.",
                   legend_from=list(axes.flat))


# --- several GPUs
def _modes(df):
    return [m for m in ("threads", "processes") if m in set(df["mode"])]


def ddp_scaling(df: pd.DataFrame) -> Figure:
    """Tokens/s and speedup (trial t on N GPUs over trial t on one) against GPUs, a column per mode."""
    d = labelled(df[df["mode"] != "single"])
    modes, worlds = _modes(d), sorted(d["world"].unique())
    fig, axes = _figure(2, len(modes), size=(6.8 * len(modes), 9), sharey="row")
    for j, mode in enumerate(modes):
        top, bottom = axes[0][j], axes[1][j]
        sub = d[d["mode"] == mode]
        lines(top, sub, "world", "tokens_per_s")
        lines(bottom, sub, "world", "speedup")
        bottom.plot(worlds, worlds, color="black", ls="--", lw=0.8, label="ideal (linear)")
        top.set_title(MODES[mode], fontsize=11)
        top.yaxis.set_major_formatter(FuncFormatter(lambda v, _: fmt_si(v)))
        for ax in (top, bottom):
            ax.set_xticks(worlds, [str(w) for w in worlds])
            ax.set_xlabel("GPUs")
            if j or ax is top:
                ax.get_legend().remove()
    axes[0][0].set(ylim=(0, 1.08 * d["tokens_per_s"].max()), ylabel="tokens per second, all GPUs (higher is better)")
    axes[1][0].set(ylim=(0, 1.1 * max(d["speedup"].max(), max(worlds))),
                   ylabel="speedup over the same allocator on 1 GPU (×)")
    batch = ", ".join(str(b) for b in sorted(d["batch"].unique()))
    return _finish(fig, "Several GPUs: data-parallel training throughput and speedup", d,
                   f"Batch {batch} per GPU; gradients all-reduced with NCCL each step. "
                   + trials_note(d, ["mode", "arm", "world"]), legend_from=[axes[1][0]])


def ddp_before_after(df: pd.DataFrame) -> Figure:
    """At the largest world: speedup and GPU utilisation per mode and arm, before (raw) and after (a pool), every
    arm from one run: the newest CSV that measured raw cudaMalloc (sources.one_run)."""
    d = sources.one_run(df[df["mode"] != "single"], ("raw",))
    world = int(d["world"].max())
    top = labelled(d[d["world"] == world])
    modes = _modes(top)
    fig, [[sp, ut]] = _figure(1, 2, size=(13.5, 5.8))
    for ax, col, ylabel, fmt in ((sp, "speedup", f"speed-up on {world} GPUs over 1 GPU (×)", lambda v: f"{v:.2f}×"),
                                 (ut, "gpu_util_mean", "mean GPU utilisation (%)", lambda v: f"{v:.0f}%")):
        bars(ax, top.dropna(subset=[col]), "mode", col, modes, fmt=fmt, labels=lambda m: MODES[m])
        ax.set_ylabel(ylabel)
    sp.axhline(world, color="black", ls="--", lw=0.8)
    sp.text(-0.45, world, f"ideal {world}×", va="bottom", fontsize=8)
    sp.set_title(f"Speed-up on {world} GPUs: before (raw cudaMalloc) → after (a pool)", fontsize=10)
    ut.set_title(f"GPU utilisation on {world} GPUs", fontsize=10)
    ut.set_ylim(0, 110)
    return _finish(fig, f"{world} GPUs: what the allocator changes", top, trials_note(top, ["mode", "arm"]),
                   legend_from=[sp, ut])


def batch_sweep(df: pd.DataFrame) -> Figure:
    """Threads on N GPUs over 1 by per-GPU batch, and on one GPU the host's time against the wall time."""
    d = labelled(df[df["mode"] == "threads"] if "mode" in df else df)
    world, batches = int(d["world"].max()), sorted(d["batch"].unique())
    fig, [[sp, ms]] = _figure(1, 2, size=(13.5, 6))
    lines(sp, d[d["world"] == world], "batch", "speedup")
    sp.axhline(world, color="black", ls="--", lw=0.8)
    sp.text(batches[0], world, f" ideal {world}×", va="bottom", fontsize=8)
    sp.set(ylim=(0, 1.15 * world), ylabel=f"speedup, {world} GPUs over 1 (same trial)",
           title=f"One thread per GPU, {world} GPUs: speedup by per-GPU batch")
    one = d[(d["world"] == 1) & (d["arm"] == "xpool")]
    if len(one) and "host_ms_per_step" in one:
        both = pd.concat([one.assign(what="host: the dispatching thread's CPU time", ms=one["host_ms_per_step"]),
                          one.assign(what="wall time per step", ms=one["ms_per_step"])])
        sns.lineplot(both, x="batch", y="ms", hue="what", palette=["#6a3d9a", "#33a02c"], marker="o",
                     estimator=np.median, errorbar=_ci, err_style="bars", ax=ms)
        ms.legend(fontsize=8, loc="upper left", title=None)
        _logy(ms)
        ms.set_title("Where the host bound ends: one GPU, xpool (CuPy)", fontsize=10)
    else:
        _empty(ms, "no host ms per step in the CSV")
    ms.set_ylabel("ms per step (log scale)")
    for ax in (sp, ms):
        _log2(ax, batches)
        ax.set_xlabel("sequences per GPU per step (log scale)")
    return _finish(fig, "Batch sweep: where one thread per GPU starts to scale", d,
                   "Two threads share one GIL: while a step's host time is its wall time, the second thread's host "
                   "work cannot overlap the first's. " + trials_note(d, ["arm", "world", "batch"]), legend_from=[sp])


def graph_steps(df: pd.DataFrame) -> Figure:
    """Eager against captured steps: speedup on the largest world, host ms per step, GPU busy at batch 4."""
    d = labelled(df[df["mode"] != "processes"])      # no panel draws them: the caption names only what is drawn
    fig, [[sp, disp, util]] = _figure(1, 3, size=(17, 6))
    thr = d[(d["mode"] == "threads") & (d["world"] == d["world"].max())]
    single = d[d["mode"] == "single"]
    small = single[single["batch"] == single["batch"].min()] if len(single) else single
    for ax, rows, col, fmt, log in ((sp, thr, "speedup", lambda v: f"{v:.2f}×", False),
                                    (disp, single, "dispatch_ms_per_step", lambda v: f"{v:.1f}", True),
                                    (util, small, "gpu_util_mean", lambda v: f"{v:.0f}%", False)):
        rows = rows.dropna(subset=[col]) if col in rows else rows.iloc[:0]
        if not len(rows):
            _empty(ax, f"no {col} rows")
            continue
        bars(ax, rows, "batch", col, sorted(rows["batch"].unique()), fmt=fmt, labels=lambda b: f"batch {b}", log=log)
    if len(thr):
        world = int(thr["world"].max())
        sp.axhline(world, color="black", ls="--", lw=0.8)
        sp.set(ylabel=f"speedup, {world} GPUs over 1 (×)", title=f"One thread per GPU, {world} GPUs")
    disp.set(ylabel="host ms per step (thread CPU time, idle device; log)", title="One GPU: the host's work per step")
    util.set(ylabel="GPU utilisation, NVML (%)", title="One GPU, smallest batch: how busy the GPU is", ylim=(0, 110))
    return _finish(fig, "The training step as a CUDA graph: eager against captured", d,
                   trials_note(d, ["mode", "world", "batch", "arm"]), legend_from=[sp, disp, util])


# --- memory
def memory_waste(df: pd.DataFrame) -> Figure:
    """The seed scheme by k: bytes handed out over requested (one step), peak reserved over requested."""
    d = df.groupby("k", sort=True)[["class_over_requested", "reserved_over_requested"]].median()
    long = pd.concat([pd.DataFrame({"k": d.index, "what": w, "waste": 100 * (d[c].to_numpy() - 1)}) for c, w in (
        ("class_over_requested", "size classes: bytes handed out / bytes requested, one step's requests"),
        ("reserved_over_requested", "peak bytes reserved / peak bytes requested, whole run"))])
    fig, [[ax]] = _figure(1, 1, size=(10, 5.6))
    sns.barplot(long, x="k", y="waste", hue="what", palette=["#ff7f0e", "#d62728"], ax=ax, saturation=1)
    for c in ax.containers:
        ax.bar_label(c, fmt=lambda v: f"{v:.1f}%" if v >= 1 else f"{v:.2g}%", fontsize=8.5, padding=2)
    ax.set_xticks(range(len(d.index)), [f"k = {k}" for k in d.index])
    ax.set(xlabel="size classes per doubling above 1 MiB (xpool's seed scheme, classes_per_doubling)",
           ylabel="waste: bytes beyond the request (% of requested)",
           title="Bytes the pool holds beyond what the arrays asked for (lower is better)", ylim=(0, None))
    ax.margins(y=0.15)
    ax.legend(fontsize=8.5, loc="upper right", title=None)
    src = "measured with xpool installed" if (df.get("source") == "measured").any() else "replayed on the CPU"
    return _finish(fig, "Memory waste of xpool's seed scheme (size classes) by setting, GPT training run", df,
                   f"Numbers {src}: one run per setting (exact counters).")


def trace_label(name: str) -> str:
    """A recorded trace's name as a two-line tick label: 'gpt_b32_perparam_numpy' -> 'b32 perparam\\n(NumPy)'."""
    base = name[4:] if name.startswith("gpt_") else name
    for suffix, where in (("_cupy_path_numpy", "CuPy path"), ("_numpy", "NumPy"), ("_gpu", "GPU")):
        if base.endswith(suffix):
            return f"{base[:-len(suffix)].replace('_', ' ')}\n({where})"
    return base.replace("_", " ")


def memory_schemes(df: pd.DataFrame) -> Figure:
    """Per trace and scheme: peak reserved over requested (replayed), and ns per pair (host backend)."""
    d = labelled(df.assign(waste_pct=100 * (df["reserved_over_requested"] - 1)))
    traces = list(dict.fromkeys(d["trace"]))
    fig, [[ax], [cost]] = _figure(2, 1, size=(15, 11))
    # a linear axis from 0: a bar's length is what its pool holds beyond the peak (a log axis needs a floor, and the
    # floor sets the length); the small bars are labelled
    bars(ax, d, "trace", "waste_pct", traces, fmt=lambda v: f"{v:.0f}%" if v >= 10 else f"{v:.1f}%",
         labels=trace_label, rotate=90)
    ax.set_ylim(0, d.groupby(["trace", "arm"])["waste_pct"].median().max() * 1.3)
    ax.set(ylabel="peak reserved / peak requested − 1 (%)", title="Memory held beyond the arrays' peak, "
           "replayed on the CPU")
    c = d.dropna(subset=["ns_per_pair"])
    if len(c):
        bars(cost, c, "trace", "ns_per_pair", traces, fmt=lambda v: f"{v:.0f}", labels=trace_label, rotate=90,
             span=("ns_per_pair_min", "ns_per_pair_max"))
        cost.set(ylabel="ns per alloc+free pair, C core (Python floor subtracted)", title="Cost of the last step's "
                 "requests once warm, host backend (CuPy's pool needs a GPU: see the allocator microbenchmark)")
    else:
        _empty(cost, "no cost measured")
    return _finish(fig, "Memory waste and allocation cost of each scheme on the recorded request traces", d,
                   "Waste: every trace replayed, in order, through each pool (CuPy's as a model of its arena), one "
                   "replay each (exact). Cost: median with min-max over interleaved repeats.", [ax, cost], ncol=3)


def memory_timeline(df: pd.DataFrame, step: int | None = None) -> Figure:
    """Bytes reserved, in use and requested over the recorded run (by event), and over one step (in time)."""
    tl = df[df["k"] == df["k"].iloc[0]] if "k" in df else df
    tl = tl.reset_index(drop=True)               # the CSV keeps the timeline's own (recorded) order
    sign = np.select([tl["event"].isin(["alloc_hit", "alloc_miss"]), tl["event"] == "free"], [1, -1], 0)
    req = np.cumsum(sign * tl["requested"].to_numpy(dtype=float)) / 2**30
    steps = sorted(tl["step"].unique()) if "step" in tl else [0]
    step = steps[-1] if step is None else step
    fig, [[whole], [zoom]] = _figure(2, 1, size=(12, 9))

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
        ax.set(ylabel="GiB", ylim=(0, None))
        ax.grid(alpha=0.3)

    everything = pd.Series(True, index=tl.index)
    draw(whole, everything, tl.index.to_numpy())
    whole.set_xlabel("allocator events (allocs and frees), in order")
    for s in steps if "step" in tl else []:
        first = tl.index[tl["step"] == s]
        whole.axvline(first[0], color="0.4", lw=0.8, ls=":")
        whole.text(first[0], 0.03, "setup " if s < 0 else f" step {s}", transform=whole.get_xaxis_transform(),
                   fontsize=8, va="bottom", ha="right" if s < 0 else "left", color="0.25")
    whole.set_title("Whole recording: building the model and optimizer, then training steps (dotted lines: where "
                    "each begins)", fontsize=10)
    sel = tl["step"] == step if "step" in tl else everything
    t = tl["t_s"][sel]
    draw(zoom, sel, ((t - t.iloc[0]) * 1e3).to_numpy())
    zoom.set_xlabel("time from the step's first allocation (ms, host clock)")
    n_alloc = int((sel & tl["event"].isin(["alloc_hit", "alloc_miss"])).sum())
    n_miss = int((sel & (tl["event"] == "alloc_miss")).sum())
    zoom.set_title(f"The recorded training step (step {step}): {n_alloc} allocations, {n_miss} cudaMalloc",
                   fontsize=10)
    k = int(tl["k"].iloc[0]) if "k" in tl else 1
    return _finish(fig, f"Device memory during training under xpool's seed scheme (size classes, k = {k})", df,
                   f"xpool_{'seed' if k == 1 else f'k{k}'}: the seed scheme with {k} size class"
                   f"{'es' if k != 1 else ''} per doubling, from its allocation timeline.",
                   legend_from=[whole], ncol=4)     # above the axes: inside, it hid the rug of misses


# --- dynamic shapes: three figures (memory, device calls, speed), a panel per front end, its default marked
def _calls_label(v: float) -> str:
    """A count per step, short enough to sit over its bar: 966, 21, 2.5, 0.37, 0.067, 0."""
    return f"{v:.0f}" if v >= 10 or v == 0 else f"{v:.2g}"


def speedups(df: pd.DataFrame, peers=shared.SETS["dynamic"], by=("workload",), metric: str = "ms_per_step",
             arm: str = "allocator") -> pd.DataFrame:
    """Each arm's speed-up over the fastest peer of its group (the peer of the lowest median time): the ratio of the
    two medians over paired trials, the peer's time over the arm's (above 1: the arm is faster), with its 95%
    bootstrap interval (intervals.ratio_ci); the reference itself is 1. Columns: by, arm, speedup, speedup_lo,
    speedup_hi, n_pairs, reference."""
    by, rows = list(by), []
    for key, g in df.groupby(by, sort=False):
        key = key if isinstance(key, tuple) else (key,)
        ref = intervals.best(g[g[arm].isin(peers)], metric, arm, higher=False)
        if ref is None:
            continue
        base = g[g[arm] == ref].groupby("trial")[metric].median()
        for name, a in g.groupby(arm, sort=False):
            mine = a.groupby("trial")[metric].median()
            common = mine.index.intersection(base.index)
            v, lo, hi, n = intervals.ratio_ci(base.loc[common].to_numpy(), mine.loc[common].to_numpy())
            rows.append({**dict(zip(by, key)), arm: name, "speedup": v, "speedup_lo": lo, "speedup_hi": hi,
                         "n_pairs": n, "reference": ref})
    return pd.DataFrame(rows, columns=by + [arm, "speedup", "speedup_lo", "speedup_hi", "n_pairs", "reference"])


# (framework, panel title, its default arm): the default is what a program of that front end gets
DYNAMIC_FRONT_ENDS = (("cupy", "CuPy programs", targets.XD), ("torch", "PyTorch programs", targets.XDT))
# xpool's arms drawn: its schemes as the product has them (the seed scheme, the reference design, holds far more
# than the peak and would flatten every other bar: it and the release rules decision 0001 retired are in the
# report's table); the rest of each panel is its front end's peers
DYNAMIC_XPOOL = tuple(a for a in targets.PRODUCT_ARMS if a != "xpool_seed")


def _dynamic_panels(df: pd.DataFrame, value: str, ylabel: str, fmt, span=None, prepare=None, ticks=None,
                    errorbar=_ci):
    """A figure of two panels (CuPy programs above, PyTorch's below): `value` per workload and arm, bars, the front
    end's default arm labelled as such and outlined, each panel's legend beside it (no commit in a label). ticks:
    {workload: its tick label} (default: the workload and whether its shapes vary)."""
    fig, axes = _figure(2, 1, size=(14, 10))
    ticks = ticks or {w: f"{w}\n({'varying' if str(v) == 'True' else 'fixed'} shapes)"
                      for w, v in zip(df["workload"], df["dynamic"])}
    for ax, (f, title, default) in zip(axes[:, 0], DYNAMIC_FRONT_ENDS):
        rows = df[(df["framework"] == f) & (~df["allocator"].astype(str).str.startswith("xpool")
                                            | df["allocator"].isin(DYNAMIC_XPOOL))]
        order = list(dict.fromkeys(rows["workload"]))
        measured, rows = rows, prepare(rows) if prepare else rows
        if value not in rows or rows[value].isna().all():
            _empty(ax, f"no {value} measured")
            continue
        d = labelled(rows.dropna(subset=[value]), named=measured)     # the default named for its front end
        bars(ax, d, "workload", value, order, fmt=fmt, labels=ticks.__getitem__, rotate=90, span=span,
             errorbar=errorbar)
        _, _, arms = _hue(d)
        for c, lab in zip(ax.containers, _hue(d)[0]):
            if arms[lab] == default:
                for p in c.patches:
                    p.set_linewidth(2.2)
        handles, labels = ax.get_legend_handles_labels()
        if ax.get_legend():
            ax.get_legend().remove()
        ax.legend(handles, [textwrap.fill(t, 52) for t in labels], loc="upper left", bbox_to_anchor=(1.01, 1),
                  fontsize=8.5, frameon=False)
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=11, loc="left")
    return fig, axes


_DEFAULT_NOTE = ("xpool (CuPy) and xpool (PyTorch) (thick outline) are what a program of that front end gets from "
                 "xpool: xpool.install()'s scheme for CuPy, the pool xpool.enable_torch() makes for PyTorch. ")


def _dynamic_note(d: pd.DataFrame) -> str:
    return _DEFAULT_NOTE + trials_note(d, ["workload", "allocator"]) + _seeds_note(d)


def _scale_note(d: pd.DataFrame) -> str:
    """_dynamic_note for the scaled rows: their trials as a run under way has them (summaries.trials_said)."""
    return (f"{_DEFAULT_NOTE}Medians of interleaved trials, bars their 95% bootstrap intervals; the rows hold "
            f"{summaries.trials_said(d)}." + _seeds_note(d))


def _held(df: pd.DataFrame, title: str, note: str, **panels) -> Figure:
    """Memory held, peak reserved over peak requested less one (linear, from 0), per workload and arm in the two front
    ends' panels (_dynamic_panels, `panels` its options), the goal 1.05 dotted."""
    d = df.assign(held_pct=100 * (df["reserved_over_requested"] - 1))
    # a linear axis from 0: a bar's length is what the arm holds beyond the peak (on a log axis it was set by a floor)
    fig, axes = _dynamic_panels(d, "held_pct", "peak reserved / peak requested − 1 (%)",
                                lambda v: f"{v:.0f}%" if v >= 10 else f"{v:.2g}%", **panels)
    for ax in axes[:, 0]:
        if ax.has_data():
            ax.set_ylim(0, ax.get_ylim()[1] * 1.15)   # room above the tallest bar for its label
            ax.axhline(5.0, color="black", ls=":", lw=1)
    return _finish(fig, title, df, "Held: peak reserved / peak requested − 1; dotted: the goal 1.05. " + note)


def dynamic_shapes(df: pd.DataFrame) -> Figure:
    """Memory held under changing shapes: peak reserved over peak requested, less one, per workload and arm."""
    return _held(df, "Dynamic shapes: memory held beyond the peak the program asked for (lower is better)",
                 _dynamic_note(df))


def dynamic_scale(df: pd.DataFrame) -> Figure:
    """dynamic_shapes at the scale users run them (xlab.bench.dynamic_scale): each dynamic workload grown to a peak
    requested of tens of GiB, its factor and size under its name; intervals over INTERVAL_TRIALS trials or more."""
    ticks = {w: f"{w}\n(×{g['scale'].iloc[0]}, {summaries.requested(g)})" for w, g in df.groupby("workload")}
    return _held(df, f"Dynamic shapes at {summaries.requested(df)}: memory held beyond the peak the program asked "
                 "for (lower is better)", _scale_note(df), ticks=ticks,
                 errorbar=_ci_of(shared.INTERVAL_TRIALS))


# a cell of memory_cap: the share of trials that finished, from none (red) to every one (green), light enough for
# its text
CAP_COLORS = LinearSegmentedColormap.from_list("finished", ["#f4a6a6", "#fff2a8", "#a8e0a0"])


def memory_cap(df: pd.DataFrame) -> Figure:
    """Which allocator finishes the job under a memory cap (xlab.bench.dynamic_scale): per front end, a grid of its
    arms by workload and cap, each cell the trials that finished of those run ('k/n'), coloured by that share, the
    front end's default labelled and outlined."""
    fig, axes = _figure(2, 1, size=(12, 10))
    for ax, (f, title, default) in zip(axes[:, 0], DYNAMIC_FRONT_ENDS):
        s = summaries.cap_summary(df[df["framework"] == f])
        if s.empty:
            _empty(ax, f"no workload of {title} ran under a cap")
            continue
        _cap_grid(ax, s.assign(framework=f), default, title)
    caps = ", ".join(f"{c:.2f}×" for c in sorted(df["cap_over_peak_requested"].unique()))
    return _finish(fig, f"Under a memory cap: which allocator finishes the job (caps of {caps} its peak requested)", df,
                   "A cell: the trials that finished under the cap of those run (green: every one, red: none, grey: "
                   "not run). The cap is a multiple of the uncapped run's peak requested bytes, set as each allocator "
                   "allows (xpool's limit, CuPy's pool limit, RMM's limiting adaptor, PyTorch's per-process memory "
                   "fraction); a run stops at its first out-of-memory error. " + _DEFAULT_NOTE
                   + f"The rows hold {summaries.trials_said(df)}." + _seeds_note(df))


def _cap_grid(ax, s: pd.DataFrame, default: str, title: str) -> None:
    """One front end's panel of memory_cap from its summaries.cap_summary rows: arms down, (workload, cap) across,
    each workload named above its caps."""
    cols = list(dict.fromkeys(zip(s["workload"], s["cap_over_peak_requested"])))
    arms = shared.ordered(s["allocator"])
    share = np.full((len(arms), len(cols)), np.nan)
    for r in s.itertuples():
        i, j = arms.index(r.allocator), cols.index((r.workload, r.cap_over_peak_requested))
        share[i, j] = r.completed / r.trials
        ax.text(j, i, f"{r.completed}/{r.trials}", ha="center", va="center", fontsize=9)
    ax.imshow(np.ma.masked_invalid(share), cmap=CAP_COLORS, vmin=0, vmax=1, aspect="auto")
    ax.set_facecolor("0.88")                        # a cell not run
    ax.set_xticks(range(len(cols)), [f"{c:.2f}×" for _, c in cols])
    names = shared.row_labels(s, "allocator")
    ax.set_yticks(range(len(arms)), [textwrap.fill(names[a], 48) for a in arms], fontsize=8.5)
    for w in dict.fromkeys(w for w, _ in cols):
        js = [j for j, (x, _) in enumerate(cols) if x == w]
        ax.text(np.mean(js), 1.01, w, transform=ax.get_xaxis_transform(), ha="center", va="bottom", fontsize=9.5)
        if max(js) < len(cols) - 1:                 # a white line between two workloads' caps
            ax.axvline(max(js) + 0.5, color="white", lw=4)
    if default in arms:
        ax.add_patch(Rectangle((-0.5, arms.index(default) - 0.5), len(cols), 1, fill=False, lw=2.5, ec="black",
                               zorder=3))
    ax.set_xlabel("cap over the uncapped run's peak requested bytes")
    ax.set_title(title, fontsize=11, loc="left", pad=20)


def dynamic_calls(df: pd.DataFrame) -> Figure:
    """Device calls (cudaMalloc, cudaFree, map, unmap) per step in steady state, per workload and arm."""
    fig, axes = _dynamic_panels(df, "device_calls_per_steady_step", "device calls per step in steady state",
                                _calls_label)
    for ax in axes[:, 0]:
        if ax.has_data() and ax.get_ylim()[1] > 10:   # 0 for a warm pool, hundreds for cudaMallocAsync
            top = ax.get_ylim()[1]
            ax.set_yscale("symlog", linthresh=1)
            ax.set_ylim(0, top * 12)                  # room above the tallest bar for its label
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.set_ylabel(ax.get_ylabel() + " (symlog scale)")
    return _finish(fig, "Dynamic shapes: device calls per step once the demand stops rising (lower is better)", df,
                   "Steady state: the timed steps after the step where the demand last rose; a device call: a "
                   "cudaMalloc, cudaFree, map or unmap. " + _dynamic_note(df))


def dynamic_speed(df: pd.DataFrame) -> Figure:
    """Each arm's speed-up over the fastest peer of its workload (speedups), with its interval."""
    fig, axes = _dynamic_panels(df, "speedup", "speed-up over the fastest peer (×)",
                                "{:.2f}".format, span=("speedup_lo", "speedup_hi"),
                                prepare=lambda rows: speedups(rows).merge(
                                    rows[["workload", "allocator"]].drop_duplicates(), on=["workload", "allocator"]))
    for ax in axes[:, 0]:
        if ax.has_data():
            ax.axhline(1.0, color="black", ls=":", lw=1)
    return _finish(fig, "Dynamic shapes: speed against the fastest peer of each workload (higher is better)", df,
                   "Speed-up: the fastest peer's ms per step over the arm's, the ratio of the two medians over paired "
                   "trials (above 1: the arm is faster). " + _dynamic_note(df))


def _seeds_note(d: pd.DataFrame) -> str:
    """' Each trial on a seed of its own (0-4), ...' when the trials are several realizations, else ''."""
    seeds = sorted(set(d["seed"].dropna().astype(int))) if "seed" in d else []
    if len(seeds) < 2:
        return ""
    return (f" Each trial on a seed of its own ({seeds[0]}-{seeds[-1]}), the same for every allocator: another "
            "realization of each workload.")


# --- every figure from data/: the one writer of figures/

# name -> (lineage or CSV it is drawn from, the function)
FIGURES = {
    "correctness": ("correctness", correctness),
    "alloc_cost": ("alloc_size", alloc_cost),
    "alloc_threads": ("alloc_threads", alloc_threads),
    "torch_interop": ("torch_interop.csv", torch_interop),
    "single_gpu": ("single_gpu", single_gpu),
    "ddp_scaling": ("ddp", ddp_scaling),
    "ddp_before_after": ("ddp", ddp_before_after),
    "batch_sweep": ("batch_sweep", batch_sweep),
    "memory_waste": ("memory_waste.csv", memory_waste),
    "memory_timeline": ("memory_timeline.csv", memory_timeline),
    "memory_schemes": ("memory_schemes.csv", memory_schemes),
    "graph_steps": ("graph", graph_steps),
    "dynamic_shapes": ("dynamic_shapes", dynamic_shapes),
    "dynamic_calls": ("dynamic_shapes", dynamic_calls),
    "dynamic_speed": ("dynamic_shapes", dynamic_speed),
    "dynamic_scale": ("dynamic_scale", dynamic_scale),
    "memory_cap": ("memory_cap", memory_cap),
}


# figures that compare arms within one run: drawn from every CSV of their lineage, each picking its run itself
WHOLE_LINEAGE = {"ddp_before_after"}


def rows(name: str, data_dir: str | os.PathLike = "data") -> pd.DataFrame | None:
    """The rows figure `name` is drawn from: xlab.sources.current of its lineage (or all of it: WHOLE_LINEAGE)."""
    if name in WHOLE_LINEAGE:
        parts = sources.frames(pathlib.Path(data_dir), FIGURES[name][0])
        return pd.concat(parts, ignore_index=True) if parts else None
    return sources.current(pathlib.Path(data_dir), FIGURES[name][0])


def draw(name: str, data_dir: str | os.PathLike = "data") -> Figure | None:
    """Figure `name` drawn from its rows (`rows`), or None when they are missing."""
    df = rows(name, data_dir)
    return None if df is None else FIGURES[name][1](df)


def png(fig: Figure) -> bytes:
    """The figure as PNG bytes (what a notebook displays inline; nothing is written)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, metadata={"Software": None})
    return buf.getvalue()


def save(fig: Figure, name: str, figures_dir: str | os.PathLike = "figures"):
    """Write NAME.png and NAME.svg (no timestamps inside: unchanged data gives unchanged files); both paths."""
    out = pathlib.Path(figures_dir)
    out.mkdir(parents=True, exist_ok=True)
    png_path, svg = out / f"{name}.png", out / f"{name}.svg"
    with matplotlib.rc_context({"svg.hashsalt": "xpool", "svg.fonttype": "none"}):
        fig.savefig(png_path, dpi=110, metadata={"Software": None})
        fig.savefig(svg, metadata={"Date": None, "Creator": None})
    return png_path, svg


def build(name: str, data_dir: str | os.PathLike = "data", figures_dir: str | os.PathLike = "figures"):
    """Draw figure `name` from data_dir and write it to figures_dir: the PNG's path, or why it was not built."""
    try:
        fig = draw(name, data_dir)
    except Exception as e:                # one bad CSV must not cost the other figures
        return f"failed: {type(e).__name__}: {e}"
    if fig is None:
        return f"skipped: no CSV of {FIGURES[name][0]} in {data_dir}"
    return save(fig, name, figures_dir)[0]


def build_all(data_dir: str | os.PathLike = "data", figures_dir: str | os.PathLike = "figures") -> dict:
    """Every figure whose CSVs exist: name -> PNG path, or the reason it was skipped or failed."""
    return {name: build(name, data_dir, figures_dir) for name in FIGURES}
