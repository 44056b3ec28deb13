"""Run every notebook through papermill, rebuild figures/ from data/*.csv, write the one-page report.

    python -m xlab.report              # notebooks with their defaults (on a GPU they measure)
    python -m xlab.report --cpu-quick  # CPU mode with small parameters: what CI runs, a few minutes

Executed notebooks go to build/notebooks/ (ignored by git); the report to build/report.md and, committed,
report/REPORT.md. Every headline number is computed from the CSVs. Exits non-zero if a notebook fails.
"""
from __future__ import annotations

import argparse
import math
import os
import pathlib
import shutil
import sys
import time

import pandas as pd

from . import paths, plots

# Small parameters for CI: CPU mode (never measure, even on a GPU) and the fewest steps that run the code.
CPU_QUICK = {
    "01_correctness": dict(measure=False, transparency_steps=5),
    "02_allocator_microbench": dict(measure=False, quick=True),
    "03_single_gpu": dict(measure=False, steps=3, warmup=1),
    "04_multi_gpu": dict(measure=False, steps=3),
    "05_memory": dict(measure=False),
}


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
    """Execute one notebook with papermill into out_dir; returns name, ok, seconds and the error, if any."""
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


def _xpool(allocators) -> str | None:
    """The xpool variant to quote: the default scheme (xpool; in older CSVs xpool_k1) if measured."""
    names = [a for a in plots.ordered(allocators) if str(a).startswith("xpool")]
    for default in ("xpool", "xpool_k1"):
        if default in names:
            return default
    return names[0] if names else None


def _where(df: pd.DataFrame) -> str:
    p = plots.provenance_summary(df)
    gpu = "CPU, no GPU" if p["gpu"] == "none" else p["gpu"]
    return f"{gpu}, {p['date']}"


def headline_correctness(data: pathlib.Path) -> str | None:
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
    df = _read(data, "alloc_microbench")
    if df is None:
        return []
    xp = _xpool(df["allocator"].unique())
    # the size sweep (one thread, on the main thread); the thread sweep's 1-thread case runs in a worker
    sized = df[df["sweep"] == "size"] if "sweep" in df else df[df["threads"] == df["threads"].min()]
    one = sized.groupby(["allocator", "size_bytes"])["us_per_pair"].median()
    size = 65536 if 65536 in one.index.get_level_values(1) else int(one.index.get_level_values(1)[0])
    us = one.xs(size, level="size_bytes")
    out = []
    if xp in us and "cupy_pool" in us:
        ratios = (one.xs(xp, level="allocator") / one.xs("cupy_pool", level="allocator")).dropna()
        text = (f"**Allocation cost** ({plots.fmt_bytes(size)}, one thread): {xp} {us[xp]:.2f} µs per alloc/free "
                f"pair, CuPy MemoryPool {us['cupy_pool']:.2f} µs (xpool takes {us[xp] / us['cupy_pool']:.2f}× CuPy's time; "
                f"{ratios.min():.2f}× to {ratios.max():.2f}× over {plots.fmt_bytes(int(ratios.index.min()))} to "
                f"{plots.fmt_bytes(int(ratios.index.max()))})")
        if "raw" in us:
            text += f", raw cudaMalloc/cudaFree {us['raw']:.1f} µs"
        if "noop" in us:
            text += f", floor (no-op allocator) {us['noop']:.2f} µs"
        out.append(text + f" ({_where(df)}).")
    threaded = df[df["sweep"] == "threads"] if "sweep" in df else df
    multi = threaded[threaded["size_bytes"] == size].groupby(["allocator", "threads"])["kpairs_per_s"].median()
    top = int(multi.index.get_level_values(1).max())
    if top > 1 and xp in multi and "cupy_pool" in multi:
        k = multi.xs(top, level="threads")
        text = (f"**{top} threads on one GPU** ({plots.fmt_bytes(size)}): {xp} {k[xp]:.0f}k pairs/s, "
                f"CuPy MemoryPool {k['cupy_pool']:.0f}k")
        if "raw" in k:
            text += f", raw {k['raw']:.0f}k"
        out.append(text + f" ({_where(df)}).")
    return out


def headline_single(data: pathlib.Path) -> str | None:
    df = _read(data, "single_gpu")
    if df is None:
        return None
    xp = _xpool(df["allocator"].unique())
    batch = int(df["batch"].max())
    b = df[df["batch"] == batch].groupby("allocator").median(numeric_only=True)
    if xp not in b.index:
        return None
    r = b.loc[xp]
    text = f"**One GPU** (batch {batch}): {xp} {plots.fmt_si(r['tokens_per_s'])} tokens/s"
    for peer, label in (("raw", "raw cudaMalloc"), ("cupy_pool", "CuPy MemoryPool")):
        if peer in b.index:
            text += f", {r['tokens_per_s'] / b.loc[peer, 'tokens_per_s']:.2f}× {label}"
    text += f"; {r['device_mallocs_per_step']:g} device mallocs per step after warm-up"
    if "raw" in b.index:
        text += f" (raw: {b.loc['raw', 'device_mallocs_per_step']:g})"
    text += f"; peak reserved {r['reserved_over_requested']:.2f}× requested"
    return text + f" ({_where(df)})."


def headline_ddp(data: pathlib.Path) -> str | None:
    df = _read(data, "ddp_scaling")
    if df is None:
        return None
    xp = _xpool(df["allocator"].unique())
    world = int(df["world"].max())
    top = df[df["world"] == world].groupby(["mode", "allocator"])["speedup"].median()
    parts = []
    for mode in [m for m in ("threads", "processes") if m in top.index.get_level_values(0)]:
        s = top.xs(mode, level="mode")
        if xp in s:
            before = f"raw {s['raw']:.2f}× → " if "raw" in s else ""
            parts.append(f"{plots.MODES.get(mode, mode)}: {before}{xp} {s[xp]:.2f}×")
    if not parts:
        return None
    return f"**{world} GPUs**, speedup over one GPU: " + "; ".join(parts) + f" ({_where(df)})."


def headline_memory(data: pathlib.Path) -> str | None:
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


def headlines(data: pathlib.Path) -> list[str]:
    """Every headline sentence the CSVs allow, in notebook order."""
    out = []
    for fn in (headline_correctness, headline_alloc, headline_single, headline_ddp, headline_memory):
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
    ("Several GPUs", ["ddp_scaling", "ddp_before_after"]),
    ("Memory", ["memory_waste", "memory_timeline", "memory_schemes"]),
]


def targets(data: pathlib.Path) -> list[dict]:
    """The issues' targets against the measurements: one row each (target, measured, met)."""
    rows = []

    def add(target, value, ok, fmt="{:.2f}"):
        if value is not None and not (isinstance(value, float) and math.isnan(value)):
            rows.append(dict(target=target, measured=fmt.format(value), met=bool(ok)))

    bench = _read(data, "alloc_microbench")
    if bench is not None:
        sized = bench[bench["sweep"] == "size"] if "sweep" in bench else bench
        med = sized.groupby(["allocator", "size_bytes"])["us_per_pair"].median()
        for xp in [a for a in ("xpool", "xpool_seed", "xpool_k1", "xpool_k4") if a in med.index.get_level_values(0)]:
            worst = float((med.xs(xp) / med.xs("cupy_pool")).max())
            add(f"{xp} µs per pair ≤ 1.05× CuPy MemoryPool's, every size (worst size)", worst, worst <= 1.05)
            kps = bench[(bench["allocator"] == xp) & (bench["sweep"] == "threads")].set_index("threads")["kpairs_per_s"]
            if 1 in kps and 8 in kps:
                add(f"{xp}: 8 threads ≥ 1 thread in pairs/s (ratio)", kps[8] / kps[1], kps[8] >= kps[1])
    single = _read(data, "single_gpu")
    if single is not None:
        tps = single.set_index(["allocator", "batch"])["tokens_per_s"]
        for xp in [a for a in ("xpool", "xpool_seed", "xpool_k1", "xpool_k4") if (a, 32) in tps]:
            add(f"one GPU, batch 32: {xp} ≥ 2.9× raw", tps[xp, 32] / tps["raw", 32], tps[xp, 32] >= 2.9 * tps["raw", 32])
            for b in (32, 4):
                if (xp, b) in tps and ("cupy_pool", b) in tps:
                    r = tps[xp, b] / tps["cupy_pool", b]
                    add(f"one GPU, batch {b}: {xp} ≥ 1.00× CuPy MemoryPool", r, r >= 1.0)
        pools = single[single["allocator"].str.startswith("xpool")]
        add("device mallocs per step after warm-up, every xpool run (max)", pools["device_mallocs_per_step"].max(),
            pools["device_mallocs_per_step"].max() == 0, "{:.0f}")
    ddp = _read(data, "ddp_scaling")
    if ddp is not None and (ddp["world"] == 2).any():
        two = ddp[(ddp["world"] == 2) & ddp["allocator"].str.startswith("xpool")]
        for mode, goal in (("threads", 1.85), ("processes", 1.95)):
            sub = two[two["mode"] == mode].set_index("allocator")["speedup"]
            for xp, v in sub.items():
                add(f"2 GPUs, one {mode[:-2] if mode == 'processes' else mode[:-1]} per GPU: {xp} ≥ {goal}×", v, v >= goal)
        if "loss_rel_diff_max" in ddp:
            add("DDP loss vs one GPU on the same global batch ≤ 1e-6 (max relative difference)",
                ddp["loss_rel_diff_max"].max(), ddp["loss_rel_diff_max"].max() <= 1e-6, "{:.1e}")
        if "param_rank_diff_max" in ddp:
            add("parameters agree across ranks < 1e-6 (max abs difference)",
                ddp["param_rank_diff_max"].max(), ddp["param_rank_diff_max"].max() < 1e-6, "{:.1e}")
    waste = _read(data, "memory_waste")
    if waste is not None:
        best = waste.loc[waste["reserved_over_requested"].idxmin()]
        add(f"peak reserved / peak requested ≤ 1.10 with the best class setting (k={int(best['k'])})",
            float(best["reserved_over_requested"]), best["reserved_over_requested"] <= 1.10, "{:.3f}")
    gpu = _read(data, "correctness_gpu")
    if gpu is not None:
        gate = gpu[gpu["check"].str.contains("transparency")]
        add("transparency gate: every allocator bit-identical to raw cudaMalloc (rows passing)",
            float(gate["passed"].sum()), bool(len(gate)) and gate["passed"].all(), f"{{:.0f}} of {len(gate)}")
    return rows


def bounds(data: pathlib.Path) -> list[str]:
    """What bounds the multi-GPU speedups, computed from the single-GPU and DDP rows."""
    single, ddp = _read(data, "single_gpu"), _read(data, "ddp_scaling")
    if single is None or ddp is None or not (ddp["world"] == 2).any():
        return []
    s = single.set_index(["allocator", "batch"])
    out = []
    xp = "xpool" if ("xpool", 4) in s.index else "xpool_k1"
    if (xp, 4) in s.index and (xp, 32) in s.index:
        host = s.loc[(xp, 4), "ms_per_step"]                       # dispatch-bound: the GPU idles most of it
        util4 = s.loc[(xp, 4), "gpu_util_mean"]
        gpu = s.loc[(xp, 32), "ms_per_step"] * s.loc[(xp, 32), "gpu_util_mean"] / 100
        ceiling = 2 * gpu / max(gpu, 2 * host)
        got = ddp[(ddp["mode"] == "threads") & (ddp["world"] == 2)].set_index("allocator")["speedup"]
        out.append(
            f"**One thread per GPU is bound by the GIL.** Issuing one training step from Python takes about "
            f"{host:.0f} ms of host time ({xp}'s batch-4 step, during which the GPU is busy only {util4:.0f}% of "
            f"the time); a batch-32 step keeps the GPU busy about {gpu:.0f} ms. Two threads share one GIL, so each "
            f"step needs at least {2 * host:.0f} ms: the ceiling is {ceiling:.2f}× on two GPUs even with perfect "
            f"overlap. The threads mode also fences every all-reduce (barrier, all-reduce, synchronize), because a "
            f"cudaMalloc/cudaFree on one GPU while the other GPU's NCCL kernel waits deadlocks; that removes the "
            f"overlap, and the measured speedups are " + ", ".join(f"{a} {v:.2f}×" for a, v in got.items()) + ".")
    one = ddp[(ddp["mode"] == "processes") & (ddp["world"] == 1)].set_index("allocator")["tokens_per_s"]
    both = [a for a in one.index if (a, 32) in s.index and a != "raw"]
    if both:
        spread = max(abs(one[a] / s.loc[(a, 32), "tokens_per_s"] - 1) for a in both)
        got = ddp[(ddp["mode"] == "processes") & (ddp["world"] == 2)].set_index("allocator")["speedup"]
        out.append(
            "**One process per GPU** reaches " + ", ".join(f"{a} {v:.2f}×" for a, v in got.items() if a != "raw")
            + f". The same allocator's one-GPU throughput differs by up to {spread:.0%} between the single-GPU "
            f"run and the one-process run of the same session ({int(ddp['steps'].iloc[0])} timed steps each), "
            f"as large as the differences between the pools here: longer runs are needed to rank them.")
    return out


def data_table(data: pathlib.Path) -> list[str]:
    rows = ["| CSV | rows | measured on | driver | CUDA | CuPy | commit | date |", "|---|---|---|---|---|---|---|---|"]
    for p in sorted(data.glob("*.csv")):
        df = pd.read_csv(p)
        if not set(plots.PROVENANCE) & set(df.columns):
            continue
        s = plots.provenance_summary(df)
        rows.append(f"| `data/{p.name}` | {len(df)} | {s['gpu']} | {s['driver']} | {s['cuda']} | {s['cupy']} | "
                    f"{s['commit']} | {s['date']} |")
    return rows


def render(data: pathlib.Path, runs: list[dict], figs: dict, report_dir: pathlib.Path) -> str:
    """The report's markdown; figure links are relative to `report_dir` (build/ and report/ are both one
    level below the repository, so one text serves both)."""
    lines = ["# xpool: results", "",
             "_Generated by `python -m xlab.report` (`make report`) from the CSVs in `data/`: every number here is "
             "computed from them, every figure is drawn from them alone._", "", "## Headlines", ""]
    heads = headlines(data)
    lines += [f"- {h}" for h in heads] if heads else ["- No measurements in `data/` yet."]
    missing = [f"`{n}.csv`" for n in ("alloc_microbench", "single_gpu", "ddp_scaling", "memory_waste",
                                      "correctness_gpu") if not (data / f"{n}.csv").is_file()]
    if missing:
        lines.append(f"- Not measured yet (run the notebooks or `make gpu` on a GPU machine): {', '.join(missing)}.")
    try:
        rows = targets(data)
    except (KeyError, ValueError, IndexError, TypeError) as e:    # a malformed CSV costs the table, not the report
        rows = []
        lines.append(f"- Targets: could not compute ({type(e).__name__}: {e}).")
    if rows:
        met = sum(r["met"] for r in rows)
        lines += ["", "## Targets", "", f"{met} of {len(rows)} met; every row is computed from the CSVs.", "",
                  "| target | measured | met |", "|---|---|---|"]
        lines += [f"| {r['target']} | {r['measured']} | {'yes' if r['met'] else '**no**'} |" for r in rows]
    try:
        why = bounds(data)
    except (KeyError, ValueError, IndexError, TypeError):
        why = []
    if why:
        lines += ["", "### What bounds the multi-GPU speedups", ""] + sum(([w, ""] for w in why), [])
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
    text = render(data, runs, figs, report_dir)
    build.mkdir(parents=True, exist_ok=True)
    report_dir.mkdir(parents=True, exist_ok=True)
    (build / "report.md").write_text(text)
    shutil.copyfile(build / "report.md", report_dir / "REPORT.md")
    print(f"report: {build / 'report.md'} and {report_dir / 'REPORT.md'} ({time.perf_counter() - t0:.0f} s in all)")
    failed = [r["notebook"] for r in runs if not r["ok"]]
    if failed:
        print(f"FAILED notebooks: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
