"""What the notebooks share: their parameters checked, measure-or-load, figures shown inline, tables as summaries.
On a GPU a notebook measures into build/data/NAME.csv (with `publish=True`: data/NAME.csv, and redraws the committed
figure through xlab.plots.build); on a CPU it shows the committed CSV and says which machine and date it comes from.
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import subprocess
import sys
import tempfile

import pandas as pd

from . import parameters, paths, plots, sources, tables
from .correctness import run_correctness, transparency_rows  # noqa: F401 - the notebooks' names
from .parameters import (PARAMETERS, Param, ParameterError, _resolve, check_parameters, injected,  # noqa: F401
                         schema)
from .provenance import has_gpu, provenance


@dataclasses.dataclass
class Run:
    """One notebook run: where it reads committed CSVs, where it writes, whether a GPU measures."""

    name: str
    gpu: bool
    data: pathlib.Path          # the committed CSVs read
    out: pathlib.Path           # what this run measures is written here: build/data, or data/ when publishing
    publish: bool


def _read(path: pathlib.Path) -> list[tuple[str, str, tuple]]:
    """(cell type, source, tags) of each cell of a notebook, .py (jupytext) or .ipynb: what pairing keeps equal."""
    import jupytext
    return [(c.cell_type, c.source, tuple(c.metadata.get("tags", ()))) for c in jupytext.read(path).cells]


def unpaired(folder: pathlib.Path | None = None) -> list[pathlib.Path]:
    """The notebooks/NN_*.py whose .ipynb is missing or holds other cells (a .py changed since they were paired)."""
    folder = folder or paths.repo_root() / "notebooks"
    return [py for py in sorted(folder.glob("[0-9][0-9]_*.py"))
            if not py.with_suffix(".ipynb").is_file() or _read(py.with_suffix(".ipynb")) != _read(py)]


def pair(folder: pathlib.Path | None = None) -> list[str]:
    """Bring each unpaired .ipynb up to date from its .py (jupytext --update: its outputs kept) where the .py is the
    newer, and leave the others untouched: one open in JupyterLab is not rewritten under it, and one edited since
    without jupytext keeps its edits (said, with how to take them to the .py). `make setup` runs this; it writes no
    .py. A line for each notebook it wrote or left unpaired."""
    said = []
    for py in unpaired(folder):
        ipynb = py.with_suffix(".ipynb")
        if ipynb.is_file() and ipynb.stat().st_mtime > py.stat().st_mtime:
            said.append(f"left {ipynb.name} alone: it has cells its .py lacks (`jupytext --sync notebooks/{ipynb.name}` "
                        f"writes them to the .py; deleting the .ipynb drops them)")
            continue
        subprocess.run([sys.executable, "-m", "jupytext", "--quiet", "--update", "--to", "ipynb", str(py)], check=True)
        _with_language_info(ipynb)
        said.append(f"paired {ipynb.name} with {py.name}")
    return said


def _with_language_info(ipynb: pathlib.Path) -> None:
    """Give the .ipynb the language_info its kernel (this environment's ipykernel) reports. JupyterLab sets the
    kernel's into the notebook once it starts, and a change there marks the tab unsaved: without it every notebook
    opened dirty. The .py never holds it (jupytext.toml's metadata filter)."""
    import nbformat
    from ipykernel.ipkernel import IPythonKernel
    nb = nbformat.read(ipynb, as_version=4)
    if nb.metadata.get("language_info") != IPythonKernel.language_info:
        nb.metadata["language_info"] = dict(IPythonKernel.language_info)
        nbformat.write(nb, ipynb)


def stale(name: str) -> str:
    """A line saying notebooks/NAME.ipynb holds other cells than NAME.py, or "": papermill runs the .ipynb. JupyterLab
    (with jupytext) reads the .py itself: checked only outside it."""
    if os.environ.get("JPY_SESSION_NAME"):
        return ""
    py = paths.repo_root() / "notebooks" / f"{name}.py"
    if not py.with_suffix(".ipynb").is_file() or py not in unpaired(py.parent):
        return ""
    return (f"notebooks/{name}.ipynb holds other cells than notebooks/{name}.py, the notebook git holds: `make setup` "
            f"takes a newer .py's to the .ipynb, `jupytext --sync notebooks/{name}.ipynb` a newer .ipynb's to the .py.")


def setup(name: str, namespace: dict) -> Run:
    """Check this notebook's parameters in `namespace` (check_parameters: types, ranges, arms), say which this
    machine ignores and what the run is on."""
    parameters.check(name, namespace)               # first: has_gpu imports CuPy
    gpu = has_gpu()
    ignored = parameters.ignored(name, namespace, gpu)
    if note := stale(name):
        print(f"Note: {note}")
    if ignored:
        print(f"Ignored here ({'a GPU measures; they act only without one' if gpu else 'no GPU; they set what a GPU measures'}): "
              f"{', '.join(ignored)}.")
    publish = bool(namespace.get("publish", False))
    run = Run(name, gpu, data_dir(namespace.get("data_dir")),
              paths.data_dir() if publish else paths.build_dir() / "data", publish)
    info = provenance()
    where = f"GPU: {info['gpu']} x{info['n_gpus']}" if info["n_gpus"] else "no GPU (CPU mode)"
    print(f"This run: {info['host']}, {where}, CuPy {info['cupy']}, Python {info['python']}, commit {info['commit']}, "
          f"{info['date']}; reads {run.data}, writes {run.out if run.gpu else 'nothing outside build/'}")
    return run


def data_dir(path=None) -> pathlib.Path:
    """The folder of the committed CSVs (a notebook's `data_dir`; empty: the repository's data/)."""
    return pathlib.Path(path) if path else paths.data_dir()


def describe_provenance(df: pd.DataFrame | None) -> str:
    """'measured on <gpu> (driver ..., CUDA ..., CuPy ...), commit ..., <date>' from the provenance columns."""
    if df is None or not len(df):
        return "no measurements"
    said = []
    for _, rows in (df.groupby(df["gpu"].fillna("unknown").astype(str), sort=False) if "gpu" in df else [(0, df)]):
        p = plots.provenance_summary(rows)          # each machine apart: a GPU's rows and a CPU's never mixed
        machine = "a machine without a GPU" if str(p["gpu"]).startswith(("none", "unknown")) else p["gpu"]
        said.append(f"{machine} (driver {p['driver']}, CUDA {p['cuda']}, CuPy {p['cupy']}), commit {p['commit']}, "
                    f"{p['date']}")
    return "measured on " + "; and on ".join(said)


def shown_from(name: str, data=None) -> str:
    """Which committed CSVs the rows shown for data/NAME.csv come from: NAME.csv itself, with its provenance, or,
    where it is one CSV of a lineage (xlab.sources.KINDS), the CSVs its lineages' newest rows come from (what
    `rows` and the figures show: the lineage of its name, else every lineage it is in), each with its commit, and
    their machines and dates."""
    folder = data_dir(data)
    kinds = [name] if name in sources.KINDS else [k for k, (members, _) in sources.KINDS.items()
                                                   if any(n == name for n, _ in members)]
    shown = [df for k in kinds if (df := sources.current(folder, k)) is not None]
    if not shown:
        return f"in {folder / f'{name}.csv'}, {describe_provenance(sources.read(folder, name))}"
    rows = pd.concat(shown, ignore_index=True)
    return (f"of {name}.csv's kind, the newest rows of each arm: {sources.sources(rows).replace('`', '')}; "
            f"{describe_provenance(rows)}")


def load_csv(name: str, data=None) -> pd.DataFrame | None:
    """data/NAME.csv as its readers take it (xlab.sources.read), or None if it is not there."""
    return sources.read(data_dir(data), name)


def load_or_measure(name: str, measure_fn, gpu_available: bool, data=None, measure: bool = True,
                    how_to_measure: str = "", out=None, skipped: str = "measure=False",
                    **kwargs) -> pd.DataFrame | None:
    """Measure on a GPU into `out`/NAME.csv (default build/data/) by measure_fn(out=<csv>, **kwargs), else load the
    committed data/NAME.csv, and say which (attrs['source']; `skipped`: why a GPU did not measure); None with
    neither."""
    if gpu_available and measure:
        path = pathlib.Path(out or paths.build_dir() / "data") / f"{name}.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        df = _resolve(measure_fn)(out=str(path), **kwargs)
        if df is None:
            df = pd.read_csv(path)
        elif not path.is_file():
            paths.write_csv(df, path)
        df = sources.prepare(df, f"{name}.csv (measured now)")
        print(f"Measured now and written to {path}: {describe_provenance(df)}.")
        df.attrs["source"] = "measured"
        return df
    reason = "No GPU here" if not gpu_available else skipped
    path = data_dir(data) / f"{name}.csv"
    if not path.is_file():
        if not how_to_measure and isinstance(measure_fn, str):
            module, _, fn = measure_fn.partition(":")
            how_to_measure = f"run this notebook there, or: from {module} import {fn}; {fn}(out='data/{name}.csv')"
        hint = f" To measure it, on a GPU machine: {how_to_measure}" if how_to_measure else ""
        print(f"{reason}, and {path} is missing: nothing to show, its figure is skipped.{hint}")
        return None
    df = sources.read(data_dir(data), name)
    print(f"{reason}: showing the committed measurements {shown_from(name, data)}.")
    df.attrs["source"] = "committed"
    return df


def cpu_smoke(measure_fn, **kwargs) -> pd.DataFrame | None:
    """A measuring function's CPU mode into a temporary CSV: the code runs, its rows' own checks pass."""
    try:
        fn = _resolve(measure_fn)
    except ModuleNotFoundError as e:
        print(f"CPU check skipped: {measure_fn} is not available ({e}).")
        return None
    with tempfile.TemporaryDirectory() as d:
        df = fn(cpu=True, out=str(pathlib.Path(d) / "smoke.csv"), **kwargs)
    ok = bool(df["checks_passed"].all()) if "checks_passed" in df else True
    print(f"CPU check of {measure_fn} (NumPy, measures nothing): {len(df)} rows, "
          f"built-in checks {'passed' if ok else 'FAILED'}.")
    if not ok:
        raise AssertionError(f"{measure_fn} on the CPU: built-in checks failed\n{df.to_string()}")
    return df


def rows(kind: str, run: Run, measured: pd.DataFrame | None = None) -> pd.DataFrame | None:
    """What a figure of `kind` shows: what this run measured, else the committed CSVs' newest rows."""
    now = measured is not None and measured.attrs.get("source") == "measured"
    return sources.current(run.out if now else run.data, kind)


def show(fig):
    """A Figure as an inline image (PNG bytes; nothing is written), or the figure itself outside IPython."""
    try:
        from IPython.display import Image
    except ImportError:
        return fig
    return Image(data=plots.png(fig), format="png")


def figure(name: str, *frames, run: Run | None = None, **kwargs):
    """Figure `name` of these rows, inline (publishing: figures/ rebuilt by plots.build); None without."""
    frames = [f if "csv" in f else sources.prepare(f, "this run") for f in frames if f is not None and len(f)]
    if not frames:
        print(f"No data: figure {name} skipped.")
        return None
    if run is not None and run.publish:
        print(f"figures/{name}.png rebuilt from {run.out}: {plots.build(name, run.out, paths.figures_dir())}")
    return show(plots.FIGURES[name][1](pd.concat(frames, ignore_index=True), **kwargs))


# --- tables for people (xlab.tables), as inline HTML
def _html(text: str | None):
    """Inline HTML in IPython (the text itself outside it); None stays None, so a cell shows nothing."""
    if text is None:
        return None
    try:
        from IPython.display import HTML
    except ImportError:
        return text
    return HTML(text)


def summary(df: pd.DataFrame | None, by, columns):
    """Medians [95% intervals] of `columns` per group of `by`, where each row comes from, long tables folded per
    group, every row a click away (xlab.tables.summary); None without rows."""
    return _html(tables.summary(df, by, columns))


def table(df: pd.DataFrame | None, full: pd.DataFrame | None = None, group: str | None = None, lines=None,
          sources=()):
    """Any frame for people (xlab.tables.table): its full rows folded under it, long ones folded by `group`, the CSVs
    it joins (`sources`: frames as the lab reads them) named with their commits and dates above it."""
    named = [tables.source_of(f) for f in sources if f is not None and len(f)]
    return _html(tables.table(df, full=full, group=group, lines=lines,
                              caption=f"Rows from {'; '.join(named)}." if named else ""))


def with_units(df: pd.DataFrame | None) -> pd.DataFrame | None:
    """A frame of `value` and `unit` columns with one column per unit, named by it (NaN in the other rows), so each
    table can name its unit: torch_interop.csv's value -> us_per_pair, tokens_per_s."""
    if df is None or "unit" not in df:
        return df
    return df.assign(**{str(u): df["value"].where(df["unit"] == u) for u in df["unit"].dropna().unique()})


# --- one set-up in two figures (notebook 04)
RUN_COLUMNS = ("csv", "commit", "date", "gpu", "steps", "warmup", "bound")


def same_setup(*frames, keys=("mode", "world", "batch"), value: str = "speedup", where: dict | None = None):
    """Where figures drawn from different CSVs show one set-up (`where`: e.g. threads, 2 GPUs, batch 32) under the
    same arms: a row per run and arm, its median `value` [95% interval] and GPU utilisation, and what the run was
    (RUN_COLUMNS); and a line naming what differs between the runs. (None, "") where they share none."""
    from . import intervals as iv
    rows = [f for f in frames if f is not None and len(f)]
    if len(rows) < 2:
        return None, ""
    arms = set.intersection(*(set(f["allocator"]) for f in rows))
    both = pd.concat([f[f["allocator"].isin(arms)] for f in rows], ignore_index=True)
    for k, v in (where or {}).items():
        both = both[both[k] == v]
    if both.empty or both["csv"].nunique() < 2:
        return None, ""
    shown = [c for c in RUN_COLUMNS if c in both]
    out = []
    for (csv, arm), g in both.groupby(["csv", "allocator"], sort=False):
        med, lo, hi = iv.median_ci(g[value].tolist())[:3]
        out.append({**{c: ", ".join(sorted(map(str, g[c].dropna().unique()))) for c in shown}, "allocator": arm,
                    value: f"{med:.2f}× [{lo:.2f}, {hi:.2f}]", "gpu_util_mean": f"{g['gpu_util_mean'].median():.0f}%",
                    "trials": len(g)})
    table = pd.DataFrame(out)
    runs = table.groupby("csv", sort=False)[shown[1:]].agg(lambda v: ", ".join(sorted(set(v))))
    differ = [c for c in shown[1:] if runs[c].nunique() > 1]
    said = (f"The same set-up ({', '.join(f'{k} {v}' for k, v in (where or {}).items())}) in {len(runs)} runs: "
            f"{', '.join(runs.index)}; they differ in {', '.join(differ) or 'nothing recorded'}.")
    return table[["allocator", value, "gpu_util_mean", "trials", *shown]], said


# --- correctness (notebook 01)
def measured_here(*frames) -> pd.DataFrame:
    """The frames measured in this run (attrs['source'] == 'measured'), concatenated: what a gate judges."""
    mine = [f for f in frames if f is not None and f.attrs.get("source") == "measured"]
    return pd.concat(mine, ignore_index=True) if mine else pd.DataFrame(columns=["check", "passed"])


def correctness_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Pass counts per device and family of checks (the figure's rows): the one-glance verdict."""
    d = sources.with_device(df).assign(family=lambda f: f["check"].map(plots.family))
    g = d.groupby(["device", "family"], sort=False)["passed"]
    return pd.DataFrame({"checks": g.size(), "passed": g.sum(), "failed": g.size() - g.sum()}).reset_index()


def verdict(checks: pd.DataFrame):
    """The pass counts per device and family (correctness_summary), a line per device with where its checks come
    from, every check a click away."""
    head = correctness_summary(checks)
    full = sources.with_device(checks.assign(csv=checks["csv"].fillna("this run") if "csv" in checks else "this run"))
    lines = {d: f"{d}: {g['checks'].sum():,} checks in {len(g)} families, {g['failed'].sum():,} failed "
                f"({tables.source_of(full[full['device'] == d])})" for d, g in head.groupby("device", sort=False)}
    shown = [c for c in ("device", "check", "measured", "threshold", "passed", "csv", "commit", "date") if c in full]
    return table(head, full=full[shown], group="device", lines=lines)


def assert_all_passed(df: pd.DataFrame) -> None:
    """Raise AssertionError naming each failed check of df (failing the notebook, so papermill and CI fail)."""
    failed = df[~df["passed"].astype(bool)]
    if len(failed):
        lines = "\n".join(f"  {r.check}: measured {r.measured:.3g} > threshold {r.threshold:.3g}"
                          for r in failed.itertuples())
        raise AssertionError(f"{len(failed)} correctness check(s) failed:\n{lines}")
    print(f"All {len(df)} checks passed.")


if __name__ == "__main__":          # python -m xlab.notebook_utils: pair the notebooks (make setup)
    print("\n".join(pair()) or "notebooks: every .ipynb holds its .py's cells")
