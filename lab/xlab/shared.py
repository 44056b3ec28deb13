"""What both floors of the lab share, and nothing else: the instruments (benchmarks, experiments, replays) write
data/*.csv with these names, the analysis (sources, targets, tables, plots, summaries, report) reads the CSVs with
them. The arms (ARMS: each arm's name, label, style and what it can do; the allocators behind the rows are
xlab.allocators'), the dynamic-shape benchmark's workloads (WORKLOADS: what each is; how it runs is
xlab.bench.dynamic's) and their scaled sizes (SCALED), trial counts, and what bounds a step. It imports nothing of
the lab.

    arm("xpool_k4_debug").label, arm("raw").color, parse(["raw", "xpool"])   # names are checked once, here
"""
from __future__ import annotations

import dataclasses
import math
import re

from xpool.settings import DEFAULTS as XPOOL_DEFAULTS, FRONTEND_SCHEMES

KIB, MIB = 1 << 10, 1 << 20

# xpool.MemoryPool's default scheme: the `xpool` arm names it, so $XPOOL_SCHEME cannot move the arm
DEFAULT_SCHEME = XPOOL_DEFAULTS["scheme"]
# the scheme of the pool xpool.enable_torch() makes: the default a PyTorch program gets
TORCH_DEFAULT_SCHEME = FRONTEND_SCHEMES["torch"]

# Note [One name per allocator]
# Every table, sentence and figure legend names an allocator by its arm's label here, and nothing else: the product's
# two defaults by their front end (FRONT_END_NAMES: what xpool.install() gives a CuPy program, what
# xpool.enable_torch() gives a PyTorch one; `label(arm, framework)`), every peer by its own maker's name (ARMS). No
# peer is called "default". A row that measured an earlier xpool than the product as it ships says so after the name
# (`row_labels`: " · " and a qualifier): a release rule decision 0001 retired (its CSV's `release_on_miss`), or a run
# before the freeze (rows dated before FREEZE_DAY that name no rule: xpool as at or before 5bcaad4, the tag
# record-2026-12-05, whose release rule of the day the CSV does not say).
FRONT_END_NAMES = {"cupy": "xpool (CuPy)", "torch": "xpool (PyTorch)"}
PRODUCT_RULE = "never"       # each scheme's one release rule (docs/decisions/0001-one-release-rule-per-scheme.md)
FREEZE_DAY = "2026-12-05"    # decision 0001's day: xpool rows dated before it, naming no rule, predate the product
RETIRED = "release rule {}, retired by decision 0001"
SHIPPED = "the product as it ships"     # a workload's rows of an arm otherwise of an earlier xpool (row_labels)
BEFORE_FREEZE = "before the freeze"


# --- the arms
# Note [The arms table]
# Each row of ARMS is one arm: its name; how to make it (`make`: the name of an Allocator class of xlab.allocators,
# xlab.allocators.allocator_class(name) the class; or None for an arm that is not
# installed into CuPy: a framework's own allocator measured in its own process, a CPU replay's model, a piece of a
# benchmark); its label and style in every figure and table; and what it can do:
# - exact: counts device mallocs and peaks exactly and for free, so the timed run itself gives the counts;
# - device_calls_when_warm: calls cudaMalloc/cudaFree (or their stream-ordered forms) on requests a warm cache would
#   serve: threads-mode training fences collectives for those only (Note [The fence] in xlab/experiments/train.py);
# - can_capture: a `_graph` variant exists, whose private pools make no device call once warm;
# - framework: whose requests it serves (cupy, torch, replay, bench, gil, numpy).
# Families resolve from the rows: xpool_k<N> (scheme seed, N classes per doubling), <xpool arm>_debug (debug mode:
# poison and canaries), <pool>_graph (each training step's forward and backward captured once as a CUDA graph over
# a private pool of the same kind and replayed every step: tapegpt.graph.CapturedStep). CSVs written before an arm
# was renamed are read through `canonical` (LEGACY).
# Counters are per device, None where an allocator cannot count exactly:
# - raw: the counting variant (install(counting=True)) wraps CuPy's _malloc so each block's malloc and free is seen
#   (requested = reserved: there is no cache);
# - cupy_pool: device mallocs and live requested bytes from a CuPy MemoryHook, entered per thread only while
#   counting (hooks cost time); reserved bytes from total_bytes() after every step (it only grows between
#   free_all_blocks calls, so the last sample is the peak);
# - xpool arms: the pool's own exact counters; cupy_torch, torch: PyTorch's (torch.cuda.memory_stats);
# - _graph arms: the private pools' device mallocs count with the arm's; their bytes are graph_pool_bytes;
# - the dynamic-shape benchmark's peers: Note [Dynamic-shape benchmark: device calls], above RmmPool.


@dataclasses.dataclass(frozen=True)
class Arm:
    """One arm: name, how to make it, label and style, what it can do (see the module docstring)."""

    name: str
    label: str
    color: str
    marker: str = "o"
    make: str | None = None            # the Allocator class of xlab.allocators that makes it (its name)
    kwargs: tuple = ()                  # (key, value) pairs passed to `make`
    framework: str = "cupy"
    exact: bool = False
    device_calls_when_warm: bool = False
    can_capture: bool = False
    graph: bool = False
    ls: str = "-"
    lw: float = 1.6
    hatch: str | None = None


def _xp(name, label, color, marker, lw=2.6, ls="-", **kw):
    return Arm(name, label, color, marker, "XPool", tuple(kw.items()), exact=True, can_capture=True, lw=lw, ls=ls)


def _legacy(name, label, color, marker, ls):
    """An arm of earlier CSV rows that no build of today makes (a release rule the product no longer has, measured
    at 5bcaad4: the tag record-2026-12-05 keeps that code): its label and style, so old rows stay readable."""
    return Arm(name, f"{label} (before the freeze, 5bcaad4)", color, marker, framework="legacy", ls=ls)


# The house order (before -> peers -> xpool -> the rest): figures and tables list arms in this order.
ARMS = (
    Arm("raw", "raw cudaMalloc (no pool)", "#7f7f7f", "X", "Raw", device_calls_when_warm=True),
    Arm("raw_held", "raw cudaMalloc, one small block held alive", "#bdbdbd", "P", "RawHeld", device_calls_when_warm=True, ls=":"),
    Arm("cupy_pool", "CuPy's MemoryPool", "#1f77b4", "o", "CupyPool", can_capture=True),
    Arm("cupy_async", "cudaMallocAsync (CuPy's MemoryAsyncPool)", "#6baed6", "s", "CupyAsync",
        device_calls_when_warm=True),
    Arm("rmm_pool", "RMM's pool", "#9edae5", "o", "RmmPool", exact=True),
    Arm("cupy_torch", "PyTorch's caching allocator, serving CuPy", "#17becf", "p", "CupyTorch", exact=True),
    Arm("torch", "PyTorch's caching allocator", "#7f7f7f", "p", "CupyTorch",
        framework="torch", exact=True),
    Arm("torch_expandable", "PyTorch's expandable segments", "#393b79", "P", "TorchExpandable",
        framework="torch", exact=True),
    Arm("cupy_torch_expandable", "PyTorch's expandable segments, serving CuPy",
        "#6b6ecf", "P", "TorchExpandable", exact=True),
    _xp("xpool", FRONT_END_NAMES["cupy"], "#d62728", "D", scheme=DEFAULT_SCHEME),
    _xp("xpool_segments", "xpool, scheme segments", "#d62728", "D", scheme="segments"),
    _xp("xpool_seed", "xpool, scheme seed (size classes, k = 1: powers of two)", "#8c564b", "h", lw=2.0, ls="-.",
        scheme="seed", classes_per_doubling=1),
    _xp("xpool_expandable", "xpool, scheme expandable",
        "#bcbd22", "*", scheme="expandable"),
    _legacy("xpool_expandable_bounded", "xpool, expandable, misses unmap over 1.05× the most requested",
            "#dbdb8d", "*", "--"),
    _legacy("xpool_expandable_growth", "xpool, expandable, misses at a new demand high unmap over 1.05× the most "
            "requested", "#8c8c00", "*", "-."),
    _legacy("xpool_expandable_until_churn", "xpool, expandable, misses unmap over 1.05× the most requested until "
            "they churn", "#5c5c00", "*", ":"),
    _legacy("xpool_expandable_peak", "xpool, expandable, peak misses unmap over 1.05× the most requested until they "
            "churn", "#a55194", "*", "-"),
    Arm("xpool_norelease", "xpool, scheme segments, nothing given back on a miss (the rule xpool (CuPy) ships with, "
        "replayed)", "#e377c2", "P", framework="legacy", ls=":"),
    _legacy("xpool_release_all", "xpool, every whole free segment given back on a miss (replayed)", "#ff9896", "d",
            "--"),
    _legacy("xpool_release_fresh", "xpool, segments given back on a miss however recently freed (replayed)",
            "#f7b6d2", "v", "--"),
    Arm("cupy_pool_model", "CuPy's MemoryPool (model, replayed)", "#1f77b4", "o", framework="replay", ls="--"),
    Arm("noop", "floor: Python allocator doing no work", "#000000", ".", "Noop", ls=":", lw=1.2),
    Arm("c_noop", "floor: C allocator doing no work", "#555555", ".", "CNoop", ls="--", lw=1.2),
    Arm("numpy", "NumPy (CPU smoke runs: measures nothing)", "#2ca02c", "o", "Host", framework="numpy", exact=True),
    # the pieces of one pair that xlab.bench.hit times in place
    Arm("xpool_core", "xpool's hooks without the stream lookup", "#ff7f0e", "^", framework="bench"),
    Arm("xpool_old_lookup", "xpool with CuPy's current-stream lookup", "#ffbb78", "v", framework="bench"),
    Arm("core_c", "xpool's pair in C alone", "#9467bd", "*", framework="bench"),
    Arm("lookup_c", "the stream lookup in C alone", "#c5b0d5", "*", framework="bench"),
    Arm("old_lookup_c", "CuPy's current-stream lookup in C alone", "#c49c94", "*", framework="bench"),
    # another build of xpool timed beside this one (xlab.bench.alloc --xpool-path; data/core_split_gpu.csv)
    Arm("xpool_before", "xpool (CuPy), the build before (--xpool-path)", "#ff9896", "d", framework="bench"),
    Arm("xpool_seed_before", "xpool, the build before (--xpool-path), seed scheme", "#c49c94", "d", framework="bench"),
    # the ops xlab.bench.gil runs on 1..N threads
    *(Arm(n, t, c, "o", framework="gil") for n, t, c in (
        ("python", "pure Python (holds the GIL)", "#000000"),
        ("launch", "empty kernel launch through CuPy (GIL released)", "#1f77b4"),
        ("launch_gil", "empty kernel launch by ctypes.PyDLL (GIL held)", "#d62728"),
        ("launch8", "8-argument kernel launch through CuPy (GIL released)", "#6baed6"),
        ("launch8_gil", "8-argument kernel launch by ctypes.PyDLL (GIL held)", "#ff9896"),
        ("add", "`x + x`, 1 element, CuPy (allocation + launch, GIL released)", "#2ca02c"),
        ("gemm", "16×16 GEMM by tapegpt.blas (allocation + cuBLAS call; GIL as tapegpt.launch decides)", "#9467bd"),
        ("gemm_gil", "cublasGemmEx alone by ctypes.PyDLL (GIL held)", "#8c564b"),
        ("matmul", "16×16 GEMM, cupy.matmul", "#e377c2"))),
)
_TABLE = {a.name: a for a in ARMS}
_K_COLORS = {1: "#8c564b", 2: "#ff7f0e", 4: "#e6550d", 8: "#fd8d3c"}
_FAMILY = re.compile(r"(?P<base>.+?)(?P<debug>_debug)?(?P<graph>_graph)?")
# Arm sets: each experiment's default arms
SETS = {
    "single": ("raw", "cupy_pool", "xpool", "xpool_seed"),
    "ddp": ("raw", "cupy_pool", "xpool", "xpool_seed"),
    "sweep": ("raw", "cupy_pool", "xpool"),
    "bench": ("raw", "raw_held", "cupy_pool", "cupy_async", "cupy_torch", "xpool", "xpool_seed", "noop", "c_noop"),
    "gate": ("raw", "cupy_pool", "xpool", "xpool_seed", "xpool_k4", "xpool_debug", "xpool_expandable",
             "xpool_expandable_debug"),   # raw first: the reference
    "varlen": ("xpool", "xpool_seed", "xpool_expandable", "cupy_pool"),
    "schemes": ("xpool", "xpool_seed", "xpool_expandable", "cupy_pool_model"),
    "host": ("xpool", "xpool_seed", "c_noop"),
    # the peers (+ xpool's schemes); PyTorch's expandable segments serve the CuPy workloads too, the one allocator
    # with pages mapped into reserved ranges before xpool's (Note [Dynamic-shape benchmark: device calls])
    "dynamic": ("cupy_pool", "cupy_async", "rmm_pool", "cupy_torch_expandable", "torch", "torch_expandable"),
}
# Names older CSVs used, by the CSV's `bench` column: (bench, old name) -> arm
LEGACY = {("alloc", "torch"): "cupy_torch", ("torch_interop", "native"): "torch"}


def arm(name: str) -> Arm:
    """The row of `name`, of ARMS or of a family (xpool_k<N>, _debug, _graph); ValueError if unknown."""
    if name in _TABLE:
        return _TABLE[name]
    m = _FAMILY.fullmatch(str(name))
    base, debug, graph = m["base"], bool(m["debug"]), bool(m["graph"])
    k = re.fullmatch(r"xpool_k(\d+)", base)
    if k:
        n = int(k[1])
        row = _xp(base, f"xpool, scheme seed, {n} class{'es' * (n > 1)} per doubling", _K_COLORS.get(n, "#fdae6b"), "^",
                  ls="--" if n > 1 else "-", scheme="seed", classes_per_doubling=n)
    elif base in _TABLE and (debug or graph):
        row = _TABLE[base]
    else:
        raise ValueError(f"unknown allocator {base if base not in _TABLE and (debug or graph) else name!r}; "
                         f"known: {', '.join(_TABLE)}; xpool_k<N> (the seed scheme, N classes per doubling); "
                         "an xpool arm + _debug; a pool + _graph")
    if debug:
        if row.make != "XPool":
            raise ValueError(f"allocator {name!r}: only xpool arms have a debug mode")
        row = dataclasses.replace(row, name=row.name + "_debug", label=row.label + ", debug mode (poison + canaries)",
                                  color="#9467bd", marker="v", ls="-.", lw=1.6,
                                  kwargs=row.kwargs + (("debug", "raise"),))
    if graph:
        if not row.can_capture:
            capturing = ", ".join(a.name + "_graph" for a in ARMS if a.can_capture)
            raise ValueError(f"allocator {name!r}: {row.name!r} cannot capture a CUDA graph (only pools can: "
                             f"{capturing}, ...)")
        row = dataclasses.replace(row, name=row.name + "_graph", label=row.label + ", step as a CUDA graph",
                                  graph=True, marker="s", ls="--", hatch="//")
    return row


def parse(names) -> tuple:
    """Names checked against the table (the command lines' and notebooks' one check), as a tuple."""
    names = (names,) if isinstance(names, str) else tuple(names)
    for n in names:
        arm(n)
    return names


def arg(name: str) -> str:
    """argparse's `type=` for an arm name: the error names the arm and the known ones."""
    import argparse
    try:
        return arm(name).name
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def ordered(names) -> list:
    """Arms in the table's order (families after their base), unknown names last, sorted."""
    names = list(dict.fromkeys(str(n) for n in names))
    order = {a.name: i for i, a in enumerate(ARMS)}

    def key(n):
        try:
            return (order.get(_FAMILY.fullmatch(n)["base"], order["xpool_seed"] + 0.5), n)
        except (TypeError, KeyError):
            return (len(ARMS), n)
    return sorted(names, key=key)


def label(name: str, framework: str | None = None) -> str:
    """The arm's one name (Note [One name per allocator]): a front end's default arm, run by that front end, is named
    for it ("xpool (PyTorch)"), the `xpool` arm (xpool.MemoryPool's default scheme, CuPy's) "xpool (CuPy)", every other
    arm its label in ARMS (the name itself for a name not in the table)."""
    if framework in FRONT_END_NAMES and str(name) == default_arm(framework):
        return FRONT_END_NAMES[framework]
    try:
        return arm(name).label
    except ValueError:
        return str(name)


def qualifiers(rows, name: str) -> list:
    """What an xpool arm's rows measured other than the product as it ships, in words (Note [One name per
    allocator]): each retired release rule the rows name, else "before the freeze" for rows dated before FREEZE_DAY;
    [] for rows of the product as it ships and for every other arm (`name`: the arm whose rows they are)."""
    name = str(name)
    base = _FAMILY.fullmatch(name)["base"] if name else ""
    if not name.startswith("xpool") or base not in _TABLE and not base.startswith("xpool_k") or (
            base in _TABLE and _TABLE[base].make != "XPool"):
        return []
    if "release_on_miss" in rows and rows["release_on_miss"].notna().any():
        return [RETIRED.format(r) for r in sorted(set(rows["release_on_miss"].dropna().astype(str)))
                if r != PRODUCT_RULE]
    dates = rows["date"].dropna().astype(str) if "date" in rows else []
    return [BEFORE_FREEZE] if len(dates) and max(dates)[:10] < FREEZE_DAY else []


def row_labels(df, col: str = "allocator", runs: bool = False) -> dict:
    """{arm: its label in a figure or table of these rows}: `label` (by the rows' front end where they are of one),
    then " · " and each qualifier of its rows, and with `runs`, where the rows hold several runs, the run of each arm
    (a figure that sets arms from different runs side by side names each run in place)."""
    several = runs and "run" in df and df["run"].nunique() > 1
    out = {}
    for a, g in df.groupby(col, sort=False):
        fw = g["framework"].dropna().astype(str).unique() if "framework" in g else []
        said = qualifiers(g, a)
        if said and "workload" in g:       # an arm whose rows of some workloads are the product's: those named
            shipped = [w for w, rows in g.groupby("workload", sort=False) if not qualifiers(rows, a)]
            if shipped:
                said[-1] += f" ({', '.join(map(str, shipped))}: {SHIPPED})"
        if several:
            said.append("run " + "/".join(sorted(set(g["run"].astype(str)))))
        out[str(a)] = " · ".join([label(a, fw[0] if len(fw) == 1 else None), *said])
    return out


def canonical(df):
    """A CSV's frame with the arm names of today (LEGACY), by its `bench` column; the same frame if none apply."""
    col = "allocator" if "allocator" in df else "arm" if "arm" in df else None
    if col is None or "bench" not in df:
        return df
    renames = {old: new for (bench, old), new in LEGACY.items() if (df["bench"] == bench).any()}
    return df.assign(**{col: df[col].replace(renames)}) if renames else df


def by_scheme(df):
    """The torch interop rows with the arm `xpool` (the pool enable_torch() made) named by the scheme it ran,
    where the rows say it (`scheme`): xpool_expandable, xpool_segments; older CSVs unchanged."""
    if "scheme" not in df:
        return df
    return df.assign(arm=[f"xpool_{s}" if a == "xpool" and isinstance(s, str) and s else a
                          for a, s in zip(df["arm"], df["scheme"])])


# --- the front ends' defaults
def default_arm(framework: str) -> str:
    """The arm a user of `framework`'s front end gets from xpool by default: the scheme the front end's pool takes
    (xpool.settings: FRONTEND_SCHEMES where it has its own, else DEFAULTS), xpool_segments for CuPy and
    xpool_expandable for PyTorch."""
    return f"xpool_{FRONTEND_SCHEMES.get(framework, XPOOL_DEFAULTS['scheme'])}"


# --- the workloads
@dataclasses.dataclass(frozen=True)
class WorkloadKind:
    """What the analysis knows of a workload of the dynamic-shape benchmark: its front end ("cupy" or "torch": which
    arms run it), whether its shapes change every step, whether it is held out (how it runs:
    xlab.bench.dynamic.RUNS)."""
    framework: str
    dynamic: bool
    held_out: bool = False   # not in the benchmark's default set: programs no release rule was chosen on


# The held-out workloads (`--workloads torch_varlen_b32,...`, data/dynamic_heldout.csv): PyTorch programs of other
# batches, lengths and image sizes than those the release rules were replayed on and chosen by
# (docs/decisions/0001-one-release-rule-per-scheme.md), so a default is also judged on programs it was not fitted to.
WORKLOADS = {
    "cupy_mix": WorkloadKind("cupy", True),
    "cupy_image": WorkloadKind("cupy", True),
    "cupy_fill": WorkloadKind("cupy", True),
    "gpt_varlen": WorkloadKind("cupy", True),
    "gpt_b32": WorkloadKind("cupy", False),
    "gpt_b4": WorkloadKind("cupy", False),
    "torch_varlen": WorkloadKind("torch", True),
    "torch_fixed": WorkloadKind("torch", False),
    "resnet_varres": WorkloadKind("torch", True),
    "resnet_fixed": WorkloadKind("torch", False),
    "torch_varlen_b32": WorkloadKind("torch", True, held_out=True),
    "torch_fixed_b32": WorkloadKind("torch", False, held_out=True),
    "resnet_varres_b64": WorkloadKind("torch", True, held_out=True),
}
# the dynamic-shape benchmark's peers (SETS["dynamic"]), and those of each front end
DYNAMIC_PEERS = SETS["dynamic"]
DYNAMIC_PEERS_BY_FRAMEWORK = {f: tuple(a for a in DYNAMIC_PEERS if arm(a).framework == f) for f in ("cupy", "torch")}


# --- the scaled workloads (xlab.bench.dynamic_scale)
GIB = 1 << 30
AT_LEAST = 30 * GIB          # issue #46: a scaled workload's peak requested bytes


@dataclasses.dataclass(frozen=True)
class Scaled:
    """A dynamic workload at scale: its size (batch; cupy_mix: its arrays, Note [cupy_mix at scale]) `factor` times
    the benchmark's, `warmup` steps, then `steps` timed ones (Note [Scaled runs])."""
    factor: int
    warmup: int
    steps: int


# Note [Scaled workloads]
# Each dynamic workload at a size whose peak requested is 33-40 GiB (issue #46: at least 30; the benchmark's peak at
# 0.18-2.4 GiB, where a 2 MiB page is ~1% of the demand), one constant each in SCALED, the factor over the benchmark's
# size; lengths, image sides and seeds stay the benchmark's. The bytes come from the committed rows
# (xlab.bench.dynamic_scale.estimated_peak recomputes them from data/, tests/lab/test_dynamic_scale.py checks them):
# - A model's peak requested grows linearly in what its largest step holds (`units`). The line through each model's
#   committed sizes: gpt (gpt_b4, gpt_varlen, gpt_b32, all peaking at T 256) 0.247 GiB + 557,256 B per token, the
#   three on it; the language model (torch_fixed, torch_varlen and the held-out b32 rows) 0.389 GiB + 134,527 B per
#   token, all four within 0.04%; the ResNet (32 images of 224 px, 64 of 160 px) 0.210 GiB + 250 B per pixel. The
#   intercept is what does not grow (parameters, gradients, optimizer state). So gpt_varlen at batch 256 (x16)
#   peaks at 34.3 GiB, torch_varlen at 512 (x32) at 33.2 GiB, resnet_varres at 2816 (x88) at 33.1 GiB.
# - cupy_mix's results outlive their step, so its demand keeps setting new highs (the benchmark's rows: last at
#   step 12-151 of 230). Over the 96 steps a scaled run takes, the five realizations' recorded traces peak at
#   160-188 MiB, so x216 (= 2^3 x 3^3: FFT lengths cuFFT is fast at) peaks at 33.8-39.6 GiB.
# - cupy_fill's requests are its plan (dynamic_workloads.fill_plan: no allocator changes them), so its peak is known
#   without a run: over 96 steps, 555-609 MiB for seeds 0-4 at the benchmark's size, and x64 (arrays of 1 MiB-1 GiB)
#   34.7-38.1 GiB; ~3.3 GB written a step, ~2 ms on an H200.
# A scaled step stays within ~0.3 s on an H200 (from FLOPs and bytes, to be measured): gpt at 256 x 256 tokens is
# ~9 TFLOP in FP32 (tapegpt uses no TF32), ~0.2 s; the language model at 512 x 512 tokens ~35 TFLOP in bf16, ~0.1 s;
# the ResNet at 2816 images of 224 px ~31 TFLOP in bf16 and ~0.2 TB through its memory-bound layers, ~0.2-0.3 s at
# its largest side, 0.64x that on average; cupy_mix ~10-20 ms (a radix sort of at most 906M floats, a matmul of at
# most 0.25 TFLOP), its first step (every op at its largest, every FFT planned) ~0.1-0.2 s.
SCALED = {
    "cupy_mix": Scaled(216, 32, 64),
    "gpt_varlen": Scaled(16, 3, 5),
    "torch_varlen": Scaled(32, 3, 5),
    "resnet_varres": Scaled(88, 3, 5),
    "cupy_fill": Scaled(64, 32, 64),
}
SCALE_TRIALS = 5         # the scaled runs' trials
INTERVAL_TRIALS = 5      # fewer trials than this: no interval is printed, the values are (a median of 3 is no interval)


# --- what bounds a step (xlab.experiments.train's rows, the report)
HOST_BOUND_UTIL = 80.0           # % GPU busy below which the GPU waited for the host: the step is host-bound


def step_bound(gpu_util: float, host_ms: float, ms_per_step: float) -> str:
    """What bounds a step: "gpu" when NVML saw the GPU busy at least HOST_BOUND_UTIL %, else "host"; without NVML
    (thread CPU time counts a synchronising call's spin), "host" when the thread was busy 80% of the time; "" else."""
    if gpu_util is not None and math.isfinite(gpu_util):
        return "gpu" if gpu_util >= HOST_BOUND_UTIL else "host"
    if math.isfinite(host_ms) and math.isfinite(ms_per_step) and ms_per_step > 0:
        return "host" if host_ms >= 0.8 * ms_per_step else "gpu"
    return ""
