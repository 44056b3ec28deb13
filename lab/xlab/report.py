"""Run every notebook through papermill, rebuild figures/ from data/*.csv, write the report and README's results.

    python -m xlab.report              # notebooks with their defaults (on a GPU they measure, into build/)
    python -m xlab.report --cpu-quick  # CPU mode with small parameters: what CI runs, a few minutes

Executed notebooks go to build/notebooks/; the report to build/report.md and, committed, report/REPORT.md (without
the notebooks' run status); README.md's results table (between its RESULTS markers) is rewritten from the same
rows. The page is the template xlab/report.md filled from the CSVs: the summary (SUMMARY), the numbers and targets
from xlab.targets, the tables from xlab.sources' rows; nothing but what the CSVs say (no run date or timing), so an
unchanged data/ gives an unchanged report and README.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.resources
import math
import os
import pathlib
import re
import string
import sys
import time

import numpy as np
import pandas as pd

from . import intervals as iv, paths, plots, shared, sources, summaries, targets
from .memory_study import replay_waste   # the one instrument the report runs: a CPU replay of memory_timeline.csv
from .shared import HOST_BOUND_UTIL, step_bound
from .summaries import dynamic_summary

# Small parameters for CI: CPU mode (never measure, even on a GPU) and the fewest steps that run the code.
CPU_QUICK = {
    "01_correctness": dict(measure=False, transparency_steps=5),
    "02_allocator_microbench": dict(measure=False, quick=True),
    "03_single_gpu": dict(measure=False, steps=3, warmup=1, trials=2),
    "04_multi_gpu": dict(measure=False, steps=3, trials=2),
    "05_memory": dict(measure=False),
    "06_dynamic_shapes": dict(measure=False),
}
TEMPLATE = importlib.resources.files("xlab") / "report.md"       # package data: the page's template
GIL_ARM = "add"    # the GIL probe's op that stands for a training step's ops: an allocation and one launch
RERUN = sources.SECOND_RUN    # data/rerun/: the same suite run a second time (DATA=data/rerun)
# Issue #46's section, and the figure of its memory headlines
SCALE_SECTION, SCALED_FIGURE = "At the scale users run them", "dynamic_scale"
# README.md's generated results table sits between these two lines
RESULTS = ("<!-- RESULTS: written by `make report` from the targets (lab/xlab/report.py); do not edit by hand -->",
           "<!-- END RESULTS -->")
WINS = ("<!-- WINS: written by `make report` from the targets (lab/xlab/report.py); do not edit by hand -->",
        "<!-- END WINS -->")
MISSES = ("<!-- MISSES: written by `make report` from the targets (lab/xlab/report.py); do not edit by hand -->",
          "<!-- END MISSES -->")
# the template's line above which the page is REPORT.md and below which its full tables are TABLES.md
TABLES_MARK = "<!-- TABLES -->"


@dataclasses.dataclass(frozen=True)
class Headline:
    """A row of the report's summary: a target (value, interval, verdict), the figure that shows it, and whether
    README's results table has it too. The numbers measured beside it are the section's, not the summary's: a cell
    holds the value, its interval and the goal, no more."""

    question: str              # the report's section it sums up
    text: str                  # what is measured, in words
    key: str                   # a row of targets.TARGETS with a goal
    figure: str                # a name of plots.FIGURES
    readme: bool = False


H = Headline
XC, XT = shared.FRONT_END_NAMES["cupy"], shared.FRONT_END_NAMES["torch"]
SUMMARY = (
    H("Correctness", "training under every allocator is bit-identical to raw cudaMalloc's", "gate", "correctness",
      readme=True),
    H("Allocation cost", f"{XC}'s alloc+free speed-up over CuPy's MemoryPool, at its worst request size",
      "hit_worst", "alloc_cost", readme=True),
    H("One GPU", f"{XC}'s GPT training speed-up over CuPy's MemoryPool, one GPU, batch 32", "vs_cupy_32",
      "single_gpu", readme=True),
    H("One GPU", f"{XC}'s peak reserved / peak requested, one GPU, batch 32", "ror_32", "single_gpu", readme=True),
    H("Two GPUs", f"{XC}'s speed-up of two GPUs over one, one thread per GPU", "ddp_threads", "ddp_before_after",
      readme=True),
    H("Two GPUs", f"{XC}'s speed-up over CuPy's MemoryPool, two GPUs, one thread per GPU", "ddp_threads_vs_cupy",
      "ddp_before_after"),
    H("Two GPUs", f"{XC}'s speed-up of two GPUs over one, one process per GPU", "ddp_procs", "ddp_scaling"),
    H("The step as a CUDA graph", f"{XC}, the step as a CUDA graph: speed-up of two GPUs over one, one thread per "
      "GPU", "graph_threads", "graph_steps"),
    H("PyTorch through xpool", f"{XT}'s training-step speed-up over PyTorch's caching allocator", "torch_step",
      "torch_interop", readme=True),
    H("Dynamic shapes", f"CuPy's MemoryPool's peak reserved / peak requested over {XC}'s, shapes that change every "
      "step, worst workload", "dyn_vs_cupy_worst", "dynamic_shapes", readme=True),
    H("Dynamic shapes", f"PyTorch's expandable segments' peak reserved / peak requested over {XT}'s, shapes that "
      "change every step, worst workload", "dyn_vs_expandable_worst", "dynamic_shapes", readme=True),
    H("Dynamic shapes", f"PyTorch's caching allocator's peak reserved / peak requested over {XT}'s, shapes that "
      "change every step, worst workload", "dyn_vs_torch_worst", "dynamic_shapes"),
    H("Dynamic shapes", f"{XC}'s peak reserved / peak requested, shapes that change every step, worst workload",
      "dyn_worst", "dynamic_shapes"),
    H("Dynamic shapes", f"{XT}'s peak reserved / peak requested, shapes that change every step, worst workload",
      "dyn_worst_torch", "dynamic_shapes"),
    H("Dynamic shapes", f"{XC}: trials with no device call in steady state, worst workload", "dyn_calls_worst",
      "dynamic_calls"),
    H("Dynamic shapes", f"{XT}: trials with no device call in steady state, worst workload",
      "dyn_calls_worst_torch", "dynamic_calls"),
    H("Dynamic shapes", f"{XC}'s speed-up over the fastest peer, worst workload", "dyn_speed_worst", "dynamic_speed"),
    H("Dynamic shapes", f"{XT}'s speed-up over the fastest peer, worst workload", "dyn_speed_worst_torch",
      "dynamic_speed"),
    H("Under a memory cap", f"{XC}: trials finished under a {targets.CAP_JUDGED:.2f}× cap of the peak requested, "
      "worst workload", "cap_worst", "memory_cap"),
    H("Under a memory cap", f"{XT}: trials finished under a {targets.CAP_JUDGED:.2f}× cap of the peak requested, "
      "worst workload", "cap_worst_torch", "memory_cap"),
)
# the words of a headline whose rows measured an earlier xpool than the product as it ships (Note [One name per
# allocator]): they name what was measured, and say that the product as it ships is not measured there yet
NOT_YET = "not yet measured on the product as it ships"


def notebooks(root: pathlib.Path | None = None, only=None) -> list[pathlib.Path]:
    """notebooks/NN_*.ipynb in order; `only` keeps those whose name starts with one of its prefixes."""
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
    """Execute one notebook with papermill into out_dir: a dict of notebook, ok, seconds, output and error."""
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


# --- tables of rows (summaries over trials), each from the rows sources.current gives
def _med(values):
    return iv.median_ci(values)[:3]


def _ci(v, fmt="{:.2f}", unit=""):
    return iv.fmt_ci(*v, fmt, unit)


def _md(header, rows) -> str:
    return "\n".join(["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
                     + ["| " + " | ".join(map(str, r)) + " |" for r in rows])


def _bound(g) -> str:
    """What bounds these rows' steps: their `bound` column (the most common), else from the medians."""
    if "bound" in g and g["bound"].notna().any():
        return str(g["bound"].mode().iloc[0])
    med = {c: float(g[c].median()) if c in g else math.nan for c in ("gpu_util_mean", "host_ms_per_step", "ms_per_step")}
    return step_bound(*med.values()) or "?"


def bound_rows(data: pathlib.Path, kind: str = "single_gpu") -> list[dict]:
    """One dict per (batch, allocator) of a one-GPU lineage: (median, lo, hi) of each ms, the bound, the run."""
    df = sources.current(data, kind)
    if df is None:
        return []
    out = []
    for (batch, alloc), g in df.groupby(["batch", "allocator"], sort=False):
        def m(col):
            return _med(g[col]) if col in g else (math.nan,) * 3
        ms, util, busy = m("ms_per_step"), m("gpu_util_mean"), m("gpu_busy_ms_per_step")
        out.append(dict(batch=int(batch), allocator=alloc, ms=ms, host=m("host_ms_per_step"),
                        dispatch=m("dispatch_ms_per_step"), stream=m("gpu_ms_per_step"), gc=m("gc_ms_per_step"),
                        util=util, bound=_bound(g),
                        busy=busy if math.isfinite(busy[0]) else (ms[0] * util[0] / 100,) * 3, run=g["run"].iloc[0]))
    order = shared.ordered(r["allocator"] for r in out)
    return sorted(out, key=lambda r: (-r["batch"], order.index(r["allocator"])))


def bounds_table(data: pathlib.Path) -> str:
    rows = [(r["batch"], r["allocator"], _ci(r["ms"], "{:.1f}"), _ci(r["host"], "{:.1f}"), _ci(r["dispatch"], "{:.1f}"),
             _ci(r["stream"], "{:.1f}"), f"{r['busy'][0]:.1f}", _ci(r["util"], "{:.0f}", "%"), _ci(r["gc"]), r["bound"],
             r["run"]) for r in bound_rows(data)]
    return _md(["batch", "allocator", "ms per step", "host ms", "dispatch ms", "stream ms", "GPU busy ms",
                "GPU busy", "GC ms", "bound", "run"], rows) if rows else ""


def _gil_rows(data: pathlib.Path) -> pd.DataFrame | None:
    """gil_probe.csv's rows at Python's default switch interval (5 ms), or None."""
    df = sources.read(data, "gil_probe")
    return None if df is None else df[np.isclose(df.get("switch_interval_s", 0.005), 0.005)]


def gil_sharing(data: pathlib.Path, arm: str = GIL_ARM) -> dict:
    """{N: (median, lo, hi)}: N threads' ops per second over one's (gil_probe.csv, 5 ms switch interval)."""
    df = _gil_rows(data)
    if df is None:
        return {}
    return {int(n): _med(g["speedup"]) for n, g in df[df["arm"] == arm].groupby("threads") if n > 1}


def projection(data: pathlib.Path, worlds=(2, 4, 8), kind: str = "single_gpu") -> list[dict]:
    """A projection, not a measurement, of one thread per GPU on N GPUs at batch 32 from one-GPU rows: max(N·h/s_N, g)
    against max(h, g) (h: the host's ms, g: GPU busy ms, s_N: gil_sharing); one dict per pool."""
    rows = {(r["batch"], r["allocator"]): r for r in bound_rows(data, kind)}
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


def projection_table(data: pathlib.Path) -> str:
    proj = projection(data)
    if not proj:
        return ""
    worlds = sorted(proj[0]["speedup"])
    rows = [(p["allocator"], f"{p['h']:.1f}", f"{p['g']:.1f}", p["h_source"],
             *(f"{p['speedup'][n]:.2f}× ({p['sharing'][n]:.2f})" for n in worlds)) for p in proj]
    out = _md(["allocator", "h (host ms)", "g (GPU ms)", "h from", *(f"{n} GPUs (s_{n})" for n in worlds)], rows)
    ddp = sources.current(data, "ddp")
    if ddp is not None:
        two = ddp[(ddp["mode"] == "threads") & (ddp["world"] == 2)]
        got = [f"{p['allocator']} {_ci(_med(two[two['allocator'] == p['allocator']]['speedup']), unit='×')}"
               for p in proj if p["allocator"] in set(two["allocator"])]
        if got:
            out += f"\n\nMeasured on 2 GPUs ({sources.sources(two)}), for the 2-GPU column: " + ", ".join(got) + "."
    return out


def gil_table(data: pathlib.Path) -> str:
    df = _gil_rows(data)
    if df is None:
        return ""
    threads = sorted(n for n in df["threads"].unique() if n > 1)
    rows = [(shared.label(a), _ci(_med(g[g["threads"] == 1]["us_per_op"]), "{:.1f}"),
             *(_ci(_med(g[g["threads"] == n]["speedup"]), unit="×") for n in threads))
            for a, g in df.groupby("arm", sort=False)]
    return _md(["op", "µs per op, 1 thread", *(f"{n} threads / 1" for n in threads)], rows)


def graph_table(data: pathlib.Path) -> str:
    df = sources.current(data, "graph")
    if df is None:
        return ""
    df = df[df["mode"] != "processes"]
    rows = []
    for (mode, batch), g in df.groupby(["mode", "batch"], sort=False):
        for arm in shared.ordered(g["allocator"].unique()):
            r = g[g["allocator"] == arm]
            one, two = r[r["world"] == 1], r[r["world"] == 2]
            disp = one["dispatch_ms_per_step"].dropna()
            rows.append((f"{'one GPU' if mode == 'single' else mode}, batch {batch}, {int(one['steps'].max())} steps",
                         arm, _ci(_med(one["tokens_per_s"] / 1e3), "{:.1f}", "k"),
                         _ci(_med(disp)) if len(disp) else "—", _ci(_med(one["gpu_ms_per_step"]), "{:.1f}"),
                         _ci(_med(one["gpu_util_mean"]), "{:.0f}", "%"),
                         _ci(_med(two["speedup"]), unit="×") if len(two) else "—", _bound(one)))
    return _md(["run", "arm", "tokens/s", "host ms per step", "GPU ms per step", "GPU busy (NVML)",
                "speedup, 2 GPUs", "bound"], rows)


def graph_notes(data: pathlib.Path) -> dict:
    """The numbers of the graph section's notes (report.md), those measured."""
    out, df = {}, sources.current(data, "graph")
    mem = df[(df["mode"] == "single") & (df["batch"] == 32)]
    eager, graph = (mem[mem["allocator"] == a] for a in ("xpool", "xpool_graph"))
    if len(eager) and len(graph) and "graph_pool_bytes" in graph:
        e, main, private = (x.median() for x in (eager["peak_reserved_bytes"], graph["peak_reserved_bytes"],
                                                 graph["graph_pool_bytes"]))
        out["graph_mem"] = dict(eager=iv.fmt_bytes(e), main=iv.fmt_bytes(main), private=iv.fmt_bytes(private),
                                ratio=f"{(main + private) / e:.2f}×")
    launch, ddp = sources.read(data, "launch/ddp_launch_cupy"), sources.read(data, "graph/ddp_scaling")
    if launch is not None and ddp is not None:
        def sp(d, arm):
            s = d[(d["world"] == 2) & (d["mode"] == "threads") & (d["allocator"] == arm)]["speedup"]
            return _ci(_med(s), unit="×") if len(s) else "—"
        out["graph_launch"] = dict(run=launch["run"].iloc[0], **{f"{a}{k}": sp(d, a) for a in ("xpool", "cupy_pool")
                                                                 for k, d in (("", launch), ("_direct", ddp))})
    proj = [p for p in projection(data, kind="graph/single_gpu.csv") if p["allocator"].endswith("_graph")]
    if proj:
        out["graph_projection"] = "; ".join(f"{p['allocator']} (h {p['h']:.2f} ms, g {p['g']:.1f} ms): " + ", ".join(
            f"{n} GPUs {s:.2f}×" for n, s in p["speedup"].items()) for p in proj)
    if again := replication(data / "graph", "data/graph"):
        out["graph_again"] = again
    return out


# --- a second run of the suite (issue #12): do its ratios fall inside the first run's intervals?
T = targets.T
REPLICATED = (     # every ratio the targets rest on, per group; measured in a folder and in its rerun/
    T("r1", "one GPU, {at}: speed-up over CuPy's pool, tokens/s", "single_gpu.csv", "tokens_per_s", ref=dict(allocator="cupy_pool"),
      over=("batch", "allocator"), pick="each", unit="×"),
    T("r2", "one GPU, {at}: speed-up over CuPy's pool, tokens/s", "single_gpu_b4.csv", "tokens_per_s",
      ref=dict(allocator="cupy_pool"), over=("batch", "allocator"), pick="each", unit="×"),
    T("r3", "2 GPUs, {at}: speedup", "ddp_scaling.csv", "speedup", where=dict(world=2),
      over=("mode", "batch", "allocator"), pick="each", unit="×"),
    T("r4", "batch sweep, 2 GPUs, {at}: speedup", "batch_sweep.csv", "speedup", where=dict(world=2),
      over=("mode", "batch", "allocator"), pick="each", unit="×"),
    T("r5", "microbenchmark, {at}: speed-up over CuPy's pool", "alloc_microbench.csv", "ratio_vs_cupy_pool",
      tuple(a for a in shared.SETS["bench"] if a != "cupy_pool"), where=dict(sweep="size"),
      over=("size_bytes", "allocator"), pick="each", unit="×"),
    T("r6", "alloc+free sweep, {at}: xpool's speed-up over CuPy's pool", "alloc_hit_sweep.csv",
      "ratio_vs_cupy_pool", "xpool", over=("size_bytes",), pick="each", unit="×"),
    T("r7", "PyTorch empty_del, {at}: xpool's speed-up over PyTorch's allocator", "torch_interop.csv", "value", "xpool",
      where=dict(case="empty_del"), ref=dict(arm="torch"), over=("size_bytes",), pick="each", unit="×", flip=True),
    T("r8", "PyTorch train_step: xpool's speed-up over PyTorch's allocator, tokens/s", "torch_interop.csv", "value",
      "xpool", where=dict(case="train_step"), ref=dict(arm="torch"), unit="×"),
    T("r9", "GIL probe (add), {at}: N threads / 1 thread, ops per second", "gil_probe.csv", "speedup", "add",
      where=dict(threads=(2, 4, 8)), over=("threads",), pick="each", unit="×"),
)


def _ratios(data: pathlib.Path) -> dict:
    """{name: Measured} of every REPLICATED ratio measured in `data`."""
    return {r.text.replace("{at}", e.at): e for r in REPLICATED for m in targets.measure(r, data)
            for e in m.each or [m]}


def replication(data: pathlib.Path, where: str = "data") -> str:
    """Markdown: each ratio of data/rerun/ against the first run's interval (empty without a second run)."""
    if not (data / RERUN).is_dir():
        return ""
    first, second = _ratios(data), _ratios(data / RERUN)
    rows, inside, close, apart = [], 0, 0, {}
    for name in [n for n in first if n in second]:
        a, b = first[name], second[name]
        if a.rules != b.rules:            # not a repeat: the runs measured other pools (or one does not say which)
            apart.setdefault((a.rules or "not recorded", b.rules or "not recorded"), []).append(name)
            continue
        ok = (a.lo <= b.value <= a.hi) if math.isfinite(a.lo) else None
        change = b.value / a.value - 1 if a.value else math.nan
        inside += bool(ok)
        close += abs(change) <= 0.05
        f = iv.digits(a.row.fmt, [v for v in (a.lo, a.hi) if math.isfinite(v)], b.value)   # inside or not: visible
        rows.append((name, format(a, f), format(b, f), f"{100 * change:+.1f}%",
                     "n/a" if ok is None else "yes" if ok else "**no**"))
    if not rows:
        return ""
    runs = lambda d: ", ".join(sorted({m.src for m in d.values()}))     # noqa: E731
    return (f"A second run of the suite: `{where}/{RERUN}/` ({runs(second)}) against the first "
            f"run ({runs({n: first[n] for n in second if n in first})}).\n\n"
            f"{inside} of {len(rows)} ratios fall inside the first run's 95% interval; {close} of {len(rows)} medians "
            "within 5% of the first run's. Where one falls outside, the row says **no**; the change column says by how "
            "much (an interval of paired trials can be far narrower than the difference between two runs)."
            + "".join(f"\n\nNot compared, because the two runs did not measure the same pool by what their CSVs "
                      f"say (first run: {first_pool}; second run: {second_pool}): {', '.join(names)}."
                      for (first_pool, second_pool), names in apart.items()) + "\n\n"
            + _md(["ratio", "first run", "second run", "change", "inside"], rows))


def _named(s: pd.DataFrame, rows: pd.DataFrame, ref: str = "speed-up over the fastest peer") -> pd.DataFrame:
    """A per-workload table `s` of `rows` with each arm id in its one name (shared.row_labels, by the workload's front
    end, with what its rows measured other than the product), the fastest peer's too; "xpool's default" goes, since the
    name says it (Note [One name per allocator])."""
    names = {}
    for w, g in rows.groupby("workload", sort=False):
        fw = shared.WORKLOADS[w].framework if w in shared.WORKLOADS else None
        names[w] = shared.row_labels(g.assign(framework=fw) if fw else g)
    s = s.drop(columns="xpool's default", errors="ignore").copy()
    s["allocator"] = [names.get(w, {}).get(a, shared.label(a)) for w, a in zip(s["workload"], s["allocator"])]
    if ref in s:
        s[ref] = [re.sub(r"\((\w+)\)$", lambda m: f"({shared.label(m[1])})", c) if isinstance(c, str) else c
                  for c in s[ref]]
    return s


def _dynamic_rows(df: pd.DataFrame) -> str:
    """The dynamic benchmark's table (xlab.summaries.dynamic_summary), its time column given as the speed-up
    over the fastest peer (plots.speedups: the one direction of every ratio)."""
    s = dynamic_summary(df)
    sp = plots.speedups(df).set_index(["workload", "allocator"])
    cells = ["the fastest peer" if (w, a) in sp.index and sp.loc[(w, a), "reference"] == a else
             f"{iv.fmt_ci(*sp.loc[(w, a), ['speedup', 'speedup_lo', 'speedup_hi']], '{:.3f}', '×')} "
             f"({sp.loc[(w, a), 'reference']})" if (w, a) in sp.index else "n/a"
             for w, a in zip(s["workload"], s["allocator"])]
    at = list(s.columns).index("ms vs the fastest peer")
    s = s.drop(columns="ms vs the fastest peer")
    s.insert(at, "speed-up over the fastest peer", cells)
    s = _named(s, df)
    return _md(list(s), s.itertuples(index=False))


def dynamic_table(data: pathlib.Path) -> str:
    """Every workload and arm of the dynamic-shape benchmark."""
    df = sources.current(data, "dynamic_shapes")
    return "" if df is None else _dynamic_rows(df)


def dynamic_heldout(data: pathlib.Path) -> str:
    """The held-out PyTorch programs: which pools they measured (the product's default for PyTorch or not), and their
    table."""
    df = sources.read(data, targets.DYN_HELD_OUT)
    if df is None or not len(df):
        return ""
    arms = shared.ordered(df["allocator"].unique())
    missing = "" if targets.XDT in arms else (
        f" The pool `xpool.enable_torch()` makes now ({targets.XDT}, release rule {targets.PRODUCT_RULE}) is not among "
        "them: no row below measures it.")
    return (f"**Held-out PyTorch programs** ({sources.sources(df)}; other batches, lengths and image sizes than the "
            f"workloads above): the arms {', '.join(arms)}; the xpool arms ran {targets.pools(df, 'allocator')}."
            f"{missing}\n\n{_dynamic_rows(df)}")


def dynamic_seeds(data: pathlib.Path) -> str:
    """What the dynamic benchmark's trials drew their shapes from: one seed, or a seed per trial."""
    df = sources.current(data, "dynamic_shapes")
    if df is None or "seed" not in df:
        return ""
    per = df.groupby("trial")["seed"].agg(lambda s: sorted(set(s)))
    seeds = sorted({x for v in per for x in v})
    if len(seeds) == 1:
        return (f"every trial on seed {seeds[0]}: the same shapes, sizes and data in each, so bytes and calls are one "
                "realization's, the same in every trial")
    pairs = "; ".join(f"trial {t}: seed {'/'.join(map(str, v))}" for t, v in per.items())
    return (f"each trial on a seed of its own ({pairs}), the "
            "same for every arm of the trial: each trial another realization of every workload, so bytes and calls vary between trials where the realizations differ, and "
            "a value without an interval is one every trial gave")


def dynamic_floor(data: pathlib.Path) -> str:
    """Why the CuPy loop's 1.05 is out of reach: per realization, the least over every placement the model tried
    (`scripts/placement_variants.py`) of the most pages its blocks in use touch at once, over its peak requested."""
    path = data / "placement_variants.csv"
    if not path.exists():
        return ""
    df = pd.read_csv(path)
    mix = df[df["trace"].astype(str).str.fullmatch(r"dyn_cupy_mix(_s\d+)?")]
    if mix.empty:
        return ""
    seed = lambda t: int(t.rpartition("_s")[2]) if "_s" in t else 0                 # noqa: E731
    least = mix.groupby("trace")["touched_pages_over_requested"].min()
    least = least.loc[sorted(least.index, key=seed)]
    best = mix[mix["placement"] == "best"].set_index("trace")["touched_pages_over_requested"]
    page = int(mix["page_bytes"].iloc[0]) >> 20
    over = int((least > 1.05).sum())
    each = lambda v: ", ".join(f"{x:.3f}" for x in v)                             # noqa: E731
    return (f"What placement allows the CuPy loop: the most {page} MiB pages its blocks in use touch at once, over its "
            f"peak requested, under the best of the {mix['placement'].nunique()} placements of "
            f"`scripts/placement_variants.py` for each realization, is {each(least)} on its {len(least)} (seeds "
            f"{', '.join(str(seed(t)) for t in least.index)}); under best fit, xpool's, {each(best.reindex(least.index))} "
            f"(`placement_variants.csv` at {sources.run_label(mix)}). A release rule that gave back every free page at "
            f"once would hold that much, so none reaches 1.05 on {over} of the {len(least)} with any of these "
            "placements.")


# --- dynamic shapes at the scale users run them, and under a memory cap (issue #46)
def scale_runs(data: pathlib.Path, kind: str = targets.SCALE) -> str:
    """What `kind`'s scaled rows (targets.SCALE or CAP) are: their CSV and commit, machine and date, their trials
    (a run under way: how many so far) and caps; or that none is measured yet, and what measures them."""
    return summaries.said(sources.current(data, kind), kind)


def cap_runs(data: pathlib.Path) -> str:
    return scale_runs(data, targets.CAP)


def issue_targets(data: pathlib.Path, kind: str) -> str:
    """Issue #46's per-workload targets on `kind`'s rows, as the targets table gives them, each "not measured"
    where its rows are not there (a run under way)."""
    rows = []
    for r in targets.TARGETS:
        if r.kind == kind and r.goal is not None and not r.over:
            got = targets.measure(r, data)
            rows.append(got[0] if got else targets.Measured(r, src="—", goal=math.nan))     # judged: not measured
    return "\n".join(targets.table(rows))


def scale_targets(data: pathlib.Path) -> str:
    return issue_targets(data, targets.SCALE) if sources.current(data, targets.SCALE) is not None else ""


def cap_targets(data: pathlib.Path) -> str:
    return issue_targets(data, targets.CAP) if sources.current(data, targets.CAP) is not None else ""


def scale_vs_peers(data: pathlib.Path) -> str:
    """xpool's default against the best peer per scaled workload, paired by trial (summaries.defaults_vs_peers)."""
    df = sources.current(data, targets.SCALE)
    if df is None:
        return ""
    s = summaries.defaults_vs_peers(df)
    framework = {w: shared.WORKLOADS[w].framework for w in s["workload"]}
    s = s.assign(default=[shared.label(a, framework[w]) for a, w in zip(s["default"], s["workload"])],
                 best_peer=[shared.label(a) for a in s["best_peer"]])
    s = s.rename(columns={"default": "xpool", "best_peer": "best peer", "trials_no_more": "trials it reserved no more"})
    return _md(list(s), s.itertuples(index=False))


def scale_table(data: pathlib.Path) -> str:
    """Every scaled workload and arm (summaries.scale_summary)."""
    df = sources.current(data, targets.SCALE)
    if df is None:
        return ""
    s = _named(summaries.scale_summary(df), df)
    return _md(list(s), s.itertuples(index=False))


def cap_table(data: pathlib.Path) -> str:
    """Per front end, the trials each arm finished under each cap, of those it ran (summaries.cap_grid)."""
    df = sources.current(data, targets.CAP)
    if df is None:
        return ""
    parts = []
    for f, title, _ in plots.DYNAMIC_FRONT_ENDS:
        grid = summaries.cap_grid(df, f)
        grid = grid.rename(columns={c: shared.label(c.split(":")[0], f) for c in grid.columns
                                    if c not in ("workload", "cap")})
        if len(grid):
            parts.append(f"{title}:\n\n" + _md(list(grid), grid.itertuples(index=False)))
    return "\n\n".join(parts)


def under_way(now: list) -> dict:
    """{"under_way": a sentence} where some targets rest on a run under way (targets.counts: fewer trials than their
    goal speaks of), else {} (the template's line goes)."""
    c = targets.counts(now)
    if not c["under_way"]:
        return {}
    few = (f", {c['few']} of them on too few for an interval (a verdict that opens \"{targets.FEW}\")"
           if c["few"] else "")
    return {"under_way": f"{c['under_way']} of them rest on a run under way, fewer trials than their goal speaks of"
                         f"{few}: each reads pending (k of N)."}


# --- the summary at the head of the report, and README's results table: rows of SUMMARY, measured
def _goal(m: targets.Measured) -> str:
    r = m.row
    if m.goal is None:
        return ""
    if r.stat == "all" and not isinstance(r.goal, dict):
        return targets.PASSING[r.metric][1]
    sign = ("≥" if r.higher else "≤") if r.goal else "="
    if r.stat == "share":
        return f"{sign} {round(m.goal * r.trials)} of {r.trials}"
    return f"{sign} {m.goal_text or iv.fmt_ci(m.goal, math.nan, math.nan, r.fmt, r.unit, exact=True)}"


def _value(m: targets.Measured) -> str:
    return f"{m}" + (f" ({m.at})" if m.at and not m.each else "")


def _data(m: targets.Measured) -> str:
    return m.src + (f" ({m.rules})" if m.rules else "")


def anchor(title: str) -> str:
    """The link anchor GitHub makes of a markdown heading."""
    return re.sub(r"[^\w\- ]", "", title.lower()).replace(" ", "-")


def headlines(data: pathlib.Path, values: dict | None = None) -> list[dict]:
    """SUMMARY measured: one dict per headline whose target was measured (question, text, value, verdict, ...)."""
    values = targets.values(data) if values is None else values
    spans = _spans(data)
    return [r for h in SUMMARY if (r := _headline(h, values, spans)) is not None]


def _headline(h: Headline, values: dict, spans: dict) -> dict | None:
    """One headline measured: its twin on the scaled rows (targets.AT_SCALE_TWIN) where that is measured, the scale
    in its words, its section and figure; else its own row; None when neither is measured. Rows of an earlier xpool
    than the product as it ships say so in the headline's words, and that the product is not yet measured there."""
    twin = targets.AT_SCALE_TWIN.get(h.key)
    scaled = twin in values
    m = values.get(twin if scaled else h.key)
    if m is None:
        return None
    text = f"{h.text}, at {spans['scale_words']}" if scaled else h.text
    if said := m.pool_said:
        text += f" ({said}: {NOT_YET})"
    return dict(headline=h, m=m, value=_value(m), question=SCALE_SECTION if scaled else h.question, text=text,
                figure=SCALED_FIGURE if scaled else h.figure, verdict=f"{m.verdict} ({_goal(m)})",
                statistic=m.statistic, data=m.src)


def _spans(data: pathlib.Path) -> dict:
    """The peak requested bytes, in words, of the scaled rows (scale_words: '33-40 GiB requested') and of the
    benchmark's workloads of changing shapes (small_words), those whose CSV is there."""
    out = {}
    for key, kind, where in (("scale_words", targets.SCALE, {}), ("small_words", targets.DYN, {"dynamic": True})):
        df = sources.current(data, kind)
        if df is not None and len(df := sources.select(df, where)):
            out[key] = summaries.requested(df)
    return out


def summary_table(data: pathlib.Path, figs: dict, report_dir: pathlib.Path, values: dict | None = None) -> str:
    """The report's opening table: each headline's value [interval], verdict against its goal, the statistic, the
    run (CSV and commit), the figure."""
    rows = []
    for r in headlines(data, values):
        name, fig = r["figure"], figs.get(r["figure"])
        link = (f"[{name}]({pathlib.Path(os.path.relpath(fig.resolve(), report_dir.resolve())).as_posix()})"
                if isinstance(fig, pathlib.Path) else name)
        rows.append((f"[{r['question']}](#{anchor(r['question'])})", r["text"], r["value"], r["verdict"],
                     r["statistic"], r["data"], link))
    return _md(["question", "headline", "value [95% interval]", "verdict (goal)", "statistic", "run", "figure"],
               rows) if rows else "_Nothing measured yet._"


def readme_table(data: pathlib.Path, values: dict | None = None) -> str:
    """README's results table: the SUMMARY rows marked `readme`, each linking its section of the report."""
    rows = [(f"[{r['question']}](report/REPORT.md#{anchor(r['question'])})", r["text"], r["value"], r["verdict"],
             r["data"]) for r in headlines(data, values) if r["headline"].readme]
    return _md(["", "result", "value [95% interval]", "verdict (goal)", "run"], rows) if rows else \
        "_Nothing measured yet: `make report` writes this table from `data/`._"


# --- README's "When to use it": every measured miss, one sentence per workload and run (or per target)
def _peer(name: str) -> str:
    return shared.label(name) if name else "—"


def _clause(m: targets.Measured) -> str:
    """A missed target as a clause of its workload's sentence: what was measured, its value, its goal."""
    k, r = m.row.key, m.row
    if r.stat == "all" and r.metric == targets.ZERO:
        return f"no device call in steady state in {m} trials"
    if k.startswith("cap_peers"):
        peer, _, got = m.goal_text.partition(": ")
        return f"{_peer(peer)} finished {got} there"
    if r.stat == "all" and r.metric == "completed":
        return f"{m} trials finished under a {targets.CAP_JUDGED:.2f}× cap of the peak requested"
    if r.stat == "share":
        return f"it reserved no more than the best peer ({_peer(m.ref)}) in {m} trials (goal: {_goal(m)})"
    if "_vs_" in k and r.ref:
        return f"{_peer(r.ref['allocator'])} held {m} of what it held (goal {_goal(m)})"
    if r.metric == targets.HELD["metric"]:
        return f"peak reserved / peak requested {m} (goal {_goal(m)})"
    if k.startswith(("dyn_ms", "scale_ms", "dyn_speed", "scale_speed")):
        return f"speed-up over the fastest peer ({_peer(m.ref)}) {m} (goal {_goal(m)})"
    return f"{targets.text(m)}: {m}"


def _workload(m: targets.Measured) -> str:
    """The workload a dynamic target's value comes from ('' for the other targets)."""
    w = m.row.where.get("workload")
    return w if isinstance(w, str) else m.at if m.at in shared.WORKLOADS else ""


def _sentence_start(text: str) -> str:
    """`text` with its first letter capitalised, unless it starts with a name written in lower case (xpool)."""
    return text if text.startswith("xpool") else text[:1].upper() + text[1:]


def misses(data: pathlib.Path, now: list | None = None) -> list[str]:
    """Every missed target as README's sentences: the dynamic ones one sentence per (front end's pool, workload, run),
    each clause a target (a summary row over workloads that repeats a workload's row is left out); every other one a
    sentence of its own. Each names the pool measured (and an earlier rule's, where its rows did) and the run."""
    now = targets.judged(data)[0] if now is None else now
    missed = [m for m in now if m.verdict.startswith(iv.MISSED)]
    spans, groups, order = _spans(data), {}, []
    for m in missed:
        w = _workload(m)
        scaled = m.row.kind in (targets.SCALE, targets.CAP)
        arm = m.row.arm if isinstance(m.row.arm, str) else m.at
        if m.row.key.startswith("dyn_ror_best") and arm == shared.default_arm(shared.WORKLOADS[w].framework):
            continue                       # the front end's own pool is its best scheme: its own row says it
        key = (arm, w, scaled, "") if w else (m.row.key,)
        if key not in groups:
            groups[key] = []
            order.append(key)
        clause = _clause(m)
        if w and any(c == clause for c, _ in groups[key]):
            continue                       # a summary row over workloads: its worst workload's row says it
        groups[key].append((clause, m))
    out = []
    for key in order:
        clauses, ms = [c for c, _ in groups[key]], [m for _, m in groups[key]]
        m = ms[0]
        runs = ", ".join(dict.fromkeys(x.src for x in ms))
        if len(key) == 1:
            out.append(f"{_sentence_start(targets.text(m))}: {m}, missed ({runs}).")
            continue
        arm, w, scaled, _ = key
        who = shared.label(arm, shared.WORKLOADS[w].framework) if arm else "xpool"
        said = m.pool_said
        size = spans.get("scale_words", "scale") if scaled else "the benchmark's size"
        out.append(f"{who}{f' ({said})' if said else ''} on {w} at {size}: " + "; ".join(clauses) + f" ({runs}).")
    return out


# README's "When to use it": per peer, the advice and the summary's headlines against that peer (each in short words:
# the summary's own are in README's results table), so the wins say what the targets say and cannot drift from the
# misses listed below them
WIN_ADVICE = (
    ("Instead of no pool (raw `cudaMalloc`)", "always: any pool turns a training step that is slower on two GPUs "
     "than on one into one that scales (the figure)", ()),
    ("Instead of CuPy's MemoryPool", "for what it adds (statistics, a limit, the debug mode, the timeline, one pool "
     "with PyTorch), not for a faster step or less memory. `scheme=\"expandable\"` holds less under changing shapes, "
     "but shares nothing through CUDA IPC ([0014](docs/decisions/0014-cupy-default-scheme.md))",
     (("hit_worst", "alloc+free, worst size"), ("vs_cupy_32", "training step, batch 32"),
      ("dyn_vs_cupy_worst", "its memory held over xpool's, changing shapes"))),
    ("Instead of PyTorch's caching allocator", "when CuPy and PyTorch share a process, or for the same tools; for a "
     "PyTorch-only program, PyTorch's own allocators are the simpler choice",
     (("torch_step", "training step"), ("dyn_vs_torch_worst", "its memory held over xpool's, changing shapes"),
      ("dyn_vs_expandable_worst", "PyTorch's expandable segments' memory held over xpool's"))),
)


def wins_block(data: pathlib.Path, values: dict | None = None) -> str:
    """README's "When to use it" bullets, between its WINS markers: each peer's advice, then each summary headline
    against it that is measured, in short words (the scale of scaled rows, and an earlier xpool's rows, said), its
    value and verdict."""
    got = {r["headline"].key: r for r in headlines(data, values)}
    spans = _spans(data)
    out = []
    for who, advice, keys in WIN_ADVICE:
        measured = []
        for key, words in keys:
            if (r := got.get(key)) is None:
                continue
            if r["question"] == SCALE_SECTION:
                words += f", at {spans['scale_words']}"
            if said := r["m"].pool_said:
                words += f" ({said}: {NOT_YET})"
            measured.append(f"{words}: {r['value']}, {r['verdict']}")
        out.append(f"- **{who}**: {advice}." + (f" Measured: {'; '.join(measured)}." if measured else ""))
    return "\n".join(out)


def misses_block(data: pathlib.Path, now: list | None = None) -> str:
    """README's list of misses, between its MISSES markers."""
    got = misses(data, now)
    return "\n".join(f"- {x}" for x in got) if got else "- No target measured is missed."


def with_results(readme: str, table: str, markers=RESULTS) -> str:
    """README's text with the table between its RESULTS markers (or `markers`) replaced (unchanged where it has no
    markers)."""
    start, end = markers
    if start not in readme or end not in readme:
        return readme
    head, rest = readme.split(start, 1)
    return f"{head}{start}\n{table}\n{end}{rest.split(end, 1)[1]}"


def data_table(data: pathlib.Path) -> str:
    """Every CSV under data/ with its provenance (machine, driver, CUDA, CuPy, commit, date)."""
    rows = []
    for p in sorted(data.rglob("*.csv")):
        df = pd.read_csv(p)
        if "commit" not in df:
            continue
        s = plots.provenance_summary(df)
        rows.append((f"`data/{p.relative_to(data).as_posix()}`", len(df), s["gpu"], s["driver"], s["cuda"], s["cupy"],
                     sources.run_label(df), s["date"]))
    return _md(["CSV", "rows", "measured on", "driver", "CUDA", "CuPy", "commit", "date"], rows)


def _replay(data: pathlib.Path) -> str:
    waste, tl = sources.read(data, "memory_waste"), sources.read(data, "memory_timeline")
    if waste is None or tl is None:
        return ""
    rep = replay_waste(tl, tuple(int(k) for k in waste["k"])).set_index("k")
    exact = all(rep.loc[int(r.k), "peak_bytes_reserved"] == r.peak_bytes_reserved for r in waste.itertuples())
    return ("Replaying the recorded requests through xpool's core on the CPU reproduces the measured peak reserved "
            f"bytes {'exactly for every k' if exact else 'NOT exactly'}.")


def fill(template: str, values: dict) -> str:
    """The template with its fields filled: a `<!-- if NAME -->` block is dropped when NAME is empty or missing,
    a line whose field is missing (a CSV not there) is dropped; the page never shows a stale or made-up number."""
    def block(m):
        return m[2] if values.get(m[1]) else ""
    text = re.sub(r"<!-- if (\w+) -->\n(.*?)<!-- end -->\n", block, template, flags=re.S)
    out = []
    for line in text.split("\n"):
        try:
            out.append(string.Formatter().vformat(line, (), values))      # a missing field: KeyError
        except (KeyError, AttributeError, IndexError):
            continue
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out))


def _runs_said(data: pathlib.Path, figure: str) -> str:
    """A sentence where figure `figure`'s rows hold several runs (its bars' labels name each), '' where one."""
    df = plots.rows(figure, data)
    several = df is not None and "run" in df and df["run"].nunique() > 1
    return "The figure sets bars of several runs side by side; each bar's label names its run." if several else ""


def render(data: pathlib.Path, runs: list[dict], figs: dict, report_dir: pathlib.Path) -> str:
    """The report's markdown (figure links relative to `report_dir`; `runs`: the notebooks' results)."""
    now, then = targets.judged(data)
    links = {}
    for name in plots.FIGURES:
        got = figs.get(name)
        if isinstance(got, pathlib.Path):
            links[name] = f"![{name}]({pathlib.Path(os.path.relpath(got.resolve(), report_dir.resolve())).as_posix()})"
        else:
            links[name] = f"_{name}: {got or 'not built'}._"
    measured = targets.values(data)
    values = {**measured, "counts": targets.counts(now), "fig": links, "host_bound_util": HOST_BOUND_UTIL,
              "summary_table": summary_table(data, figs, report_dir, measured),
              "targets_table": "\n".join(targets.table(now)) or "_No targets measured yet._",
              "history_table": "\n".join(targets.table(then)), "replay": _replay(data), **under_way(now)}
    values.update(_spans(data))
    values["single_gpu_runs"] = _runs_said(data, "single_gpu")
    retired = []

    def words(said: str) -> str:                                 # an earlier xpool in its words
        return "; ".join(q if q == shared.BEFORE_FREEZE else f"under {q}" for q in said.split("; "))

    for keys, fw, field in ((("dyn_h_ror", "dyn_h_ms"), "cupy", "dyn_cupy"),
                            (("dyn_h_ror_torch", "dyn_h_ms_torch"), "torch", "dyn_torch")):
        if (held := measured.get(keys[0])) is None:             # the front end's pool the dynamic benchmark measured
            continue
        name, said = shared.FRONT_END_NAMES[fw], held.pool_said
        values[field] = name + (f" ({said})" if said else "")
        if said:
            retired.append(f"{name} {words(said)}")
        elif held.mixed_pools:                                   # on some workloads: each named (the lists say too)
            on = {}
            for m in (m for k in keys if k in measured for m in measured[k].each):
                if m.pool_said and m.at not in on.get(m.pool_said, []):
                    on.setdefault(m.pool_said, []).append(m.at)
            retired += [f"{name} {words(q)} on {', '.join(sorted(ws))}" for q, ws in on.items()]
    if retired:                                                  # else its line goes
        values["dyn_retired"] = " and ".join(retired) + (
            ": the product as it ships is measured [at the scale users run them](#at-the-scale-users-run-them), and "
            "the summary reads those rows" if "scale_words" in values else ": the product as it ships is not yet measured "
            "on these workloads")
    for name, fn in (("bounds_table", bounds_table), ("projection_table", projection_table), ("gil_table", gil_table),
                     ("graph_table", graph_table), ("graph_notes", graph_notes), ("replication", replication),
                     ("dynamic_table", dynamic_table), ("dynamic_seeds", dynamic_seeds),
                     ("dynamic_floor", dynamic_floor), ("dynamic_heldout", dynamic_heldout), ("scale_runs", scale_runs),
                     ("cap_runs", cap_runs), ("scale_targets", scale_targets), ("cap_targets", cap_targets),
                     ("scale_vs_peers", scale_vs_peers), ("scale_table", scale_table), ("cap_table", cap_table),
                     ("data_table", data_table)):
        try:
            if name != "graph_notes":
                values[name] = fn(data)
            elif values["graph_table"]:
                values.update(fn(data))
        except (KeyError, ValueError, IndexError, TypeError) as e:     # a malformed CSV costs its section only
            values[name] = f"(could not compute: {type(e).__name__}: {e})"
    said = [f"{shared.FRONT_END_NAMES[fw]} {m.pool_said}" for key, fw in (("scale_h_ror", "cupy"),
            ("scale_h_ror_torch", "torch")) if (m := measured.get(key)) is not None and m.pool_said]
    values["scale_pool"] = (f"the xpool rows measured an earlier xpool: {'; '.join(said)}" if said else
                            f"the xpool arms run the product as it ships (release rule {shared.PRODUCT_RULE})")
    if not values.get("dynamic_seeds"):                          # a CSV that names no seeds: its line goes
        values.pop("dynamic_seeds", None)
    for key, rows in (("gil_src", sources.read(data, "gil_probe")), ("graph_src", sources.current(data, "graph")),
                      ("dynamic_src", sources.current(data, "dynamic_shapes"))):
        values[key] = sources.sources(rows) if rows is not None else ""
    if runs:
        values["notebooks"] = _md(["notebook", "result"], [(f"`notebooks/{r['notebook']}.ipynb`", "ran" if r["ok"] else
                                                             "FAILED: " + r["error"][:200]) for r in runs])
    return fill(TEMPLATE.read_text(), values)


def pages(text: str) -> tuple[str, str]:
    """(REPORT.md, TABLES.md) of a rendered page: the template's TABLES_MARK line parts them."""
    page, _, tables = text.partition(TABLES_MARK)
    return page.rstrip() + "\n", tables.lstrip()


def main(argv=None) -> int:
    """The command line (see the module docstring and --help): 1 if a notebook failed, else 0."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-quick", action="store_true",
                   help="CPU mode with small parameters (never measures, even on a GPU): what CI runs")
    p.add_argument("--only", nargs="*", default=None, metavar="NN",
                   help="run only the notebooks whose names start with these prefixes, e.g. --only 01 05")
    p.add_argument("--no-notebooks", action="store_true", help="skip the notebooks: figures and report only")
    p.add_argument("--timeout", type=int, default=1800, help="seconds one notebook cell may run (default 1800)")
    p.add_argument("--data", default=None, help="CSV folder (default: data/); passed to the notebooks too")
    p.add_argument("--figures", default=None, help="figure folder (default: figures/)")
    p.add_argument("--build", default=None, help="where executed notebooks and report.md go (default: build/)")
    p.add_argument("--report-dir", default=None, help="where REPORT.md is copied (default: report/)")
    p.add_argument("--readme", default=None, help="the README whose results table is rewritten (default: the "
                   "repository's README.md when --data is not given, else none)")
    args = p.parse_args(argv)
    root = paths.repo_root()
    data, figures, build, report_dir = (pathlib.Path(v) if v else root / name for v, name in (
        (args.data, "data"), (args.figures, "figures"), (args.build, "build"), (args.report_dir, "report")))
    runs, t0 = [], time.perf_counter()
    if not args.no_notebooks:
        folders = {"data_dir": str(args.data)} if args.data else {}
        for nb in notebooks(root, args.only):
            params = dict(CPU_QUICK.get(nb.stem, {})) if args.cpu_quick else {}
            runs.append(r := run_notebook(nb, build / "notebooks", {**params, **folders}, args.timeout))
            print(f"{'ok    ' if r['ok'] else 'FAILED'} {r['notebook']:<26} {r['seconds']:6.1f} s  {r['output']}"
                  + (f"\n       {r['error']}" if r["error"] else ""), flush=True)
    figs = plots.build_all(data, figures)
    for name, got in figs.items():
        print(f"figure {name:<18} {got}")
    for folder in (build, report_dir):
        folder.mkdir(parents=True, exist_ok=True)
    # build/report.md says how this run's notebooks went; the committed page holds only what data/ says
    (build / "report.md").write_text(text := render(data, runs, figs, report_dir))
    page, tables = pages(text if not runs else render(data, [], figs, report_dir))
    (report_dir / "REPORT.md").write_text(page)
    (report_dir / "TABLES.md").write_text(tables)
    readme = pathlib.Path(args.readme) if args.readme else None if args.data else root / "README.md"
    if readme is not None and readme.is_file():
        text = readme.read_text()
        new = with_results(with_results(text, readme_table(data)), misses_block(data), MISSES)
        new = with_results(new, wins_block(data), WINS)
        if new != text:
            readme.write_text(new)
    print(f"report: {build / 'report.md'}, {report_dir / 'REPORT.md'} and TABLES.md ({time.perf_counter() - t0:.0f} s "
          "in all)")
    failed = [r["notebook"] for r in runs if not r["ok"]]
    if failed:
        print(f"FAILED notebooks: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
