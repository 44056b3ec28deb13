"""Helpers the notebooks share: where data and figures live, measure-or-load, provenance sentences, correctness.

A notebook on a GPU measures and writes data/NAME.csv; on a CPU it loads the committed CSV and says which
machine and date it comes from; when the CSV is missing too it says so and the figure is skipped.
"""
from __future__ import annotations

import importlib
import os
import pathlib
import tempfile

import pandas as pd

from . import paths, plots
from .correctness import run_correctness, transparency_rows  # noqa: F401 - the notebooks' names
from .provenance import has_gpu, provenance

PROVENANCE = plots.PROVENANCE


def data_dir(path: str | os.PathLike | None = None) -> pathlib.Path:
    """The folder of the CSVs (a notebook's `data_dir` parameter).

    Args:
        path: a folder; None or '' for the repository's data/.

    Returns:
        A Path.
    """
    return pathlib.Path(path) if path else paths.data_dir()


def figures_dir(path: str | os.PathLike | None = None) -> pathlib.Path:
    """Where figures are saved (a notebook's `figures_dir` parameter): `path`, else the repository's figures/."""
    return pathlib.Path(path) if path else paths.figures_dir()


def build_dir() -> pathlib.Path:
    """The repository's build/: what a run makes and nobody commits (CPU check results, executed notebooks)."""
    return paths.build_dir()


def gpu_available() -> bool:
    """True when CuPy sees a CUDA device (the notebook measures instead of loading)."""
    return has_gpu()


def machine_line() -> str:
    """What this kernel runs on, for the first output of every notebook."""
    info = provenance()
    where = f"GPU: {info['gpu']} x{info['n_gpus']}" if info["n_gpus"] else "no GPU (CPU mode)"
    return (f"This run: {info['host']}, {where}, CuPy {info['cupy']}, Python {info['python']}, "
            f"commit {info['commit']}, {info['date']}")


def describe_provenance(df: pd.DataFrame) -> str:
    """'measured on <gpu> (driver ..., CUDA ..., CuPy ...), commit ..., <date>' from the provenance columns.

    Args:
        df: a measurement frame, or None.

    Returns:
        A sentence ("no measurements" for None or no rows).
    """
    if df is None or not len(df):
        return "no measurements"
    p = plots.provenance_summary(df)
    if p["gpu"] in ("none", "unknown"):
        machine, gpus = "a machine without a GPU", ""
    else:
        machine = p["gpu"]
        gpus = f"{p['n_gpus']} GPUs on the machine; " if p.get("n_gpus") not in (None, "", "unknown", "1") else ""
    return (f"measured on {machine} ({gpus}driver {p['driver']}, CUDA {p['cuda']}, CuPy {p['cupy']}), "
            f"commit {p['commit']}, {p['date']}")


def load_csv(name: str, data: str | os.PathLike | None = None) -> pd.DataFrame | None:
    """data/NAME.csv as a DataFrame, or None if it is not there.

    Args:
        name: the CSV's name without .csv.
        data: the CSV folder (default: data/).

    Returns:
        A DataFrame, or None.
    """
    path = data_dir(data) / f"{name}.csv"
    return pd.read_csv(path) if path.is_file() else None


def _resolve(fn):
    """A callable, or 'package.module:function' imported only now (so a CPU never imports GPU code)."""
    if callable(fn):
        return fn
    module, _, name = fn.partition(":")
    return getattr(importlib.import_module(module), name)


def load_or_measure(name: str, measure_fn, gpu_available: bool, data: str | os.PathLike | None = None,
                    measure: bool = True, how_to_measure: str = "", **kwargs) -> pd.DataFrame | None:
    """Measure on a GPU, else load the committed data/NAME.csv; print where the numbers come from.

    measure_fn: a callable or 'module:function', called as measure_fn(out=<data/NAME.csv>, **kwargs) and
    returning a DataFrame (written to the CSV if the function did not write it). Returns None when there
    is nothing to show (no GPU and no CSV): the caller skips its figure. df.attrs['source'] says
    'measured' or 'committed'.

    Args:
        name: the CSV's name without .csv.
        measure_fn: the measuring function.
        gpu_available: whether this kernel sees a GPU.
        data: the CSV folder (default: data/).
        measure: False loads even on a GPU.
        how_to_measure: the hint printed when there is nothing to load.
        **kwargs: passed to measure_fn.
    """
    path = data_dir(data) / f"{name}.csv"
    if gpu_available and measure:
        path.parent.mkdir(parents=True, exist_ok=True)
        df = _resolve(measure_fn)(out=str(path), **kwargs)
        if df is None:
            df = pd.read_csv(path)
        elif not path.is_file():
            paths.write_csv(df, path)
        print(f"Measured now and written to {path}: {describe_provenance(df)}.")
        df.attrs["source"] = "measured"
        return df
    reason = "No GPU here" if not gpu_available else "measure=False"
    if not path.is_file():
        if not how_to_measure and isinstance(measure_fn, str):
            module, _, fn = measure_fn.partition(":")
            how_to_measure = f"run this notebook there, or: from {module} import {fn}; {fn}(out='data/{name}.csv')"
        how = how_to_measure
        hint = f" To measure it, on a GPU machine: {how}" if how else ""
        print(f"{reason}, and {path} is missing: nothing to show, its figure is skipped.{hint}")
        return None
    df = pd.read_csv(path)
    print(f"{reason}: showing the committed measurements in {path}, {describe_provenance(df)}.")
    df.attrs["source"] = "committed"
    return df


def cpu_smoke(measure_fn, **kwargs) -> pd.DataFrame | None:
    """Run a measuring function's CPU mode (cpu=True: NumPy, tiny sizes) into a temporary CSV.

    It checks that the code runs and its rows have the CSV's schema; it measures nothing and writes
    nothing into data/. Returns its rows, or None if the measuring module does not exist yet.

    Args:
        measure_fn: a callable or 'module:function' taking cpu= and out=.
        **kwargs: passed to it.

    Raises:
        AssertionError: the rows' own checks failed.
    """
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


def figure(plot_fn, df: pd.DataFrame | None, name: str, figures: str | os.PathLike | None = None, **kwargs):
    """plot_fn(df, **kwargs) saved as figures/NAME.png and .svg and returned for display; None if no data.

    Args:
        plot_fn: a plots function.
        df: its frame, or None.
        name: the file name.
        figures: the folder (default: figures/).
        **kwargs: passed to plot_fn.

    Returns:
        What `show` returns, or None.
    """
    if df is None or not len(df):
        print(f"No data: figure {name} skipped.")
        return None
    return show(plot_fn(df, **kwargs), name, figures)


def show(fig, name: str, figures: str | os.PathLike | None = None):
    """Save fig as figures/NAME.png and .svg and return the PNG for Jupyter to display (its path without IPython).

    Args:
        fig: a Figure.
        name: the file name.
        figures: the folder (default: figures/).

    Returns:
        An IPython Image, or the PNG's path.
    """
    png, _ = plots.save(fig, name, figures_dir(figures))
    try:
        from IPython.display import Image
    except ImportError:                   # a plain Python run of the notebook's code, e.g. on a GPU machine
        return png
    return Image(filename=str(png))


def _selected(df: pd.DataFrame | None, query: dict) -> pd.DataFrame | None:
    """The rows of df matching every column=value of query; None for no data."""
    if df is None or not len(df):
        return None
    for col, value in query.items():
        df = df[df[col] == value]
    return df


def pivot(df: pd.DataFrame | None, index, columns: str, values: str, **query):
    """Median of `values` by index x columns, for display, after filtering rows by equality (e.g. threads=1);
    None if no data.

    Byte sizes as columns are shown as '64 KiB'.

    Args:
        df: a tidy frame, or None.
        index, columns, values: as DataFrame.pivot_table.
        **query: column=value filters.

    Returns:
        A styled table, or None.
    """
    df = _selected(df, query)
    if df is None:
        return None
    t = df.pivot_table(index=index, columns=columns, values=values, aggfunc="median", sort=False)
    if columns == "size_bytes":
        t = t[sorted(t.columns)]
        t.columns = [plots.fmt_bytes(c) for c in t.columns]
    return t.style.format(_number)


def medians(df: pd.DataFrame | None, by, columns):
    """Median of each column over trials per group of `by`, with a trials count, for display; None if no data.

    Args:
        df: a tidy frame, one row per trial.
        by: grouping columns (e.g. ["batch", "allocator"]).
        columns: the columns to summarise (absent ones are skipped).

    Returns:
        A styled table (numbers shortened).
    """
    if df is None or not len(df):
        return None
    cols = [c for c in columns if c in df]
    t = df.groupby(list(by), sort=False)[cols].median(numeric_only=True)
    t["trials"] = df.groupby(list(by), sort=False).size()
    return t.style.format(_number)


def _number(v) -> str:
    """Readable numbers: 421,923 and 1.75 and 3.1e-07."""
    if not isinstance(v, (int, float)) or v != v:
        return str(v)
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}"


def table(df: pd.DataFrame | None, columns=None, **query):
    """A compact view of a tidy frame for a notebook (chosen columns, numbers shortened); None if no data.

    Keyword arguments filter rows by equality, e.g. table(df, threads=1).

    Args:
        df: a tidy frame, or None.
        columns: the columns to show (default: all).
        **query: column=value filters.

    Returns:
        A styled table, or None.
    """
    df = _selected(df, query)
    if df is None:
        return None
    view = df[[c for c in columns if c in df]] if columns is not None else df
    return view.style.format(_number, subset=list(view.select_dtypes("number").columns)).hide(axis="index")


# ---------------------------------------------------------------------------------------------------------
# Correctness (notebook 01, and the GPU script)


def measured_here(*frames) -> pd.DataFrame:
    """The frames measured in this run (attrs['source'] == 'measured'), concatenated: what a gate judges."""
    mine = [f for f in frames if f is not None and f.attrs.get("source") == "measured"]
    return pd.concat(mine, ignore_index=True) if mine else pd.DataFrame(columns=["check", "passed"])


def correctness_summary(df: pd.DataFrame) -> pd.DataFrame:
    """Pass counts per device: the one-glance verdict above the full table.

    Args:
        df: correctness rows.

    Returns:
        A DataFrame: device, checks, passed, failed.
    """
    g = plots.with_device(df).groupby("device", sort=False)["passed"]
    return pd.DataFrame({"checks": g.size(), "passed": g.sum(), "failed": g.size() - g.sum()}).reset_index()


def assert_all_passed(df: pd.DataFrame) -> None:
    """Raise (failing the notebook, so papermill and CI fail) if any check in df failed.

    Args:
        df: correctness rows.

    Raises:
        AssertionError: naming each failed check.
    """
    failed = df[~df["passed"].astype(bool)]
    if len(failed):
        lines = "\n".join(f"  {r.check}: measured {r.measured:.3g} > threshold {r.threshold:.3g}"
                          for r in failed.itertuples())
        raise AssertionError(f"{len(failed)} correctness check(s) failed:\n{lines}")
    print(f"All {len(df)} checks passed.")
