"""Run every notebook through papermill, rebuild figures/ from data/*.csv, write the one-page report.

    python -m xlab.report              # notebooks with their defaults (on a GPU they measure)
    python -m xlab.report --cpu-quick  # CPU mode with small parameters: what CI runs, a few minutes

Executed notebooks go to build/notebooks/ (ignored by git); the report to build/report.md and, committed,
report/REPORT.md (without the notebooks' run status, which stays in build/). Every headline number is computed
from the CSVs: medians over trials with 95% bootstrap
intervals, ratios over paired trials (xlab.intervals), targets judged on the interval (met, missed, within
noise). A CSV measured before trials were kept has one row per configuration: its numbers are marked
"single run, no interval". The page holds nothing but what the CSVs say (no run date or timing), so an unchanged
data/ gives an unchanged report.
"""
from __future__ import annotations

import argparse
import math
import os
import pathlib
import sys
import time

import numpy as np
import pandas as pd

from . import intervals as iv
from . import paths, plots

# Small parameters for CI: CPU mode (never measure, even on a GPU) and the fewest steps that run the code.
CPU_QUICK = {
    "01_correctness": dict(measure=False, transparency_steps=5),
    "02_allocator_microbench": dict(measure=False, quick=True),
    "03_single_gpu": dict(measure=False, steps=3, warmup=1, trials=2),
    "04_multi_gpu": dict(measure=False, steps=3, trials=2),
    "05_memory": dict(measure=False),
}


def notebooks(root: pathlib.Path | None = None, only=None) -> list[pathlib.Path]:
    """notebooks/NN_*.ipynb in order; `only` keeps those whose name starts with one of its prefixes.

    Args:
        root: the repository (default: paths.repo_root()).
        only: name prefixes to keep, or None for all.

    Returns:
        A list of paths.
    """
    root = root or paths.repo_root()
    found = sorted((root / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    return [p for p in found if not only or any(p.stem.startswith(o) for o in only)]


def _kernel_env(root: pathlib.Path) -> None:
    """Let the kernel import this checkout's xpool even where it is not installed."""
    entries = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    if str(root) not in entries:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(root)] + [p for p in entries if p])


def run_notebook(path: pathlib.Path, out_dir: pathlib.Path, parameters: dict | None = None,
                 timeout: int = 1800) -> dict:
    """Execute one notebook with papermill into out_dir; returns name, ok, seconds and the error, if any.

    Args:
        path: the notebook.
        out_dir: where the executed copy goes.
        parameters: papermill parameters.
        timeout: seconds a cell may run.

    Returns:
        A dict: notebook, ok, seconds, output, error ("" when it ran).
    """
    import papermill
    _kernel_env(paths.repo_root())
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / path.name
    t0 = time.perf_counter()
    error = ""
    try:
        papermill.execute_notebook(str(path), str(out), parameters=parameters or {}, kernel_name="python3",
                                   cwd=str(path.parent), progress_bar=False, execution_timeout=timeout)
    except Exception as e:           # a failing cell (PapermillExecutionError) or a kernel that died
        error = f"{type(e).__name__}: {getattr(e, 'ename', '')} {getattr(e, 'evalue', '') or e}".strip()
    return dict(notebook=path.stem, ok=not error, seconds=time.perf_counter() - t0, output=str(out), error=error)


# ---------------------------------------------------------------------------------------------------------
# Headline numbers, each computed from one CSV (None where the CSV is missing)


def _read(data: pathlib.Path, name: str) -> pd.DataFrame | None:
    p = data / f"{name}.csv"
    return pd.read_csv(p) if p.is_file() else None


XPOOL_PREFERENCE = ("xpool", "xpool_k1", "xpool_seed", "xpool_k4")


def _xpools(allocators) -> list[str]:
    """The xpool arms measured (debug-mode arms left out), default scheme first."""
    names = [str(a) for a in pd.unique(pd.Series(list(allocators)))
             if str(a).startswith("xpool") and not str(a).endswith("_debug")]
    return [a for a in XPOOL_PREFERENCE if a in names] + sorted(a for a in names if a not in XPOOL_PREFERENCE)


def _xpool(allocators) -> str | None:
    """The xpool arm to quote: the default scheme (`xpool`), else k=1, if measured."""
    names = _xpools(allocators)
    return names[0] if names else None


def _med(values):
    """(median, lo, hi) over trials."""
    m, lo, hi, _ = iv.median_ci(values)
    return m, lo, hi


def _ci(value, lo, hi, fmt="{:.2f}", unit=""):
    return iv.fmt_ci(value, lo, hi, fmt, unit)


def _with_xpool(data: pathlib.Path, name: str):
    """(data/NAME.csv, the xpool arm to quote in it), or (None, None) when the CSV is missing."""
    df = _read(data, name)
    return (None, None) if df is None else (df, _xpool(df["allocator"].unique()))


def _where(df: pd.DataFrame) -> str:
    p = plots.provenance_summary(df)
    gpu = "CPU, no GPU" if p["gpu"] == "none" else p["gpu"]
    return f"{gpu}, {p['date']}"


def headline_correctness(data: pathlib.Path) -> str | None:
    """The correctness headline, from correctness_cpu.csv and correctness_gpu.csv.

    Args:
        data: the CSV folder.

    Returns:
        One sentence on both devices' checks, or None where the CSV is missing.
    """
    parts = []
    for name in ("correctness_cpu", "correctness_gpu"):
        df = _read(data, name)
        if df is None:
            continue
        dev = name.split("_")[1].upper()
        text = f"{dev} {int(df['passed'].sum())} of {len(df)} checks pass ({_where(df)})"
        gate = df[df["check"].str.startswith("transparency")]
        if len(gate):
            text += (f", bitwise transparency of every allocator against raw cudaMalloc: "
                     f"{'yes' if gate['passed'].all() else 'NO'}")
        failed = df[~df["passed"].astype(bool)]["check"].tolist()
        if failed:
            text += f"; FAILED: {', '.join(failed[:5])}{' ...' if len(failed) > 5 else ''}"
        parts.append(text)
    return "; ".join(parts) if parts else None


def headline_alloc(data: pathlib.Path) -> list[str]:
    """The microbenchmark's headlines, from alloc_microbench.csv.

    Args:
        data: the CSV folder.

    Returns:
        Sentences on allocation cost, raw cudaMalloc's two states and thread scaling (empty without the CSV).
    """
    df, xp = _with_xpool(data, "alloc_microbench")
    if df is None:
        return []
    # the size sweep (one thread, on the main thread); the thread sweep's 1-thread case runs in a worker
    sized = df[df["sweep"] == "size"] if "sweep" in df else df[df["threads"] == df["threads"].min()]
    sizes = sorted(sized["size_bytes"].unique())
    size = 65536 if 65536 in sizes else int(sizes[0])
    at = sized[sized["size_bytes"] == size]

    def us(a, frame=at):
        return _med(frame[frame["allocator"] == a]["us_per_pair"])

    out = []
    have = set(at["allocator"])
    if xp in have and "cupy_pool" in have:
        rel = iv.paired(sized.assign(t=1 / sized["us_per_pair"]), "t", "allocator", xp, by=["size_bytes"])
        mine = rel[rel["allocator"] == "cupy_pool"].set_index("size_bytes")          # xpool's time / CuPy's
        r = mine.loc[size] if size in mine.index else None
        text = (f"**Allocation cost** ({plots.fmt_bytes(size)}, one thread): {xp} {_ci(*us(xp), unit=' µs')} per "
                f"alloc/free pair, CuPy MemoryPool {_ci(*us('cupy_pool'), unit=' µs')}")
        if r is not None:
            text += (f" (xpool takes {_ci(r['ratio'], r['ratio_lo'], r['ratio_hi'], unit='×')} CuPy's time; "
                     f"{mine['ratio'].min():.2f}× to {mine['ratio'].max():.2f}× over "
                     f"{plots.fmt_bytes(int(mine.index.min()))} to {plots.fmt_bytes(int(mine.index.max()))})")
        for peer, label in (("torch", "PyTorch's caching allocator"), ("cupy_async", "cudaMallocAsync"),
                            ("raw", "raw cudaMalloc/cudaFree"), ("c_noop", "floor (C allocator doing nothing)")):
            if peer in have:
                text += f", {label} {_ci(*us(peer), fmt='{:.3g}', unit=' µs')}"
        out.append(text + f" ({_where(df)}).")
    if "raw_held" in set(sized["allocator"]) and "raw" in set(sized["allocator"]):
        small = sized[sized["size_bytes"] == sizes[0]]
        alone, held = us("raw", small), us("raw_held", small)
        out.append(f"**Raw cudaMalloc and what else is allocated**: at {plots.fmt_bytes(sizes[0])}, a "
                   f"cudaMalloc/cudaFree pair costs {_ci(*alone, fmt='{:.3g}', unit=' µs')} with nothing else "
                   f"allocated and {_ci(*held, fmt='{:.3g}', unit=' µs')} while one other 512-byte block lives. "
                   f"(The first benchmark timed raw beside the other arms' cached blocks and reported 6.8 µs.)")
    threaded = df[df["sweep"] == "threads"] if "sweep" in df else df
    tsize = threaded[threaded["size_bytes"] == size]
    if len(tsize):
        top = int(tsize["threads"].max())
        k = tsize[tsize["threads"] == top]
        if top > 1 and xp in set(k["allocator"]) and "cupy_pool" in set(k["allocator"]):
            def kps(a):
                return _ci(*_med(k[k["allocator"] == a]["kpairs_per_s"]), fmt="{:.0f}", unit="k")
            text = (f"**{top} threads on one GPU** ({plots.fmt_bytes(size)}): {xp} {kps(xp)} pairs/s, "
                    f"CuPy MemoryPool {kps('cupy_pool')}")
            if "raw" in set(k["allocator"]):
                text += f", raw {kps('raw')}"
            out.append(text + f" ({_where(df)}).")
    return out


def headline_single(data: pathlib.Path) -> str | None:
    """The one-GPU headline, from single_gpu.csv.

    Args:
        data: the CSV folder.

    Returns:
        One sentence on one GPU at the largest batch, or None where the CSV is missing.
    """
    df, xp = _with_xpool(data, "single_gpu")
    if df is None:
        return None
    batch = int(df["batch"].max())
    b = df[df["batch"] == batch]
    if xp not in set(b["allocator"]):
        return None
    mine = b[b["allocator"] == xp]
    text = f"**One GPU** (batch {batch}): {xp} {_ci(*_med(mine['tokens_per_s']), fmt='{:,.0f}')} tokens/s"
    ratios = iv.paired(b, "tokens_per_s", "allocator", xp)
    for peer, label in (("raw", "raw cudaMalloc"), ("cupy_pool", "CuPy MemoryPool")):
        r = ratios[ratios["allocator"] == peer]
        if len(r):        # paired ratio peer / xpool: invert for xpool / peer
            r = r.iloc[0]
            text += f", {_ci(1 / r['ratio'], 1 / r['ratio_hi'], 1 / r['ratio_lo'], unit='×')} {label}"
    mallocs = mine["device_mallocs_per_step"].dropna()
    if len(mallocs):
        text += f"; {mallocs.max():g} device mallocs per step after warm-up"
    raw = b[b["allocator"] == "raw"]["device_mallocs_per_step"].dropna()
    if len(raw):
        text += f" (raw: {raw.median():g})"
    ror = mine["reserved_over_requested"].dropna()
    if len(ror):
        text += f"; peak reserved {ror.median():.2f}× requested"
    if "bound" in mine and mine["bound"].notna().any():
        text += f"; the step is {mine['bound'].mode().iloc[0]}-bound"
    if "adamw" in mine:
        text += f" ({', '.join(sorted(set(mine['adamw'].dropna().astype(str))))} AdamW)"
    return text + f" ({_where(df)})."


def headline_ddp(data: pathlib.Path) -> str | None:
    """The data-parallel headline, from ddp_scaling.csv.

    Args:
        data: the CSV folder.

    Returns:
        One sentence on the speedups at the largest GPU count, or None where the CSV is missing.
    """
    df, xp = _with_xpool(data, "ddp_scaling")
    if df is None:
        return None
    world = int(df["world"].max())
    top = df[df["world"] == world]
    parts = []
    for mode in [m for m in ("threads", "processes") if m in set(top["mode"])]:
        s = top[top["mode"] == mode]

        def sp(a):
            return _ci(*_med(s[s["allocator"] == a]["speedup"]), unit="×")
        if xp in set(s["allocator"]):
            before = f"raw {sp('raw')} → " if "raw" in set(s["allocator"]) else ""
            parts.append(f"{plots.MODES.get(mode, mode)}: {before}{xp} {sp(xp)}")
    if not parts:
        return None
    return f"**{world} GPUs**, speedup over one GPU: " + "; ".join(parts) + f" ({_where(df)})."


def headline_sweep(data: pathlib.Path) -> str | None:
    """The batch-sweep headline, from batch_sweep.csv.

    Args:
        data: the CSV folder.

    Returns:
        One sentence on the batch sweep's speedups, or None where the CSV is missing.
    """
    df, xp = _with_xpool(data, "batch_sweep")
    if df is None:
        return None
    world = int(df["world"].max())
    mine = df[(df["allocator"] == xp) & (df["world"] == world)]
    if not len(mine):
        return None
    s = iv.summarize(mine, ["batch"], "speedup").sort_values("batch")
    cells = ", ".join(f"{int(r.batch)}: {r.speedup:.2f}×" for r in s.itertuples())
    return (f"**Batch sweep**, one thread per GPU, {world} GPUs over one, {xp}, by per-GPU batch: {cells} "
            f"(medians; intervals in the figure) ({_where(df)}).")


def headline_memory(data: pathlib.Path) -> str | None:
    """The memory headline, from memory_waste.csv and memory_timeline.csv.

    Args:
        data: the CSV folder.

    Returns:
        One sentence on the waste of each size-class setting, or None where the CSV is missing.
    """
    df = _read(data, "memory_waste")
    if df is None:
        return None
    d = df.groupby("k").median(numeric_only=True)
    pct = ", ".join(f"k={k} {100 * (r['class_over_requested'] - 1):.2g}%" for k, r in d.iterrows())
    peak = ", ".join(f"{r['reserved_over_requested']:.2f}×" for _, r in d.iterrows())
    text = (f"**Memory waste** by size classes per doubling (k), over one training step's requests: {pct}; "
            f"peak reserved / peak requested over the run: {peak}")
    tl = _read(data, "memory_timeline")
    if tl is not None:
        from .memory_study import replay_waste
        rep = replay_waste(tl, tuple(int(k) for k in d.index)).set_index("k")
        exact = all(rep.loc[k, "peak_bytes_reserved"] == d.loc[k, "peak_bytes_reserved"] for k in d.index)
        text += (f". Replaying the recorded requests through xpool's core on the CPU reproduces the measured peak "
                 f"reserved bytes {'exactly for every k' if exact else 'NOT exactly'}")
    return text + f" ({_where(df)})."


def _hit_ratios(hit: pd.DataFrame) -> dict:
    """{size: (median, lo, hi)} of CuPy's pool's time over xpool's per trial in an alloc_hit_sweep CSV: the bench's
    own column, from the same interleaved windows, so the machine's drift between trials (up to 2x) cancels
    within a trial, which a ratio of medians over trials would mix in."""
    xp = hit[hit["allocator"] == "xpool"]
    return {int(size): _med(g["ratio_vs_cupy_pool"]) for size, g in xp.groupby("size_bytes", sort=True)}


def headline_hit(data: pathlib.Path) -> str | None:
    """The final hit path's headline, from alloc_hit_sweep.csv (and its second run in rerun/, if any).

    Args:
        data: the CSV folder.

    Returns:
        One sentence, or None where the CSV is missing.
    """
    hit = _read(data, "alloc_hit_sweep")
    if hit is None:
        return None

    def span(df):
        r = _hit_ratios(df).values()
        return min(r, key=lambda v: v[0]), max(v[0] for v in r)
    (w, lo, hi), best = span(hit)
    again = _read(data / RERUN, "alloc_hit_sweep")
    tail = ""
    if again is not None:
        (w2, _, _), best2 = span(again)
        tail = f"; a second run on a fresh machine: {w2:.2f}× to {best2:.2f}×"
    thr = _read(data, "alloc_hit_threads")
    if thr is not None:
        x = thr[(thr["allocator"] == "xpool") & (thr["threads"] == thr["threads"].max())]
        if len(x):
            tail += (f"; {int(x['threads'].max())} threads on one GPU (64 KiB): "
                     f"{_ci(*_med(x['ratio_vs_cupy_pool']), unit='×')}")
    return (f"**Allocation cost, final hit path** (`alloc_hit_sweep.csv`, commit "
            f"{_commits(data, ['alloc_hit_sweep.csv'])}, arms taking turns window by window): CuPy MemoryPool's "
            f"time over xpool's per trial, 4 KiB to 96 MiB, {w:.2f}× [{lo:.2f}, {hi:.2f}] at the worst size to "
            f"{best:.2f}×{tail} ({_where(hit)}).")


def headline_graph(data: pathlib.Path) -> str | None:
    """The CUDA-graph headline, from data/graph/ (threads on the largest world, one GPU at the smallest batch).

    Args:
        data: the CSV folder.

    Returns:
        One sentence, or None where the CSVs are missing.
    """
    ddp, b4 = _read(data, "graph/ddp_scaling"), _read(data, "graph/single_gpu_b4")
    single = _read(data, "graph/single_gpu")
    if ddp is None or single is None:
        return None
    a = GRAPH_ARM
    two = ddp[(ddp["mode"] == "threads") & (ddp["world"] == ddp["world"].max())]

    def sp(arm):
        return _ci(*_med(two[two["allocator"] == arm]["speedup"]), unit="×")
    disp = single[(single["allocator"] == a) & (single["batch"] == 32)]["dispatch_ms_per_step"]
    eager = single[(single["allocator"] == "xpool") & (single["batch"] == 32)]["dispatch_ms_per_step"]
    text = (f"**The step as a CUDA graph** (forward and backward captured over a private pool, bit-identical): "
            f"host work per step {_ci(*_med(disp), unit=' ms')} against {_ci(*_med(eager), fmt='{:.1f}', unit=' ms')} "
            f"eager; one thread per GPU on {int(two['world'].max())} GPUs at batch 32: raw {sp('raw')}, xpool "
            f"{sp('xpool')}, {a} {sp(a)}")
    if b4 is not None:
        g = b4[b4["allocator"] == a]
        text += f"; one GPU at batch 4: GPU busy {_ci(*_med(g['gpu_util_mean']), fmt='{:.0f}', unit='%')}"
    return text + f" (commit {_commits(data / 'graph')}, {_where(ddp)})."


def headlines(data: pathlib.Path) -> list[str]:
    """Every headline sentence the CSVs allow, in notebook order.

    Args:
        data: the CSV folder.

    Returns:
        A list of markdown sentences (a CSV that cannot be read costs its own line only).
    """
    out = []
    for fn in (headline_correctness, headline_alloc, headline_hit, headline_single, headline_ddp, headline_sweep,
               headline_graph, headline_memory):
        try:
            got = fn(data)
        except Exception as e:              # a CSV with an unexpected shape costs one line, not the report
            got = f"({fn.__name__}: could not compute from the CSV: {type(e).__name__}: {e})"
        if isinstance(got, list):
            out += got
        elif got:
            out.append(("**Correctness**: " + got + ".") if fn is headline_correctness else got)
    return out


# ---------------------------------------------------------------------------------------------------------
# The page

SECTIONS = [
    ("Correctness", ["correctness"]),
    ("Allocator microbenchmark", ["alloc_cost", "alloc_threads"]),
    ("One GPU", ["single_gpu"]),
    ("Several GPUs", ["ddp_scaling", "ddp_before_after", "batch_sweep"]),
    ("Memory", ["memory_waste", "memory_timeline", "memory_schemes"]),
    ("The step as a CUDA graph", ["graph_steps"]),
]


def _target(rows, target, med, lo, hi, goal, higher=True, fmt="{:.2f}", unit="", bound="—"):
    """Append one judged target row (nothing when the value is not measured)."""
    if med is None or not math.isfinite(med):
        return
    rows.append(dict(target=target, measured=_ci(med, lo, hi, fmt, unit),
                     verdict=iv.judge(med, lo, hi, goal, higher_is_better=higher), bound=bound))


def _exact(rows, target, value, ok, fmt="{:.2f}"):
    """A target on an exact quantity (a count, a bitwise check, a deterministic replay): no interval."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return
    rows.append(dict(target=target, measured=fmt.format(value), verdict=iv.MET if ok else iv.MISSED, bound="—"))


def _bound_of(df) -> str:
    """What bounds the steps of these training rows: their own `bound` (the most common), else decided from the
    medians as train.step_bound does (CSVs measured before rows recorded it); "?" when it cannot be told."""
    from .experiments.train import step_bound
    if df is None or not len(df):
        return "?"
    if "bound" in df and df["bound"].notna().any():
        return str(df["bound"].dropna().mode().iloc[0])

    def med(col):
        return float(df[col].median()) if col in df else math.nan
    return step_bound(med("gpu_util_mean"), med("host_ms_per_step"), med("ms_per_step")) or "?"


def _paired_row(df, value, arm, reference, **where):
    """(ratio, lo, hi) of arm over reference, paired by trial, among the rows matching `where`."""
    for k, v in where.items():
        df = df[df[k] == v]
    r = iv.paired(df, value, "allocator", reference)
    r = r[r["allocator"] == arm]
    return (r["ratio"].iloc[0], r["ratio_lo"].iloc[0], r["ratio_hi"].iloc[0]) if len(r) else (None, None, None)


def targets(data: pathlib.Path) -> list[dict]:
    """The issues' targets against the measurements, judged on 95% intervals over trials.

    Args:
        data: the CSV folder.

    Returns:
        One dict per target with target, measured ("median [lo, hi]" or "value (single run)"), verdict (met,
        missed, within noise, or single run with the median's side) and bound (what bounds the measured steps:
        host or gpu; host for the microbenchmark, whose pairs are host work; — for exact quantities).
    """
    rows = []
    bench = _read(data, "alloc_microbench")
    if bench is not None:
        sized = bench[bench["sweep"] == "size"] if "sweep" in bench else bench
        for xp in _xpools(bench["allocator"].unique()):
            worst = None
            for size in sorted(sized["size_bytes"].unique()):
                r = _paired_row(sized.assign(t=1 / sized["us_per_pair"]), "t", "cupy_pool", xp, size_bytes=size)
                if r[0] is not None and (worst is None or r[0] > worst[0]):
                    worst = r
            if worst:
                _target(rows, f"{xp} µs per pair ≤ 1.05× CuPy MemoryPool's, every size (worst size)", *worst, 1.05,
                        higher=False, unit="×", bound="host")
                if xp == "xpool" and _read(data, "alloc_hit_sweep") is None:    # else the later sweep judges it
                    _target(rows, "#14: xpool alloc+free ≤ CuPy MemoryPool's, every size (worst size, µs per pair)",
                            *worst, 1.0, higher=False, unit="×", bound="host")
            thr = bench[(bench["allocator"] == xp) & (bench["sweep"] == "threads")] if "sweep" in bench else None
            if thr is not None and {1, 8} <= set(thr["threads"]):
                r = iv.paired(thr.assign(arm=thr["threads"].astype(str)), "kpairs_per_s", "arm", "1")
                r = r[r["arm"] == "8"]
                if len(r):
                    _target(rows, f"{xp}: 8 threads ≥ 1 thread in pairs/s (ratio)", r["ratio"].iloc[0],
                            r["ratio_lo"].iloc[0], r["ratio_hi"].iloc[0], 1.0, unit="×", bound="host")
    hit = _read(data, "alloc_hit_sweep")      # the size sweep at the final hit path (arms taking turns per window)
    if hit is not None:
        worst = min(_hit_ratios(hit).values(), default=None, key=lambda r: r[0])
        if worst:
            _target(rows, f"#14: xpool alloc+free no slower than CuPy MemoryPool's, every size (worst size; CuPy's "
                    f"time / xpool's per trial; `alloc_hit_sweep.csv`, {int(hit['trial'].nunique())} trials, commit "
                    f"{_commits(data, ['alloc_hit_sweep.csv'])})", *worst, 1.0, unit="×", bound="host")
    single = _read(data, "single_gpu")
    if single is not None:
        def where(a, b):
            return single[(single["allocator"] == a) & (single["batch"] == b)]
        for xp in _xpools(single["allocator"].unique()):
            _target(rows, f"one GPU, batch 32: {xp} ≥ 2.9× raw (tokens/s)",
                    *_paired_row(single, "tokens_per_s", xp, "raw", batch=32), 2.9, unit="×",
                    bound=f"{xp} {_bound_of(where(xp, 32))}, raw {_bound_of(where('raw', 32))}")
            for b in (32, 4):
                _target(rows, f"one GPU, batch {b}: {xp} ≥ 1.00× CuPy MemoryPool (tokens/s)",
                        *_paired_row(single, "tokens_per_s", xp, "cupy_pool", batch=b), 1.0, unit="×",
                        bound=_bound_of(where(xp, b)))
        xp = _xpool(single["allocator"].unique())
        b32, b4 = where(xp, 32), where(xp, 4)
        _target(rows, f"one GPU, batch 32: {xp} ≥ 91.2k tokens/s (flat-buffer AdamW, H200)",
                *_med(b32["tokens_per_s"] / 1e3), 91.2, fmt="{:.1f}", unit="k", bound=_bound_of(b32))
        if "dispatch_ms_per_step" in b32 and b32["dispatch_ms_per_step"].notna().any():
            _target(rows, f"host ms per step ≤ 12 at batch 32 ({xp}, thread CPU time of a step started on an idle "
                    f"device)", *_med(b32["dispatch_ms_per_step"]), 12.0, higher=False, fmt="{:.1f}", unit=" ms",
                    bound="host")
        elif "host_ms_per_step" in b32:
            _target(rows, f"host ms per step ≤ 12 at batch 32 ({xp}, thread CPU time)",
                    *_med(b32["host_ms_per_step"]), 12.0, higher=False, fmt="{:.1f}", unit=" ms",
                    bound=_bound_of(b32))
        _target(rows, f"one GPU, batch 4: GPU busy ≥ 70% ({xp}, NVML)", *_med(b4["gpu_util_mean"]), 70.0,
                fmt="{:.0f}", unit="%", bound=_bound_of(b4))
        pools = single[single["allocator"].str.startswith("xpool")]["device_mallocs_per_step"].dropna()
        _exact(rows, "device mallocs per step after warm-up, every xpool run (max)", pools.max() if len(pools) else None,
               len(pools) and pools.max() == 0, "{:.0f}")
    ddp = _read(data, "ddp_scaling")
    if ddp is not None and (ddp["world"] == 2).any():
        two = ddp[ddp["world"] == 2]
        for mode, goal in (("threads", 1.85), ("processes", 1.95)):
            sub = two[two["mode"] == mode]
            unit = "thread" if mode == "threads" else "process"
            for xp in _xpools(sub["allocator"].unique()):
                _target(rows, f"2 GPUs, one {unit} per GPU, batch 32: {xp} ≥ {goal}×",
                        *_med(sub[sub["allocator"] == xp]["speedup"]), goal, unit="×",
                        bound=_bound_of(sub[sub["allocator"] == xp]))
            if mode == "threads" and "raw" in set(sub["allocator"]):
                _target(rows, "2 GPUs, one thread per GPU, batch 32: raw ≤ 1.3× (the cliff stays visible)",
                        *_med(sub[sub["allocator"] == "raw"]["speedup"]), 1.3, higher=False, unit="×",
                        bound=_bound_of(sub[sub["allocator"] == "raw"]))
        if "loss_rel_diff_max" in ddp:
            v = ddp["loss_rel_diff_max"].max()
            _exact(rows, "DDP loss vs one GPU on the same global batch ≤ 1e-6 (max relative difference)", v,
                   v <= 1e-6, "{:.1e}")
        if "param_rank_diff_max" in ddp:
            v = ddp["param_rank_diff_max"].max()
            _exact(rows, "parameters agree across ranks < 1e-6 (max abs difference)", v, v < 1e-6, "{:.1e}")
    waste = _read(data, "memory_waste")
    if waste is not None:
        best = waste.loc[waste["reserved_over_requested"].idxmin()]
        _exact(rows, f"peak reserved / peak requested ≤ 1.10 with the best class setting (k={int(best['k'])})",
               float(best["reserved_over_requested"]), best["reserved_over_requested"] <= 1.10, "{:.3f}")
    rows += memory_targets(data)
    rows += graph_targets(data)
    gpu = _read(data, "correctness_gpu")
    if gpu is not None:
        gate = gpu[gpu["check"].str.contains("transparency")]
        if len(gate):
            _exact(rows, "transparency gate: every allocator bit-identical to raw cudaMalloc (rows passing)",
                   float(gate["passed"].sum()), gate["passed"].all(), f"{{:.0f}} of {len(gate)}")
    return rows


GRAPH_ARM = "xpool_graph"


def graph_targets(data: pathlib.Path) -> list[dict]:
    """Issue 13's targets for the arm whose steps are CUDA graphs (data/graph/: xpool_graph beside the eager arms
    of the same runs). The eager rows' targets above stay as they are.

    Args:
        data: the CSV folder.

    Returns:
        Target rows, as targets() makes them (none when data/graph/ is absent).
    """
    rows, a = [], GRAPH_ARM
    ddp = _read(data, "graph/ddp_scaling")
    if ddp is not None:
        two = ddp[(ddp["world"] == 2) & (ddp["mode"] == "threads")]
        sub = two[two["allocator"] == a]
        _target(rows, f"2 GPUs, one thread per GPU, batch 32: {a} ≥ 1.85× (step as a CUDA graph)",
                *_med(sub["speedup"]), 1.85, unit="×", bound=_bound_of(sub))
        raw = two[two["allocator"] == "raw"]
        _target(rows, "2 GPUs, one thread per GPU, batch 32: raw ≤ 1.3× beside the graph arms (the cliff stays "
                "visible)", *_med(raw["speedup"]), 1.3, higher=False, unit="×", bound=_bound_of(raw))
    procs = _read(data, "graph/ddp_processes")
    if procs is not None:
        sub = procs[(procs["world"] == 2) & (procs["allocator"] == a)]
        _target(rows, f"2 GPUs, one process per GPU, batch 32: {a} ≥ 1.95×", *_med(sub["speedup"]), 1.95, unit="×",
                bound=_bound_of(sub))
    single = _read(data, "graph/single_gpu")
    if single is not None:
        b32 = single[(single["allocator"] == a) & (single["batch"] == 32)]
        _target(rows, f"host ms per step ≤ 12 at batch 32 ({a}, thread CPU time of a step started on an idle "
                "device)", *_med(b32["dispatch_ms_per_step"]), 12.0, higher=False, fmt="{:.2f}", unit=" ms",
                bound="host")
        _target(rows, f"one GPU, batch 32: {a} ≥ 91.2k tokens/s", *_med(b32["tokens_per_s"] / 1e3), 91.2,
                fmt="{:.1f}", unit="k", bound=_bound_of(b32))
        _target(rows, f"one GPU, batch 32: {a} ≥ 1.00× CuPy MemoryPool, eager (tokens/s)",
                *_paired_row(single, "tokens_per_s", a, "cupy_pool", batch=32), 1.0, unit="×", bound=_bound_of(b32))
    b4 = _read(data, "graph/single_gpu_b4")
    if b4 is not None:
        sub = b4[b4["allocator"] == a]
        _target(rows, f"one GPU, batch 4: GPU busy ≥ 70% ({a}, NVML over {int(sub['steps'].max())}-step windows)",
                *_med(sub["gpu_util_mean"]), 70.0, fmt="{:.0f}", unit="%", bound=_bound_of(sub))
    runs = [df for df in (ddp, procs, single, b4) if df is not None]
    if runs:
        m = pd.concat(runs)
        m = m[m["allocator"].str.endswith("_graph")]["device_mallocs_per_step"].dropna()
        _exact(rows, "device mallocs per step after warm-up, every graph run (max, private pools included)",
               m.max() if len(m) else None, len(m) and m.max() == 0, "{:.0f}")
    return rows


def graph_lines(data: pathlib.Path) -> list[str]:
    """The section on the step captured as a CUDA graph: per arm, what a step costs the host and the GPU, and
    what the GIL-held launcher gives threads (data/launch/, CuPy's launches, beside data/graph's direct ones).

    Args:
        data: the CSV folder.

    Returns:
        Markdown lines (none when data/graph/ is absent).
    """
    parts = [df for df in (_read(data, n) for n in ("graph/single_gpu", "graph/single_gpu_b4", "graph/ddp_scaling"))
             if df is not None]
    if not parts:
        return []
    df = pd.concat(parts, ignore_index=True)
    lines = ["Forward and backward captured once as a CUDA graph over a private pool of the arm's kind "
             "(`tapegpt.graph.CapturedStep`; the all-reduce and AdamW stay eager), replayed each step: bit-identical "
             "to the eager step (GPU tests). `_graph` arms: raw cudaMalloc cannot be captured, so only pools have "
             f"one. Measured at commit {_commits(data / 'graph')}.", "",
             "| run | arm | tokens/s | host ms per step | GPU ms per step | GPU busy (NVML) | speedup, 2 GPUs | bound |",
             "|---|---|---|---|---|---|---|---|"]
    for (mode, batch), g in df.groupby(["mode", "batch"], sort=False):
        for arm in plots.ordered(g["allocator"].unique()):
            r = g[g["allocator"] == arm]
            one = r[r["world"] == 1]
            two = r[r["world"] == 2]
            disp = one["dispatch_ms_per_step"].dropna() if "dispatch_ms_per_step" in one else []
            lines.append(
                f"| {'one GPU' if mode == 'single' else mode}, batch {batch}, {int(one['steps'].max())} steps "
                f"| {arm} | {_ci(*_med(one['tokens_per_s'] / 1e3), fmt='{:.1f}', unit='k')} "
                f"| {_ci(*_med(disp), fmt='{:.2f}') if len(disp) else '—'} "
                f"| {_ci(*_med(one['gpu_ms_per_step']), fmt='{:.1f}')} "
                f"| {_ci(*_med(one['gpu_util_mean']), fmt='{:.0f}', unit='%')} "
                f"| {_ci(*_med(two['speedup']), unit='×') if len(two) else '—'} | {_bound_of(one)} |")
    mem = df[(df["mode"] == "single") & (df["batch"] == df["batch"].max())]
    have = {"peak_reserved_bytes", "graph_pool_bytes"} <= set(mem.columns)
    eager = mem[mem["allocator"] == "xpool"]["peak_reserved_bytes"].dropna() if have else []
    graph = mem[mem["allocator"] == GRAPH_ARM]
    if len(eager) and len(graph):
        main, private = graph["peak_reserved_bytes"].median(), graph["graph_pool_bytes"].median()
        lines += ["", f"Memory, one GPU at batch {int(mem['batch'].max())}: eager xpool reserves at most "
                  f"{plots.fmt_bytes(eager.median())}; {GRAPH_ARM} {plots.fmt_bytes(main)} in the arm's pool plus "
                  f"{plots.fmt_bytes(private)} in the graph's private pool ({(main + private) / eager.median():.2f}× "
                  "eager): the private pool holds the step's working set for as long as the graph lives."]
    launch = _read(data, "launch/ddp_launch_cupy")
    ddp = _read(data, "graph/ddp_scaling")
    if launch is not None and ddp is not None:
        def sp(d, arm):
            s = d[(d["world"] == 2) & (d["mode"] == "threads") & (d["allocator"] == arm)]["speedup"]
            return _ci(*_med(s), unit="×") if len(s) else "—"
        lines += ["", "The GIL-held launcher (issue 13) in threads mode, eager steps, 2 GPUs, batch 32: xpool "
                  f"{sp(launch, 'xpool')} and CuPy's pool {sp(launch, 'cupy_pool')} with CuPy's launches "
                  f"(`TAPEGPT_LAUNCH=cupy`, commit {_commits(data / 'launch')}), against "
                  f"{sp(ddp, 'xpool')} and {sp(ddp, 'cupy_pool')} with direct ones (the table's run). Two runs on "
                  "two machines of one session: compare the intervals, not the medians."]
    proj = [p for p in projection(data, name="graph/single_gpu") if p["allocator"].endswith("_graph")]
    if proj:
        worlds = sorted(proj[0]["speedup"])
        lines += ["", "**Projection, not a measurement**, as in \"What bounds each step\" (same model and GIL sharing; "
                  "the all-reduce and the data-parallel step's flatten are left out): one thread per GPU at batch 32 "
                  "with the step as a graph. " + "; ".join(
                      f"{p['allocator']} (h {p['h']:.2f} ms, g {p['g']:.1f} ms): " + ", ".join(
                          f"{n} GPUs {p['speedup'][n]:.2f}×" for n in worlds) for p in proj) + "."]
    again = replication_lines(data / "graph", where="data/graph")
    if again:
        lines += ["", "**Again on a fresh machine.** " + again[0]] + again[1:]
    return lines


def _ror(df, allocator, **where) -> float | None:
    """The median peak reserved / peak requested of `allocator`'s rows matching `where` (None: no such row)."""
    for k, v in where.items():
        df = df[df[k] == v]
    v = df[df["allocator"] == allocator]["reserved_over_requested"].dropna()
    return float(v.median()) if len(v) else None


def memory_targets(data: pathlib.Path) -> list[dict]:
    """Issue #14's memory targets at the default scheme (`xpool`): peak reserved / peak requested ≤ 1.05 at
    batch 32, ≤ CuPy's pool at batch 4 (one-GPU training rows) and on the varying-length trace: measured on a GPU
    (memory_varlen.csv) where that exists, else replayed on the CPU from the NumPy trace (memory_schemes.csv,
    against the model of CuPy's pool), and the target says which. Peaks are exact counters, deterministic for
    a program: no interval, and equal counts as ≤.

    Args:
        data: the CSV folder.

    Returns:
        Target rows, as targets() makes them.
    """
    rows = []
    # the one-GPU re-check at the final release rule where it exists (single_gpu_recheck.csv), else single_gpu.csv
    single, where = _read(data, "single_gpu_recheck"), None
    if single is not None:
        where = f"one GPU, `single_gpu_recheck.csv`, commit {_commits(data, ['single_gpu_recheck.csv'])}"
    else:
        single, where = _read(data, "single_gpu"), "one GPU"
    if single is not None and "reserved_over_requested" in single:
        v = _ror(single, "xpool", batch=32)
        _exact(rows, f"#14: batch 32: xpool peak reserved / peak requested ≤ 1.05 ({where})", v,
               v is not None and v <= 1.05, "{:.3f}")
        v, c = _ror(single, "xpool", batch=4), _ror(single, "cupy_pool", batch=4)
        if c is not None:
            _exact(rows, f"#14: batch 4: xpool peak reserved / peak requested ≤ CuPy MemoryPool's ({where})", v,
                   v is not None and v <= c, "{:.3f} (CuPy " + f"{c:.3f})")
        m = single[single["allocator"] == "xpool"].get("device_mallocs_per_step", pd.Series(dtype=float)).dropna()
        if len(m):
            _exact(rows, f"#14: xpool device mallocs per step after warm-up, batch 4 and 32 (max; {where})",
                   m.max(), m.max() == 0, "{:.0f}")
        for b in sorted(single["batch"].unique()):
            r, lo, hi = _paired_row(single, "tokens_per_s", "xpool", "cupy_pool", batch=b)
            if r is not None and math.isfinite(lo):
                # the "within the interval of CuPy's pool": xpool's paired ratio reaches 1 or above
                rows.append(dict(target=f"#14: batch {b}: xpool tokens/s within CuPy MemoryPool's ({where}; the "
                                 "paired ratio's interval reaches 1)", measured=_ci(r, lo, hi, unit="×"),
                                 verdict=iv.MET if hi >= 1.0 else iv.MISSED, bound=_bound_of(
                                     single[(single["allocator"] == "xpool") & (single["batch"] == b)])))
    varlen, label = _read(data, "memory_varlen"), None
    if varlen is not None:
        v, c = _ror(varlen, "xpool"), _ror(varlen, "cupy_pool")
        label = f"measured, {plots.provenance_summary(varlen)['gpu']}"
    else:
        schemes = _read(data, "memory_schemes")
        if schemes is not None:
            v = _ror(schemes, "xpool", trace="gpt_varlen_numpy")
            c = _ror(schemes, "cupy_pool_model", trace="gpt_varlen_numpy")
            label = "CPU replay of the NumPy trace, not measured on a GPU"
    if label and c is not None:
        _exact(rows, f"#14: varying sequence lengths: xpool peak reserved / peak requested ≤ CuPy's pool ({label})",
               v, v is not None and v <= c, "{:.3f} (CuPy " + f"{c:.3f})")
    return rows


# ---------------------------------------------------------------------------------------------------------
# What bounds each row, and a projection to more GPUs


def bound_rows(data: pathlib.Path, name: str = "single_gpu") -> list[dict]:
    """One row per (batch, allocator) of the one-GPU CSV: ms per step, host ms, GPU stream ms, GPU busy ms and %,
    and what bounds the step (the rows' own `bound`, else from utilisation as train.step_bound decides).

    Args:
        data: the CSV folder.

    Returns:
        A list of dicts: batch, allocator, and (median, lo, hi) for ms, host, stream, busy and util; bound.
    """
    from .experiments.train import step_bound
    df = _read(data, name)      # name: the one-GPU CSV (graph/single_gpu: the graph runs')
    if df is None:
        return []
    out = []
    for (batch, alloc), g in df.groupby(["batch", "allocator"], sort=False):
        def m(col):
            return _med(g[col]) if col in g else (math.nan, math.nan, math.nan)
        ms, host, util = m("ms_per_step"), m("host_ms_per_step"), m("gpu_util_mean")
        dispatch = m("dispatch_ms_per_step")
        bound = (g["bound"].mode().iloc[0] if "bound" in g and g["bound"].notna().any()
                 else step_bound(util[0], host[0], ms[0]))
        out.append(dict(batch=int(batch), allocator=alloc, ms=ms, host=host, dispatch=dispatch,
                        stream=m("gpu_ms_per_step"),
                        gc=m("gc_ms_per_step"),
                        busy=(ms[0] * util[0] / 100,) * 3 if not math.isfinite(m("gpu_busy_ms_per_step")[0])
                        else m("gpu_busy_ms_per_step"), util=util, bound=bound or "?"))
    return out


GIL_ARM = "add"    # the GIL probe's op that stands for a training step's ops: an allocation and one launch


def gil_sharing(data: pathlib.Path, arm: str = GIL_ARM) -> dict:
    """What N dispatching threads get done together, as a fraction of one thread: {N: (median, lo, hi)} of
    the GIL probe's (data/gil_probe.csv) total ops per second on N threads over one thread's, paired by trial.

    Args:
        data: the CSV folder.
        arm: the probe's op (default GIL_ARM).

    Returns:
        A dict (empty without the probe's CSV).
    """
    df = _read(data, "gil_probe")
    if df is None:
        return {}
    df = df[df["arm"] == arm]
    if "switch_interval_s" in df and df["switch_interval_s"].nunique() > 1:      # Python's default, 5 ms
        df = df[np.isclose(df["switch_interval_s"], 0.005)]
    return {int(n): _med(g["speedup"]) for n, g in df.groupby("threads") if n > 1}


def gil_lines(data: pathlib.Path) -> list[str]:
    """Markdown: the GIL probe, ops per second of N threads against one, per op (empty without its CSV)."""
    df = _read(data, "gil_probe")
    if df is None:
        return []
    if "switch_interval_s" in df and df["switch_interval_s"].nunique() > 1:
        df = df[np.isclose(df["switch_interval_s"], 0.005)]
    threads = sorted(n for n in df["threads"].unique() if n > 1)
    out = ["What dispatching threads cost each other under one GIL (`xlab.bench.gil`, host-bound by design): each op "
           "runs in a loop on 1 thread, then on N threads (thread t on GPU t mod 2); the table gives all N threads' "
           "ops per second over one thread's, median of paired trials [95% interval]. 1.0 would be perfect "
           "serialisation; more would be parallel work. CuPy releases the GIL around every driver call, so a "
           "waiting thread is woken at every launch and the threads trade the lock (the convoy effect).", "",
           "| op | µs per op, 1 thread | " + " | ".join(f"{n} threads / 1" for n in threads) + " |",
           "|---|---|" + "---|" * len(threads)]
    labels = {"python": "pure Python (holds the GIL)", "launch": "empty kernel launch through CuPy (GIL released)",
              "launch_gil": "empty kernel launch by ctypes.PyDLL (GIL held)",
              "launch8": "8-argument kernel launch through CuPy (GIL released)",
              "launch8_gil": "8-argument kernel launch by ctypes.PyDLL (GIL held)",
              "add": "`x + x`, 1 element, CuPy (allocation + launch, GIL released)",
              "gemm": "16×16 GEMM by tapegpt.blas (allocation + cuBLAS call; GIL as tapegpt.launch decides)",
              "gemm_gil": "cublasGemmEx alone by ctypes.PyDLL (GIL held)", "matmul": "16×16 GEMM, cupy.matmul"}
    for arm, g in df.groupby("arm", sort=False):
        one = g[g["threads"] == 1]["us_per_op"]
        cells = [_ci(*_med(g[g["threads"] == n]["speedup"]), unit="×") for n in threads]
        out.append(f"| {labels.get(arm, arm)} | {_ci(*_med(one), fmt='{:.1f}')} | " + " | ".join(cells) + " |")
    return out


def projection(data: pathlib.Path, worlds=(2, 4, 8), name: str = "single_gpu") -> list[dict]:
    """A projection (not a measurement) of one thread per GPU on N GPUs at batch 32 from one-GPU rows.

    Model: the ranks' host work h runs one rank at a time under the GIL, and N threads together get through
    only s_N times one thread's ops per second (the GIL probe: handing the lock over costs), while their GPU
    work g overlaps; so a step takes max(N·h / s_N, g) against max(h, g) on one GPU (the all-reduce is left
    out): speedup N·max(h, g) / max(N·h / s_N, g). s_N = 1 where the probe did not run N threads.
    h is the batch-32 step's dispatch time (thread CPU time of a step started on an idle device; older CSVs:
    the window's thread time, or the batch-4 step's wall time), g its GPU busy time (wall × NVML utilisation).

    Args:
        data: the CSV folder.
        worlds: the GPU counts to project to.
        name: the one-GPU CSV the rows come from.

    Returns:
        One dict per allocator: allocator, h, g, h_source, sharing ({N: s_N}) and {N: projected speedup}.
    """
    rows = {(r["batch"], r["allocator"]): r for r in bound_rows(data, name)}
    share = {n: v[0] for n, v in gil_sharing(data).items()}
    out = []
    for (batch, alloc), r in rows.items():
        if batch != 32 or alloc == "raw":
            continue
        g = r["busy"][0]
        if math.isfinite(r["dispatch"][0]):
            h, src = r["dispatch"][0], "batch-32 dispatch (thread CPU time, idle device)"
        elif math.isfinite(r["host"][0]):
            h, src = r["host"][0], "batch-32 thread CPU time"
        elif (4, alloc) in rows:
            h, src = rows[4, alloc]["ms"][0], "batch-4 wall time (no host ms in this CSV)"
        else:
            continue
        if not (math.isfinite(h) and math.isfinite(g)) or h <= 0 or g <= 0:
            continue
        s = {n: share.get(n, 1.0) for n in worlds}
        out.append(dict(allocator=alloc, h=h, g=g, h_source=src, sharing=s,
                        speedup={n: n * max(h, g) / max(n * h / s[n], g) for n in worlds}))
    return out


def bounds(data: pathlib.Path) -> list[str]:
    """Markdown: what bounds each one-GPU row, and the projection of one thread per GPU to 4 and 8 GPUs.

    Args:
        data: the CSV folder.

    Returns:
        Markdown lines (empty without the one-GPU CSV).
    """
    rows = bound_rows(data)
    if not rows:
        return []
    out = ["What bounds each one-GPU row: host ms is the dispatching thread's CPU time per step in the timed "
           "window (a host ahead of a busy GPU spins in a full launch queue, and that counts), dispatch ms the same "
           "for steps started on an idle device (the host's own work), stream ms the "
           "step's span on the GPU's stream (CUDA events; it equals the wall time when the host is the bound), "
           "busy ms the wall time times NVML's utilisation. A step is GPU-bound when the GPU is busy at least "
           "80% of the time.", "",
           "| batch | allocator | ms per step | host ms | dispatch ms | stream ms | GPU busy ms | GPU busy | GC ms | "
           "bound |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (-r["batch"], plots.ordered([a["allocator"] for a in rows]).index(r["allocator"]))):
        out.append(f"| {r['batch']} | {r['allocator']} | {_ci(*r['ms'], fmt='{:.1f}')} | "
                   f"{_ci(*r['host'], fmt='{:.1f}')} | {_ci(*r['dispatch'], fmt='{:.1f}')} | "
                   f"{_ci(*r['stream'], fmt='{:.1f}')} | "
                   f"{r['busy'][0]:.1f} | {_ci(*r['util'], fmt='{:.0f}', unit='%')} | "
                   f"{_ci(*r['gc'], fmt='{:.2f}')} | {r['bound']} |")
    single = _read(data, "single_gpu")
    if single is not None and "gc" in single and single["gc"].notna().any():
        out += ["", f"Python's garbage collector: {', '.join(sorted(set(single['gc'].dropna().astype(str))))} in every "
                f"arm alike; GC ms is the collector's pause time per step inside the timed window (gc.callbacks)."]
    proj = projection(data)
    if proj:
        worlds = sorted(proj[0]["speedup"])
        out += ["", "**Projection, not a measurement**: one thread per GPU on N GPUs at batch 32, from the one-GPU "
                "rows above and the GIL probe below. The ranks' host work h runs one rank at a time under the GIL, "
                "N threads together get through s_N times one thread's ops (the probe's `x + x` row; 1 where it "
                "did not run N threads), and their GPU work g overlaps, so a step takes max(N·h/s_N, g) against "
                "max(h, g) on one GPU; the all-reduce is left out, so these are upper bounds. Replace them with "
                "measurements once 4- and 8-GPU machines run the ddp stage (`WORLDS=\"1 2 4 8\"`).", "",
                "| allocator | h (host ms) | g (GPU ms) | h from | " + " | ".join(f"{n} GPUs (s_{n})" for n in worlds)
                + " |", "|---|---|---|---|" + "---|" * len(worlds)]
        for p in proj:
            out.append(f"| {p['allocator']} | {p['h']:.1f} | {p['g']:.1f} | {p['h_source']} | "
                       + " | ".join(f"{p['speedup'][n]:.2f}× ({p['sharing'][n]:.2f})" for n in worlds) + " |")
        ddp = _read(data, "ddp_scaling")
        if ddp is not None:
            two = ddp[(ddp["mode"] == "threads") & (ddp["world"] == 2)]
            got = [f"{p['allocator']} {_ci(*_med(two[two['allocator'] == p['allocator']]['speedup']), unit='×')}"
                   for p in proj if p["allocator"] in set(two["allocator"]) and 2 in p["speedup"]]
            if got:
                out += ["", "Measured on 2 GPUs, for comparison with the 2-GPU column: " + ", ".join(got) + "."]
    return out


# ---------------------------------------------------------------------------------------------------------
# A second run on a fresh machine (issue #12): do its ratios fall inside the first run's intervals?

RERUN = "rerun"     # data/rerun/: the same suite run again on a fresh machine (DATA=data/rerun)


def _ratios(data: pathlib.Path) -> dict:
    """Every ratio the targets rest on, as {name: (ratio, lo, hi)}: xpool and raw against CuPy's pool (one GPU,
    paired trials), speedups over one GPU (data-parallel and the batch sweep), and the microbenchmark's time
    against CuPy's pool."""
    out = {}
    singles = [df for df in (_read(data, "single_gpu"), _read(data, "single_gpu_b4")) if df is not None]
    for single in singles:      # single_gpu_b4: the graph runs' batch 4, a longer window, in its own CSV
        for b in sorted(single["batch"].unique()):
            sub = single[single["batch"] == b]
            for arm in sorted(set(sub["allocator"]) - {"cupy_pool"}):
                r = _paired_row(sub, "tokens_per_s", arm, "cupy_pool")
                if r[0] is not None:
                    out[f"one GPU, batch {b}: {arm} / CuPy pool, tokens/s"] = r
    for name, label in (("ddp_scaling", "2 GPUs"), ("batch_sweep", "batch sweep, 2 GPUs")):
        df = _read(data, name)
        if df is None or not (df["world"] == 2).any():
            continue
        two = df[df["world"] == 2]
        for (mode, b, arm), g in two.groupby(["mode", "batch", "allocator"], sort=True):
            out[f"{label}, {mode}, batch {b}: {arm} speedup"] = _med(g["speedup"])
    bench = _read(data, "alloc_microbench")
    if bench is not None and "ratio_vs_cupy_pool" in bench:
        sized = bench[bench["sweep"] == "size"] if "sweep" in bench else bench
        for (arm, size), g in sized.groupby(["allocator", "size_bytes"], sort=True):
            if arm != "cupy_pool":
                out[f"microbenchmark, {plots.fmt_bytes(int(size))}: CuPy pool's time / {arm}'s"] = _med(
                    g["ratio_vs_cupy_pool"])
    hit = _read(data, "alloc_hit_sweep")      # the final hit path's size sweep: per-trial ratios, as its target
    if hit is not None:
        for size, r in _hit_ratios(hit).items():
            out[f"alloc+free sweep (final hit path), {plots.fmt_bytes(size)}: CuPy pool's time / xpool's"] = r
    torch = _read(data, "torch_interop")
    if torch is not None:
        for (case, size), g in torch.groupby(["case", torch["size_bytes"].fillna(0)], sort=True):
            faster = g.assign(v=1 / g["value"]) if (g["unit"] == "us_per_pair").all() else g.assign(v=g["value"])
            r = iv.paired(faster, "v", "arm", "native")
            r = r[r["arm"] == "xpool"]
            if len(r):
                what = f"{case}, {plots.fmt_bytes(int(size))}" if size else case
                out[f"PyTorch {what}: xpool / PyTorch's allocator (speed)"] = (
                    r["ratio"].iloc[0], r["ratio_lo"].iloc[0], r["ratio_hi"].iloc[0])
    gil = gil_sharing(data)
    for n, v in gil.items():
        out[f"GIL probe ({GIL_ARM}): {n} threads / 1 thread, ops per second"] = v
    return out


def _commits(data: pathlib.Path, names=None) -> str:
    """The commits the CSVs of a folder (only those named, when given) were measured at, comma-separated."""
    found = set()
    for f in sorted(data.glob("*.csv")):
        if names is not None and f.name not in names:
            continue
        df = pd.read_csv(f, usecols=lambda c: c == "commit")
        if "commit" in df:
            found |= set(df["commit"].dropna().astype(str))
    return ", ".join(sorted(found)) or "unknown"


def replication(data: pathlib.Path) -> list[dict]:
    """Each ratio of data/rerun/ (a second run on a fresh machine) against the first run's interval.

    Args:
        data: the CSV folder; its rerun/ subfolder holds the second run.

    Returns:
        One dict per ratio measured in both: name, first (median, lo, hi), second (median, lo, hi) and inside
        (True when the second median lies in the first run's interval; None when the first has no interval).
    """
    if not (data / RERUN).is_dir():
        return []
    first, second = _ratios(data), _ratios(data / RERUN)
    rows = []
    for name in [n for n in first if n in second]:
        (m1, lo1, hi1), m2 = first[name], second[name]
        inside = (lo1 <= m2[0] <= hi1) if math.isfinite(lo1) and math.isfinite(hi1) else None
        rows.append(dict(name=name, first=(m1, lo1, hi1), second=m2, inside=inside))
    return rows


def replication_lines(data: pathlib.Path, where: str = "data") -> list[str]:
    """Markdown for `replication` (empty when there is no second run); `where` names the folder in the text."""
    rows = replication(data)
    if not rows:
        return []
    judged = [r for r in rows if r["inside"] is not None]
    names = {f.name for f in (data / RERUN).glob("*.csv")}
    out = [f"A second run of the suite on a fresh machine (`{where}/{RERUN}/`, commits {_commits(data / RERUN)}; first "
           f"run: commits {_commits(data, names)}): {sum(r['inside'] for r in judged)} "
           f"of {len(judged)} ratios fall inside the first run's 95% interval"
           + (f" ({len(rows) - len(judged)} more without an interval in the first run)" if len(judged) < len(rows)
              else "") + f"; {sum(abs(_change(r)) <= 0.05 for r in rows)} of {len(rows)} medians within 5% of the "
           "first run's. Where one falls outside, the row says **no**; the change column says by how much (an "
           "interval of paired trials can be far narrower than the difference between two machines).", "",
           "| ratio | first run | second run | change | inside |", "|---|---|---|---|---|"]
    for r in rows:
        verdict = "n/a" if r["inside"] is None else ("yes" if r["inside"] else "**no**")
        out.append(f"| {r['name']} | {_ci(*r['first'], unit='×')} | {_ci(*r['second'], unit='×')} | "
                   f"{100 * _change(r):+.1f}% | {verdict} |")
    return out


def _change(row) -> float:
    """The second run's median over the first's, minus one."""
    return row["second"][0] / row["first"][0] - 1 if row["first"][0] else math.nan


def data_table(data: pathlib.Path) -> list[str]:
    """The CSVs in data/ with their provenance, as a markdown table.

    Args:
        data: the CSV folder.

    Returns:
        Markdown lines.
    """
    rows = ["| CSV | rows | measured on | driver | CUDA | CuPy | commit | date |", "|---|---|---|---|---|---|---|---|"]
    for p in sorted(data.glob("*.csv")) + sorted((data / RERUN).glob("*.csv")):
        df = pd.read_csv(p)
        if not set(plots.PROVENANCE) & set(df.columns):
            continue
        s = plots.provenance_summary(df)
        rows.append(f"| `data/{p.relative_to(data).as_posix()}` | {len(df)} | {s['gpu']} | {s['driver']} | {s['cuda']} | {s['cupy']} | "
                    f"{s['commit']} | {s['date']} |")
    return rows


def render(data: pathlib.Path, runs: list[dict], figs: dict, report_dir: pathlib.Path) -> str:
    """The report's markdown; figure links are relative to `report_dir` (build/ and report/ are both one
    level below the repository, so one text serves both).

    Args:
        data: the CSV folder.
        runs: run_notebook results (an empty list leaves the notebooks section out).
        figs: plots.build_all's result.
        report_dir: where the page will live.

    Returns:
        The markdown text.
    """
    lines = ["# xpool: results", "",
             "_Generated by `python -m xlab.report` (`make report`) from the CSVs in `data/`: every number here is "
             "computed from them, every figure is drawn from them alone._", "", "## Headlines", ""]
    heads = headlines(data)
    lines += [f"- {h}" for h in heads] if heads else ["- No measurements in `data/` yet."]
    missing = [f"`{n}.csv`" for n in ("alloc_microbench", "single_gpu", "ddp_scaling", "batch_sweep",
                                      "memory_waste", "correctness_gpu") if not (data / f"{n}.csv").is_file()]
    if missing:
        lines.append(f"- Not measured yet (run the notebooks or `make gpu` on a GPU machine): {', '.join(missing)}.")
    try:
        rows = targets(data)
    except (KeyError, ValueError, IndexError, TypeError) as e:    # a malformed CSV costs the table, not the report
        rows = []
        lines.append(f"- Targets: could not compute ({type(e).__name__}: {e}).")
    if rows:
        count = {v: sum(r["verdict"] == v for r in rows) for v in (iv.MET, iv.MISSED, iv.NOISE)}
        single = sum(r["verdict"].startswith(iv.SINGLE) for r in rows)
        lines += ["", "## Targets", "",
                  f"{len(rows)} targets: {count[iv.MET]} met, {count[iv.MISSED]} missed, {count[iv.NOISE]} within "
                  f"noise, {single} from a single run. Measured: the median over trials [95% bootstrap interval]; "
                  f"ratios over paired trials. A target is met when the whole interval is on its side, missed when "
                  f"the whole interval is not, and within noise when the interval straddles it.", "",
                  "Bound: what bounds the measured steps (host: the GPU waited for Python; gpu: it did not).", "",
                  "| target | measured | verdict | bound |", "|---|---|---|---|"]
        lines += [f"| {r['target']} | {r['measured']} | "
                  f"{r['verdict'] if r['verdict'] != iv.MISSED else '**missed**'} | {r['bound']} |" for r in rows]
    for title, fn in (("What bounds each step", bounds), ("Threads under one GIL", gil_lines),
                      ("The step as a CUDA graph", graph_lines), ("Does a second run agree?", replication_lines)):
        try:
            got = fn(data)
        except (KeyError, ValueError, IndexError, TypeError) as e:     # a malformed CSV costs its section only
            got = [f"(could not compute: {type(e).__name__}: {e})"]
        if got:
            lines += ["", f"### {title}", ""] + got + [""]
    for title, names in SECTIONS:
        lines += ["", f"## {title}", ""]
        for name in names:
            got = figs.get(name)
            if isinstance(got, pathlib.Path):
                rel = pathlib.Path(os.path.relpath(got.resolve(), report_dir.resolve())).as_posix()
                lines += [f"![{name}]({rel})", ""]
            else:
                lines += [f"_{name}: {got or 'not built'}._", ""]
    if runs:
        lines += ["## Notebooks", "", "| notebook | result |", "|---|---|"]
        lines += [f"| `notebooks/{r['notebook']}.ipynb` | {'ran' if r['ok'] else 'FAILED: ' + r['error'][:200]} |"
                  for r in runs]
        lines.append("")
    lines += ["## Data", ""] + data_table(data) + [""]
    return "\n".join(lines)


def main(argv=None) -> int:
    """The command line (see the module docstring and --help).

    Args:
        argv: arguments (default: sys.argv[1:]).

    Returns:
        The exit status: 1 if a notebook failed, else 0.
    """
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-quick", action="store_true",
                   help="CPU mode with small parameters (never measures, even on a GPU): what CI runs")
    p.add_argument("--only", nargs="*", default=None, metavar="NN",
                   help="run only the notebooks whose names start with these prefixes, e.g. --only 01 05")
    p.add_argument("--no-notebooks", action="store_true", help="skip the notebooks: figures and report only")
    p.add_argument("--timeout", type=int, default=1800, help="seconds one notebook cell may run (default 1800)")
    p.add_argument("--data", default=None, help="CSV folder (default: data/); passed to the notebooks too")
    p.add_argument("--figures", default=None, help="figure folder (default: figures/); passed to the notebooks too")
    p.add_argument("--build", default=None,
                   help="where executed notebooks and report.md go (default: build/)")
    p.add_argument("--report-dir", default=None,
                   help="where REPORT.md is copied (default: report/)")
    args = p.parse_args(argv)
    root = paths.repo_root()
    data = pathlib.Path(args.data) if args.data else root / "data"
    figures = pathlib.Path(args.figures) if args.figures else root / "figures"
    build = pathlib.Path(args.build) if args.build else root / "build"
    report_dir = pathlib.Path(args.report_dir) if args.report_dir else root / "report"

    runs = []
    t0 = time.perf_counter()
    if not args.no_notebooks:
        folders = {k: str(v) for k, v in (("data_dir", args.data), ("figures_dir", args.figures)) if v}
        for nb in notebooks(root, args.only):
            params = dict(CPU_QUICK.get(nb.stem, {})) if args.cpu_quick else {}
            r = run_notebook(nb, build / "notebooks", {**params, **folders}, args.timeout)
            runs.append(r)
            print(f"{'ok    ' if r['ok'] else 'FAILED'} {r['notebook']:<26} {r['seconds']:6.1f} s  {r['output']}"
                  + (f"\n       {r['error']}" if r["error"] else ""), flush=True)

    figs = plots.build_all(data, figures)
    for name, got in figs.items():
        print(f"figure {name:<18} {got}")
    build.mkdir(parents=True, exist_ok=True)
    report_dir.mkdir(parents=True, exist_ok=True)
    # build/report.md says how this run's notebooks went; the committed page holds only what data/ says, so it
    # changes when the data does and not when a run does
    (build / "report.md").write_text(render(data, runs, figs, report_dir))
    (report_dir / "REPORT.md").write_text(render(data, [], figs, report_dir))
    print(f"report: {build / 'report.md'} and {report_dir / 'REPORT.md'} ({time.perf_counter() - t0:.0f} s in all)")
    failed = [r["notebook"] for r in runs if not r["ok"]]
    if failed:
        print(f"FAILED notebooks: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
