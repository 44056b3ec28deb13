"""What the notebooks share: their parameters checked, measure-or-load, figures shown inline, tables as summaries.
On a GPU a notebook measures into build/data/NAME.csv (with `publish=True`: data/NAME.csv, and redraws the committed
figure through xlab.plots.build); on a CPU it shows the committed CSV and says which machine and date it comes from.
"""
from __future__ import annotations

import ast
import builtins
import dataclasses
import difflib
import importlib
import json
import pathlib
import tempfile

import pandas as pd

from . import allocators, intervals, paths, plots, sources
from .correctness import run_correctness, transparency_rows  # noqa: F401 - the notebooks' names
from .provenance import has_gpu, provenance

_IPYTHON = {"In", "Out", "get_ipython", "exit", "quit", "open", "display"}


@dataclasses.dataclass
class Run:
    """One notebook run: where it reads committed CSVs, where it writes, whether a GPU measures."""

    name: str
    gpu: bool
    data: pathlib.Path          # the committed CSVs read
    out: pathlib.Path           # what this run measures is written here: build/data, or data/ when publishing
    publish: bool


def _cells(name: str) -> list[str]:
    nb = json.loads((paths.repo_root() / "notebooks" / f"{name}.ipynb").read_text())
    return [("".join(c["source"]), "parameters" in c.get("metadata", {}).get("tags", []))
            for c in nb["cells"] if c["cell_type"] == "code"]


def schema(name: str) -> dict:
    """{parameter: (annotation, default)} from the notebook's cell tagged `parameters`."""
    source = next(src for src, tagged in _cells(name) if tagged)
    return {n.target.id: (ast.unparse(n.annotation), ast.literal_eval(n.value))
            for n in ast.parse(source).body if isinstance(n, ast.AnnAssign)}


def _coerce(name: str, ann: str, value):
    """The value as its annotation wants it; papermill's `-p x 4` (a scalar, or 'a,b') stands for a list too."""
    kinds = {"int": int, "float": (int, float), "str": str, "bool": bool}
    base = ann.removeprefix("list[").removesuffix("]")
    example = {"list[int]": "-p batches 4, or -y 'batches: [32, 4]'", "list[str]": "-p allocators xpool",
               "int": "-p steps 10", "float": "-p seconds 0.5", "bool": "-p measure False", "str": "-p data_dir data"}
    if ann.startswith("list"):
        items = value.replace(",", " ").split() if isinstance(value, str) else value
        items = items if isinstance(items, (list, tuple)) else [items]
        try:
            items = [int(v) if base == "int" and isinstance(v, str) else v for v in items]
        except ValueError:
            items = None
        if items is None or not all(isinstance(v, kinds[base]) and not (isinstance(v, bool) and base != "bool")
                                    for v in items):
            raise TypeError(f"parameter {name!r} must be a {ann} ({example[ann]}), got {value!r}")
        return list(items)
    if not isinstance(value, kinds[ann]) or (isinstance(value, bool) and ann != "bool"):
        raise TypeError(f"parameter {name!r} must be {ann} ({example[ann]}), got {type(value).__name__} {value!r}")
    return float(value) if ann == "float" else value


def setup(name: str, namespace: dict) -> Run:
    """Check this notebook's parameters in `namespace`, each brought to its annotated type, arms checked, and say what
    the run is on. TypeError: a wrong type (named); ValueError: an unknown parameter (the closest named) or arm."""
    params = schema(name)
    assigned = {t.id for src, _ in _cells(name) for node in ast.walk(ast.parse(src))
                if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) for t in [node]}
    for key, value in list(namespace.items()):
        if (key.startswith("_") or key in params or key in assigned or key in _IPYTHON or hasattr(builtins, key)
                or not isinstance(value, (int, float, str, bool, list, tuple, dict))):
            continue
        close = difflib.get_close_matches(key, params, n=1)
        raise ValueError(f"unknown parameter {key!r} for notebook {name}" + (f" (did you mean {close[0]!r}?)"
                         if close else "") + f"; its parameters: {', '.join(params)}")
    for key, (ann, _) in params.items():
        namespace[key] = _coerce(key, ann, namespace[key])
    if "allocators" in params:
        allocators.parse(namespace["allocators"])
    publish = bool(namespace.get("publish", False))
    run = Run(name, has_gpu(), data_dir(namespace.get("data_dir")),
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
    p = plots.provenance_summary(df)
    machine = "a machine without a GPU" if str(p["gpu"]).startswith(("none", "unknown")) else p["gpu"]
    return f"measured on {machine} (driver {p['driver']}, CUDA {p['cuda']}, CuPy {p['cupy']}), commit {p['commit']}, " \
           f"{p['date']}"


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


def _resolve(fn):
    """A callable, or 'package.module:function' imported only now (so a CPU never imports GPU code)."""
    if callable(fn):
        return fn
    module, _, name = fn.partition(":")
    return getattr(importlib.import_module(module), name)


def load_or_measure(name: str, measure_fn, gpu_available: bool, data=None, measure: bool = True,
                    how_to_measure: str = "", out=None, **kwargs) -> pd.DataFrame | None:
    """Measure on a GPU into `out`/NAME.csv (default build/data/) by measure_fn(out=<csv>, **kwargs), else load the
    committed data/NAME.csv, and say which (attrs['source']); None with neither."""
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
    reason = "No GPU here" if not gpu_available else "measure=False"
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


def summary(df: pd.DataFrame | None, by, columns, fmt: str = "{:.3g}"):
    """Medians [95% interval] of `columns` per group of `by`, every row a click away; None without rows."""
    if df is None or not len(df):
        return None
    by, rows = list(by), []
    for key, g in df.groupby(by, sort=False):
        cells = {c: intervals.fmt_ci(*intervals.median_ci(g[c])[:3], fmt) for c in columns if c in g}
        rows.append({**dict(zip(by, key)), **cells, "trials": len(g)})
    return details(pd.DataFrame(rows), df)


def details(head: pd.DataFrame, full: pd.DataFrame):
    """A summary table with the full rows folded under it (click to open)."""
    from IPython.display import HTML
    return HTML(head.to_html(index=False) + f"<details><summary>All {len(full)} rows</summary>"
                f"{full.to_html(index=False, max_rows=2000)}</details>")


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


def assert_all_passed(df: pd.DataFrame) -> None:
    """Raise AssertionError naming each failed check of df (failing the notebook, so papermill and CI fail)."""
    failed = df[~df["passed"].astype(bool)]
    if len(failed):
        lines = "\n".join(f"  {r.check}: measured {r.measured:.3g} > threshold {r.threshold:.3g}"
                          for r in failed.itertuples())
        raise AssertionError(f"{len(failed)} correctness check(s) failed:\n{lines}")
    print(f"All {len(df)} checks passed.")
