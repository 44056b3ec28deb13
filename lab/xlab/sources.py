"""Where every figure, target and headline reads its rows: lineages of CSVs (KINDS), and the runs they come from.
`current` keeps, for each arm and configuration of a lineage, the rows of the newest CSV that has them; the older
rows are its history (docs/decisions/0009-newest-csv-of-its-kind.md). `of_kind` finds every CSV of a lineage's benchmark, listed in the lineage or not, so that the
rule "each row reads the newest CSV of its kind" is checked (xlab.targets.stale). Every row says where it came from
(`csv`: the CSV, `run`: its commit). A second run of the suite (data/rerun/, data/graph/rerun/) is read only
against its first run.
"""
from __future__ import annotations

import hashlib
import io
import pathlib
import re

import numpy as np
import pandas as pd

from . import shared

# lineage -> ((CSV, {column: value} selection), ...), the columns naming one configuration. The first CSV's selection
# is the lineage's own: it picks the rows of any CSV of the same benchmark (`benchmark`), in the lineage or not.
_ALLOC_ARMS = ("raw", "raw_held", "noop", "c_noop", "cupy_pool", "cupy_torch", "cupy_async", "xpool", "xpool_seed",
               "xpool_expandable")   # core_split_gpu.csv's builds from before the split (xpool_before, ...) are not
_ONE_GPU_ARMS = ("raw", "cupy_pool", "xpool", "xpool_seed")       # the eager arms of the graph runs' one-GPU CSV
KINDS = {
    # core_split_gpu (f748abb): the same sweep after the core was split into its files, a build from before beside it
    "alloc_size": ((("alloc_microbench", {"sweep": "size"}), ("alloc_hit_sweep", {}), ("alloc_hit_sweep_repeat", {}),
                    ("core_split_gpu", {"sweep": "size", "allocator": _ALLOC_ARMS}),
                    ("2026-12-07_db0b678/alloc_microbench", {"sweep": "size"}),
                    ("2026-12-08_f5a602a/alloc_microbench", {"sweep": "size"})), ("size_bytes",)),
    "alloc_threads": ((("alloc_microbench", {"sweep": "threads"}), ("alloc_hit_threads", {}),
                       ("2026-12-07_db0b678/alloc_microbench", {"sweep": "threads"}),
                       ("2026-12-08_f5a602a/alloc_microbench", {"sweep": "threads"})),
                      ("size_bytes", "threads")),
    # graph/single_gpu (07fc8b1): raw, CuPy's pool and xpool again at batch 32, beside the graph arms. 2026-12-07_db0b678/:
    # the product as frozen (one release rule per scheme), on one H100 (runs/2026-12-07_db0b678_h100: its logs); its
    # batch-4 rows are 10-step windows, too short for NVML's busy share (busy_b4 keeps its 250-step runs).
    # 2026-12-08_f5a602a/: the product at 0.3.0 on one H100 (runs/2026-12-08_f5a602a_h100), its batch-4 rows as short
    "single_gpu": ((("single_gpu", {}), ("single_gpu_recheck", {}), ("graph/single_gpu", {"allocator": _ONE_GPU_ARMS}),
                    ("2026-12-07_db0b678/single_gpu", {}), ("2026-12-08_f5a602a/single_gpu", {})), ("batch",)),
    # NVML's utilisation needs windows longer than its sample period (1/6 s to 1 s): 250 steps at batch 4
    "busy_b4": ((("single_gpu", {"batch": 4}), ("single_gpu_recheck", {"batch": 4}),
                 ("graph/single_gpu_b4", {"batch": 4})), ("batch",)),
    # ddp_expandable (d07f649): raw, CuPy's pool and xpool again, beside the expandable scheme, on another day's host
    "ddp": ((("ddp_scaling", {}), ("ddp_expandable", {})), ("mode", "world", "batch")),
    "batch_sweep": ((("batch_sweep", {}), ("graph/batch_sweep", {})), ("mode", "world", "batch")),
    "graph": ((("graph/single_gpu", {}), ("graph/single_gpu_b4", {}), ("graph/ddp_scaling", {}),
               ("graph/ddp_processes", {})), ("mode", "world", "batch")),
    "correctness": ((("correctness_cpu", {}), ("correctness_gpu", {}), ("2026-12-07_db0b678/correctness_gpu", {})),
                    ("device", "check")),
    "dynamic_shapes": ((("dynamic_shapes", {}),), ("workload",)),
    # issue #46 (xlab.bench.dynamic_scale): the dynamic workloads at 33-40 GiB requested, and under memory caps. Each
    # its own benchmark (its rows' `experiment`), never read as a newer run of dynamic_shapes or of each other
    "dynamic_scale": ((("dynamic_scale", {}),), ("workload",)),
    "memory_cap": ((("memory_cap", {}),), ("workload", "cap_over_peak_requested")),
}
# Columns that say what a benchmark ran rather than how long it was timed: rows that differ in one of them are
# another configuration of the benchmark, not a newer measurement of the same one (a 250-step window, CuPy's launches)
CONFIG = ("steps", "warmup", "launch", "launcher", "gemm", "fused", "adamw", "config", "block_size", "n_layer", "quick")
# A folder of a second run of the suite: read only against its first run ("Does a second run
# agree?"), never as a newer CSV of its kind
SECOND_RUN = "rerun"
ARM_COLUMNS = ("allocator", "arm")
# Commits some CSVs name that are not in this repository: a commit on a branch before it was rebased onto main
# (Note [Commits not in the repository] in xlab/provenance.py); the commit the file landed in stands in for it.
REWRITTEN = {"06b3f1f1f9cf": "012dbeb", "55e7e8bbc053": "924512e", "470072ec67b5": "4e9da9f",
             "8747672b68f9": "30f9bd2", "0750f17d9e74": "120c7ca"}


# (CSV name, its bytes' digest) -> its prepared rows: a page reads each CSV many times (every target, figure and
# table of its lineage), and a CSV's rows follow from its name and bytes alone. Bounded: the oldest go first.
_READ: dict[tuple[str, bytes], pd.DataFrame] = {}
_READ_MAX = 256


def read(data: pathlib.Path, name: str) -> pd.DataFrame | None:
    """data/NAME.csv with today's arm names (allocators.canonical) and its derived columns; None if missing.  Each
    call gets its own copy; a CSV whose bytes were read before is not parsed again."""
    path = pathlib.Path(data) / f"{name}.csv"
    try:
        raw = path.read_bytes()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None
    key = (f"{name}.csv", hashlib.blake2b(raw, digest_size=20).digest())
    df = _READ.get(key)
    if df is None:
        df = prepare(pd.read_csv(io.BytesIO(raw)), f"{name}.csv").copy()     # copy: one block per dtype
        while len(_READ) >= _READ_MAX:
            _READ.pop(next(iter(_READ)))
        _READ[key] = df
    return df.copy()


def prepare(df: pd.DataFrame, csv: str) -> pd.DataFrame:
    """A CSV's rows as every reader takes them: today's arm names, the derived columns, where they came from."""
    df = shared.canonical(df)
    if "class_over_requested" in df:
        df["class_waste_pct"] = 100 * (df["class_over_requested"] - 1)
    if "device_calls_per_steady_step" in df:       # a trial with no device call in steady state (xlab.targets.ZERO)
        calls = df["device_calls_per_steady_step"]
        df = df.assign(zero_steady_calls=(calls == 0).astype(float).where(calls.notna()))
    if "check" in df and "passed" in df:
        df = with_device(df).assign(gate=df["check"].astype(str).str.startswith("transparency"))
    return df.assign(csv=csv, run=run_label(df))


def with_device(df: pd.DataFrame) -> pd.DataFrame:
    """Check rows with a `device` column ('cpu'/'gpu') where a CSV lacks one, from the array module."""
    guess = (df["xp"].astype(str) == "cupy").map({True: "gpu", False: "cpu"}) if "xp" in df else "cpu"
    return df.assign(device=df["device"].fillna(guess) if "device" in df else guess)


def run_label(df: pd.DataFrame) -> str:
    """The commit(s) of a frame's rows, short ('262ba40'); a rewritten one says where it landed."""
    if "commit" not in df:
        return "unknown commit"
    out = []
    for c in pd.unique(df["commit"].dropna().astype(str)):
        base, dirty = c.removesuffix("+dirty"), c.endswith("+dirty")
        text = (base[:7] if re.fullmatch(r"[0-9a-f]{7,40}", base) else base) + ("+dirty" if dirty else "")
        out.append(f"{text} (rebased away; landed as {REWRITTEN[base]})" if base in REWRITTEN else text)
    return " / ".join(out) or "unknown commit"


def lineage(kind: str):
    """((CSV, selection), ...) and the configuration keys of a lineage; a CSV name stands for itself alone."""
    return KINDS.get(kind) or (((kind.removesuffix(".csv"), {}),), ())


# Lineages whose benchmark resumes a CSV with the rows its commit lacks (xlab.bench.dynamic_scale), so that one CSV
# holds several runs: each run (commit) of such a CSV is read as a CSV of the lineage of its own, the newest run of an
# arm and configuration superseding the older ones (never pooled with them: one comparison, one run)
RUNS_IN_ONE_CSV = {"dynamic_scale", "memory_cap"}


def frames(data: pathlib.Path, kind: str) -> list[pd.DataFrame]:
    """The lineage's CSVs under data, each selected, oldest first by their rows' dates (`order` 0, 1, ...); a CSV of a
    RUNS_IN_ONE_CSV lineage is one part per run."""
    found = []
    for i, (name, where) in enumerate(lineage(kind)[0]):
        df = read(data, name)
        if df is None or not len(df := select(df, where)):
            continue
        runs = ([g.assign(run=run_label(g)) for _, g in df.groupby("commit", sort=False)]
                if kind in RUNS_IN_ONE_CSV and "commit" in df else [df])
        found += [((str(g["date"].max()) if "date" in g else "", i), g) for g in runs]
    return [df.assign(order=i) for i, (_, df) in enumerate(sorted(found, key=lambda f: f[0]))]


def fingerprint(data: pathlib.Path) -> tuple:
    """The folder and the bytes of every CSV under it (a second run's too): what every reading of it follows from."""
    data = pathlib.Path(data)
    h = hashlib.blake2b(digest_size=20)
    for path in sorted(data.rglob("*.csv")):
        h.update(path.relative_to(data).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return str(data.resolve()), h.digest()


def lineage_fingerprint(data: pathlib.Path, kind: str) -> tuple:
    """The bytes of the lineage's CSVs under data (None for one that is not there): what frames(data, kind) reads."""
    out = []
    for name, _ in lineage(kind)[0]:
        try:
            raw = (pathlib.Path(data) / f"{name}.csv").read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raw = None
        out.append((name, None if raw is None else hashlib.blake2b(raw, digest_size=20).digest()))
    return tuple(out)


def select(df: pd.DataFrame, where: dict) -> pd.DataFrame:
    """The rows whose columns have these values (a tuple: any of them); none when a column is missing."""
    if not where:
        return df
    if any(col not in df for col in where):
        return df.iloc[:0]
    keep = np.ones(len(df), dtype=bool)              # one mask, one take (a take per column costs as much as all)
    for col, value in where.items():
        keep &= (df[col].isin(value) if isinstance(value, tuple) else df[col] == value).to_numpy(dtype=bool)
    return df[keep]


def day_range(dates) -> str:
    """'2026-11-30', '2026-11-30 to 2026-12-01' or 'unknown date': the days of these timestamps."""
    days = sorted({str(d)[:10] for d in dates})
    return (days[0] if len(days) == 1 else f"{days[0]} to {days[-1]}") if days else "unknown date"


def arm_column(df: pd.DataFrame) -> str | None:
    return next((c for c in ARM_COLUMNS if c in df), None)


def split(data: pathlib.Path, kind: str) -> tuple[pd.DataFrame | None, pd.DataFrame | None]:
    """(current, history): the rows of the newest CSV per (arm, configuration), and the rows it supersedes."""
    parts = frames(data, kind)
    if not parts:
        return None, None
    df = pd.concat(parts, ignore_index=True)
    keys = [k for k in lineage(kind)[1] if k in df] + [c for c in [arm_column(df)] if c]
    if not keys:
        return df[df["order"] == df["order"].max()], df[df["order"] < df["order"].max()]
    newest = df.groupby(keys, dropna=False)["order"].transform("max")
    return df[df["order"] == newest].reset_index(drop=True), df[df["order"] < newest].reset_index(drop=True)


def current(data: pathlib.Path, kind: str) -> pd.DataFrame | None:
    """The rows a figure or headline shows: the newest of the lineage for each arm and configuration."""
    return split(data, kind)[0]


def where(df: pd.DataFrame) -> str:
    """'NVIDIA H200, 2026-11-30' (or 'a CPU, no GPU, ...') from the provenance columns."""
    gpus = [g for g in pd.unique(df.get("gpu", pd.Series(dtype=str)).dropna().astype(str))]
    gpu = " / ".join("CPU, no GPU" if g.startswith("none") else g for g in gpus) or "unknown machine"
    return f"{gpu}, {day_range(df.get('date', pd.Series(dtype=str)).dropna())}"


def sources(df: pd.DataFrame) -> str:
    """'alloc_hit_sweep.csv at 262ba40 (cupy_pool, xpool); ...': each CSV of the rows, the commits of those rows (not
    every commit of the CSV: one CSV can hold several runs), its arms."""
    if "csv" not in df:
        return "unknown source"
    col, parts = arm_column(df), []
    groups = list(df.groupby(["order", "csv"], sort=True)) if "order" in df else list(df.groupby("csv"))
    for key, g in reversed(groups):
        name = key[-1] if isinstance(key, tuple) else key
        arms = f" ({', '.join(shared.ordered(g[col].unique()))})" if col and len(groups) > 1 else ""
        parts.append(f"`{name}` at {run_label(g) if 'commit' in g else g['run'].iloc[0]}{arms}")
    return "; ".join(parts)


# --- the benchmark a CSV is a run of: "the newest CSV of its kind" is checked over every CSV of the benchmark
def benchmark(df: pd.DataFrame, name: str) -> str:
    """What a CSV is a run of: its `experiment` ('experiment ddp'), else its `bench` ('bench alloc'), else its own name
    (a CSV whose rows do not say is a benchmark of its own)."""
    for col in ("experiment", "bench"):
        if col in df and df[col].notna().any():
            return f"{col} {'/'.join(sorted(pd.unique(df[col].dropna().astype(str))))}"
    return name.removesuffix(".csv")


def every_csv(data: pathlib.Path) -> dict[str, pd.DataFrame]:
    """{name: rows} of every CSV under data (a second run's folders left out: SECOND_RUN), as `read` gives them."""
    data = pathlib.Path(data)
    return {n: read(data, n) for n in sorted(p.relative_to(data).with_suffix("").as_posix() for p in data.rglob("*.csv")
                                             if SECOND_RUN not in p.relative_to(data).parts[:-1])}


def of_kind(data: pathlib.Path, kind: str, csvs: dict | None = None) -> dict[str, pd.DataFrame]:
    """{name: rows} of every CSV under data that is a run of the benchmark of lineage `kind` (its CSVs' `benchmark`),
    in the lineage or not, each with the lineage's own selection (its first CSV's) applied."""
    csvs = every_csv(data) if csvs is None else csvs
    members = [name for name, _ in lineage(kind)[0]]
    kinds = {benchmark(csvs[n], n) for n in members if csvs.get(n) is not None}
    base = lineage(kind)[0][0][1]
    return {n: select(df, {k: v for k, v in base.items() if k != "allocator"}) for n, df in csvs.items()
            if df is not None and benchmark(df, n) in kinds}


def newest_date(df: pd.DataFrame) -> str:
    """The latest timestamp of these rows ('' where the CSV has none)."""
    return str(df["date"].dropna().astype(str).max()) if "date" in df and df["date"].notna().any() else ""


def same_configuration(a: pd.DataFrame, b: pd.DataFrame) -> bool:
    """Whether two sets of rows ran one configuration: every CONFIG column both have shares a value."""
    for col in CONFIG:
        if col in a and col in b and a[col].notna().any() and b[col].notna().any():
            if not set(a[col].dropna().astype(str)) & set(b[col].dropna().astype(str)):
                return False
    return True


def one_run(df: pd.DataFrame, arms) -> pd.DataFrame:
    """The rows of the newest CSV among `df`'s that holds every one of `arms` (a comparison within one run): `df`'s
    rows of that CSV alone; `df` itself when no CSV holds them all."""
    col = arm_column(df)
    if col is None or "csv" not in df:
        return df
    holding = [c for c, g in df.groupby("csv", sort=False) if set(arms) <= set(g[col])]
    if not holding:
        return df
    newest = max(holding, key=lambda c: (df.loc[df["csv"] == c, "order"].max() if "order" in df else 0,
                                         newest_date(df[df["csv"] == c])))
    return df[df["csv"] == newest]
