"""The issues' targets, and the numbers the report and README quote, as one table (TARGETS), judged by one rule;
the summary at the head of the report (SUMMARY) picks its rows from it.

A row names a lineage of CSVs (xlab.sources.KINDS, or one CSV), a selection (`where`), a metric column, the arm(s),
an optional reference (`ref`: the arm's rows with these columns replaced; the value is then the ratio of the two
arms' medians over their paired trials; several arms there: the best of them by median, the fastest peer, say), the
arms it is set beside (`along`: measured in the same CSV, so that a comparison stays within one run), the worst (or
best, or each) group `over` some columns, and a goal with its direction. `measure` takes the median over trials with
its 95% bootstrap interval from the newest CSV of the lineage that has the rows (and its reference's, and `along`'s);
the verdict is intervals.judge's, the report's rule. A row without a goal is a number for the report; the same row
on older CSVs is its history. `stale` says which newer CSV of the same benchmark a row fails to read (none may).

One direction for every ratio between two allocators: speed-up = the other's time / xpool's time (equivalently
xpool's tokens/s over the other's); above 1, xpool is faster. A row with `flip` takes a time metric the other way up
(the reference's median over the arm's). Memory is peak reserved / peak requested, lower is better; between two
allocators, the other's over xpool's (above 1: xpool holds less).

    T(key, text, kind, metric, arm, goal=..., higher=..., where={...}, ref={...}, over=(...), along=(...), ...)

To add a target: one `T(...)` line (goal and direction set); to quote a number in the report: a row without a goal,
its key in report.md's template ({key}: the value [interval]; {key.src}: its CSV and commit).

Issue #46's rows read the scaled runs (xlab.bench.dynamic_scale: SCALE, CAP), each only where its rows exist; they
name the trials their goal speaks of (`trials`): measured on fewer, a run under way, the verdict says how many, and
under INTERVAL_TRIALS the value has no interval. Beside a median, two statistics count: `all`, the share of rows that
pass (k of n), and `share`, the share of paired trials whose ratio to the reference is at least 1 (k of n).
"""
from __future__ import annotations

import dataclasses
import math
import pathlib

import pandas as pd

from . import intervals as iv, sources
from . import shared
from .shared import label
from .shared import (DEFAULT_SCHEME, FRONT_END_NAMES, INTERVAL_TRIALS, PRODUCT_RULE, SCALE_TRIALS, SCALED, SETS,
                     TORCH_DEFAULT_SCHEME,
                     WORKLOADS)

# The product's schemes, and their one release rule (docs/decisions/0001-one-release-rule-per-scheme.md: a miss
# gives nothing back). The dynamic benchmark's arm of a scheme as the product has it is xpool_<scheme>: xpool_expandable
# ran that rule; xpool_segments ran segments' rule of its day (its rows' `release_on_miss` say which: POOL_COLUMNS).
PRODUCT_SCHEMES = ("segments", "seed", "expandable")
POOL_COLUMNS = {"scheme": "scheme", "release_on_miss": "release rule"}    # what a CSV may say of the pool it ran


@dataclasses.dataclass(frozen=True)
class T:
    """One measured quantity; a target when it has a goal (see the module docstring)."""

    key: str
    text: str
    kind: str
    metric: str
    arm: str | tuple | None = None        # None: every arm
    goal: float | dict | None = None      # a dict: the median of the rows with these columns replaced
    higher: bool = True
    where: dict = dataclasses.field(default_factory=dict)
    ref: dict | None = None
    over: tuple = ()
    pick: str = "worst"                   # worst, best or each group of `over`
    stat: str = "median"                  # median (with interval), max or min (exact), all (k of n pass), share
    # (with `ref`: k of n paired trials whose ratio to the reference, the way `flip` takes it, is at least 1)
    fmt: str = "{:.2f}"
    unit: str = ""
    scale: float = 1.0
    exact: bool = False
    bound: str | None = None              # what bounds the steps, when the rows do not say
    along: tuple = ()                     # arms that must be in the same CSV (same selection): one run
    flip: bool = False                    # with `ref`: the reference's median over the arm's (a time as a speed-up)
    trials: int = 0                       # the trials its goal speaks of: measured on fewer, the verdict says so


X, XS, XG, CP = "xpool", "xpool_seed", "xpool_graph", "cupy_pool"
BOTH = ((X, ""), (XS, "_seed"))            # rows measured for the default scheme and for the seed scheme
DYN, XD, PEERS = "dynamic_shapes", f"xpool_{DEFAULT_SCHEME}", SETS["dynamic"]   # XD: CuPy's default arm
DYN_HELD_OUT = "dynamic_heldout"          # the CSV of xlab.bench.dynamic's held-out workloads
XDT = f"xpool_{TORCH_DEFAULT_SCHEME}"     # a PyTorch workload's default arm: the pool xpool.enable_torch() makes
PRODUCT_ARMS = tuple(f"xpool_{s}" for s in PRODUCT_SCHEMES)
# the dynamic rows' two defaults: (key suffix, label, arm, framework of the workloads)
DEFAULT_ARMS = (("", FRONT_END_NAMES["cupy"], XD, "cupy"), ("_torch", FRONT_END_NAMES["torch"], XDT, "torch"))
MS, PCT = dict(fmt="{:.1f}", unit=" ms"), dict(fmt="{:.0f}", unit="%")
W2T, W2P = dict(mode="threads", world=2), dict(mode="processes", world=2)
SPEEDUP = dict(unit="×", flip=True)       # a time metric against a reference: the reference's time over the arm's
HELD = dict(metric="reserved_over_requested", fmt="{:.3f}", exact=True, bound="—")
# issue #46: the scaled runs' lineages, the cap its targets judge, its "in at least 4 of 5 trials", and its words
SCALE, CAP = "dynamic_scale", "memory_cap"
CAP_JUDGED, NO_MORE_IN = 1.10, 4
AT_SCALE = dict(trials=SCALE_TRIALS)
AT_SCALE_TAG = "#46, at the scale users run them"
# the dynamic rows' device calls judged per trial: the share of trials with none in steady state (sources.prepare)
ZERO = "zero_steady_calls"
ZERO_CALLS = dict(stat="all", exact=True, bound="—")
# a metric that passes or not (stat "all"): what its value counts, and its goal of every row
PASSING = {"passed": ("checks passing", "all pass"), "completed": ("trials finished", "every trial finishes"),
           ZERO: ("trials with no device call in steady state", "every trial")}
FEW = "no interval"                       # a verdict on several trials, fewer than INTERVAL_TRIALS: a median alone
PENDING = "pending"                       # a goal over N trials measured on fewer: "pending (k of N)"


def _dynamic() -> list:
    """#22's targets per workload of xlab.bench.dynamic: xpool's default for the workload's front end (a PyTorch
    workload's: the pool enable_torch() makes), its best scheme for memory, its device calls in steady state, its
    speed-up over the fastest peer and, on PyTorch's workloads, PyTorch's expandable segments' memory over its own."""
    rows = []
    for w, spec in WORKLOADS.items():      # a held-out workload: its own CSV, and "held out" in its targets' names
        kind, w_ = (DYN_HELD_OUT, f"{w} (held out)") if spec.held_out else (DYN, w)
        xd, on = XDT if spec.framework == "torch" else XD, dict(where=dict(workload=w))
        name = FRONT_END_NAMES[spec.framework]
        who = (("", name, dict(arm=xd)), ("_best", "the best of xpool's schemes: {at}",
                                         dict(arm=PRODUCT_ARMS, over=("allocator",), pick="best")))
        if spec.dynamic:
            rows += [T(f"dyn_ror{k}_{w}", f"#22, {w_}: peak reserved / peak requested ≤ 1.05 ({n})", kind, goal=1.05,
                       higher=False, **arms, **on, **HELD) for k, n, arms in who]
            rows.append(T(f"dyn_calls_{w}", f"#22, {w_}: {name}: no device call in steady state, every trial", kind,
                          ZERO, xd, 1.0, **ZERO_CALLS, **on))
        rows.append(T(f"dyn_ms_{w}", f"#22, {w_}: speed-up over the fastest peer ({{ref}}) ≥ 1 ({name}; ms per step, "
                      "paired by trial)", kind, "ms_per_step", xd, 1.0, ref=dict(allocator=PEERS), fmt="{:.3f}",
                      **SPEEDUP, **on))
        if spec.framework == "torch" and spec.dynamic:
            rows += [T(f"dyn_vs_expandable{k}_{w}", f"#22, {w_}: PyTorch's expandable segments' peak reserved / peak "
                       f"requested over xpool's ≥ 1 ({n}; paired by trial)", kind, goal=1.0,
                       ref=dict(allocator="torch_expandable"), unit="×", **arms, **on,
                       **{**HELD, "flip": True}) for k, n, arms in who]
    return rows


def _dynamic_summary() -> list:
    """Per front end, over its workloads of changing shapes: the default's worst memory held, PyTorch's expandable
    segments' memory over the default's (the worst workload), and its worst speed-up over the fastest peer."""
    rows = []
    for k, label, arm, f in DEFAULT_ARMS:
        rows += [
            _held_worst(k, label, arm, f),
            T(f"dyn_speed_worst{k}", f"#22: {label}: speed-up over the fastest peer ≥ 1, every workload "
              "(worst: {at}; ms per step, paired by trial)", DYN, "ms_per_step", arm, 1.0, where=dict(framework=f),
              ref=dict(allocator=PEERS), over=("workload",), fmt="{:.3f}", **SPEEDUP),
            T(f"dyn_calls_worst{k}", f"#22: {label}: no device call in steady state, every trial of every workload, "
              "fixed shapes or not (worst: {at})", DYN, ZERO, arm, 1.0, where=dict(framework=f), over=("workload",),
              **ZERO_CALLS)]
    return rows + _held_vs_peers()


def _held_worst(k, label, arm, f, kind=DYN, key="dyn", tag="#22, shapes that change every step", **extra) -> T:
    """The default of front end `f`'s worst memory held over its workloads of changing shapes (`kind`'s rows)."""
    return T(f"{key}_worst{k}", f"{tag}: {label}: peak reserved / peak requested ≤ 1.05, every "
             "workload (worst: {at})", kind, arm=arm, goal=1.05, higher=False, where=dict(dynamic=True, framework=f),
             over=("workload",), **HELD, **extra)


def _held_vs_peers(kind=DYN, key="dyn", tag="#22, shapes that change every step", **extra) -> list:
    """A peer's memory held over the default's, worst workload of changing shapes: CuPy's pool, PyTorch's caching allocator
    and its expandable segments (`kind`'s rows)."""
    rows = []
    for name, f, peer, who in (("cupy", "cupy", CP, "CuPy's MemoryPool's"),
                               ("torch", "torch", "torch", "PyTorch's caching allocator's"),
                               ("expandable", "torch", "torch_expandable", "PyTorch's expandable segments'")):
        arm = XD if f == "cupy" else XDT
        rows.append(T(f"{key}_vs_{name}_worst", f"{tag}: {who} peak reserved / peak requested over "
                      f"{FRONT_END_NAMES[f]}'s ≥ 1, every workload (worst: {{at}}; paired by "
                      "trial)", kind, arm=arm, goal=1.0, where=dict(dynamic=True, framework=f),
                      ref=dict(allocator=peer), over=("workload",), unit="×", **{**HELD, "flip": True}, **extra))
    return rows


def _held_each(kind=DYN, key="dyn", **extra) -> list:
    """Numbers the report quotes: each default's memory held per workload of changing shapes, and PyTorch's
    expandable segments' (`kind`'s rows)."""
    return [*(T(f"{key}_h_ror{k}", f"{label}: peak reserved / requested by dynamic workload", kind,
                arm=arm, where=dict(dynamic=True, framework=f), over=("workload",), pick="each", **HELD, **extra)
              for k, label, arm, f in DEFAULT_ARMS),
            T(f"{key}_h_expandable", "the same, PyTorch's expandable segments", kind, arm="torch_expandable",
              where=dict(dynamic=True), over=("workload",), pick="each", **HELD, **extra)]


def _at_scale() -> list:
    """#46's targets per scaled workload, for xpool's default of its front end: on the scaled rows, memory held
    (≤ 1.05), no more than the best peer in at least NO_MORE_IN of the trials, no device call in steady state (the
    CSV counts unmaps with mallocs, frees and maps: a count of 0 is no unmap) and the speed-up over the fastest peer;
    under the CAP_JUDGED cap, every trial finished and no peer finishing more."""
    rows = []
    for w in SCALED:
        xd, fe = (XDT, "PyTorch") if WORKLOADS[w].framework == "torch" else (XD, "CuPy")
        name, on = FRONT_END_NAMES[WORKLOADS[w].framework], dict(where=dict(workload=w), **AT_SCALE)
        under = dict(where=dict(workload=w, cap_over_peak_requested=CAP_JUDGED), stat="all", exact=True, bound="—",
                     **AT_SCALE)
        rows += [
            T(f"scale_ror_{w}", f"#46, {w} at scale: {name}: peak reserved / peak requested ≤ 1.05", SCALE, arm=xd,
              goal=1.05, higher=False, **HELD, **on),
            T(f"scale_no_more_{w}", f"#46, {w} at scale: {name} reserves no more than the best peer ({{ref}}) in at "
              f"least {NO_MORE_IN} of {SCALE_TRIALS} trials (peak reserved bytes, paired by trial)", SCALE,
              "peak_reserved_bytes", xd, NO_MORE_IN / SCALE_TRIALS, ref=dict(allocator=PEERS), stat="share", flip=True,
              bound="—", **on),
            T(f"scale_calls_{w}", f"#46, {w} at scale: {name}: no unmap in steady state, no device call in any trial "
              "(the CSV counts cudaMalloc, cudaFree, map and unmap together)", SCALE, ZERO, xd, 1.0, **ZERO_CALLS,
              **on),
            T(f"scale_ms_{w}", f"#46, {w} at scale: {name}: speed-up over the fastest peer ({{ref}}) ≥ 1 or within "
              "noise (ms per step, paired by trial)", SCALE, "ms_per_step", xd, 1.0, ref=dict(allocator=PEERS),
              fmt="{:.3f}", **SPEEDUP, **on),
            T(f"cap_done_{w}", f"#46, {w} under a {CAP_JUDGED:.2f}× cap: {name} finishes every trial", CAP,
              "completed", xd, 1.0, **under),
            T(f"cap_peers_{w}", f"#46, {w} under a {CAP_JUDGED:.2f}× cap: no peer finishes more trials than {name}; "
              "the peer that finished most", CAP, "completed", xd, dict(allocator=PEERS), **under)]
    return rows


def _at_scale_summary() -> list:
    """Per front end, over its scaled workloads: the default's worst memory held and a peer's memory held over the
    default's (the #22 rows on the scaled rows), and the default finishing every trial under the CAP_JUDGED cap."""
    rows = []
    for k, label, arm, f in DEFAULT_ARMS:
        rows += [_held_worst(k, label, arm, f, SCALE, "scale", AT_SCALE_TAG, **AT_SCALE),
                 T(f"cap_worst{k}", f"#46, under a {CAP_JUDGED:.2f}× cap: {label} finishes every "
                   "trial, every workload (worst: {at})", CAP, "completed", arm, 1.0,
                   where=dict(framework=f, cap_over_peak_requested=CAP_JUDGED), over=("workload",), stat="all",
                   exact=True, bound="—", **AT_SCALE),
                 T(f"scale_calls_worst{k}", f"{AT_SCALE_TAG}: {label}: no device call in steady state, every trial "
                   "of every workload (worst: {at})", SCALE, ZERO, arm, 1.0, where=dict(framework=f),
                   over=("workload",), **ZERO_CALLS, **AT_SCALE),
                 T(f"scale_speed_worst{k}", f"{AT_SCALE_TAG}: {label}: speed-up over the fastest peer ≥ 1, every "
                   "workload (worst: {at}; ms per step, paired by trial)", SCALE, "ms_per_step", arm, 1.0,
                   where=dict(framework=f), ref=dict(allocator=PEERS), over=("workload",), fmt="{:.3f}", **SPEEDUP,
                   **AT_SCALE)]
    return rows + _held_vs_peers(SCALE, "scale", AT_SCALE_TAG, **AT_SCALE)


TARGETS = (
    # the allocator microbenchmark, through CuPy (cached arms: the newest sweep of the hit path)
    *(T(f"us_vs_cupy{s}", f"{label(a)}'s speed-up over CuPy's MemoryPool ≥ 1/1.05 (at most 5% slower), every size (median of "
        "per-trial ratios; worst: {at})", "alloc_size", "ratio_vs_cupy_pool", a, 1 / 1.05, over=("size_bytes",),
        unit="×", bound="host") for a, s in BOTH),
    T("hit_worst", "#14: xpool (CuPy)'s alloc+free speed-up over CuPy's MemoryPool ≥ 1, every size (median of per-trial "
      "ratios; worst: {at})", "alloc_size", "ratio_vs_cupy_pool", X, 1.0, over=("size_bytes",), unit="×",
      bound="host"),
    *(T(f"threads_8{s}", f"{label(a)}: 8 threads' pairs/s over 1 thread's ≥ 1 (64 KiB)", "alloc_threads", "kpairs_per_s", a,
        1.0, where=dict(threads=8), ref=dict(threads=1), unit="×", bound="host") for a, s in BOTH),
    # one GPU
    *(T(f"vs_cupy_{b}{s}", f"{'#14: ' * (a == X)}one GPU, batch {b}: {label(a)}'s speed-up over CuPy's MemoryPool ≥ 1 "
        "(tokens/s)", "single_gpu", "tokens_per_s", a, 1.0, where=dict(batch=b), ref=dict(allocator=CP), unit="×")
      for a, s in BOTH for b in (32, 4)),
    T("dispatch_32", "host ms per step ≤ 12 at batch 32 (xpool (CuPy); thread CPU time of a step started on an idle "
      "device)", "single_gpu", "dispatch_ms_per_step", X, 12.0, False, where=dict(batch=32), bound="host", **MS),
    T("busy_4", "one GPU, batch 4: GPU busy ≥ 70% (xpool (CuPy); NVML over {steps}-step windows)", "busy_b4",
      "gpu_util_mean", X, 70.0, **PCT),
    T("mallocs_all", "device mallocs per step after warm-up, every xpool arm (worst: {at})", "single_gpu",
      "device_mallocs_per_step", (X, XS), 0.0, False, over=("allocator", "batch"), fmt="{:.2g}", exact=True),
    T("mallocs", "#14: xpool (CuPy) device mallocs per step after warm-up, batch 4 and 32 (worst: {at})", "single_gpu",
      "device_mallocs_per_step", X, 0.0, False, over=("batch",), fmt="{:.2g}", exact=True),
    T("ror_32", "#14: batch 32: xpool (CuPy) peak reserved / peak requested ≤ 1.05", "single_gpu", "reserved_over_requested",
      X, 1.05, False, where=dict(batch=32), fmt="{:.3f}", exact=True, along=(CP,)),
    T("ror_4", "#14: batch 4: xpool (CuPy) peak reserved / peak requested ≤ CuPy's MemoryPool's", "single_gpu",
      "reserved_over_requested", X, dict(allocator=CP), False, where=dict(batch=4), fmt="{:.3f}", exact=True),
    # several GPUs
    T("ddp_threads", "2 GPUs, one thread per GPU, batch 32: xpool (CuPy)'s speed-up over one GPU ≥ 1.85", "ddp", "speedup", X,
      1.85, where=W2T, unit="×", along=("raw", CP)),
    T("ddp_raw", "2 GPUs, one thread per GPU, batch 32: raw's speed-up over one GPU ≤ 1.3 (the cliff stays visible)",
      "ddp", "speedup", "raw", 1.3, False, where=W2T, unit="×", along=(X,)),
    T("ddp_threads_vs_cupy", "2 GPUs, one thread per GPU, batch 32: xpool (CuPy)'s speed-up over CuPy's MemoryPool ≥ 1 "
      "(tokens/s)", "ddp", "tokens_per_s", X, 1.0, where=W2T, ref=dict(allocator=CP), unit="×"),
    T("ddp_procs", "2 GPUs, one process per GPU, batch 32: xpool (CuPy)'s speed-up over one GPU ≥ 1.95", "ddp", "speedup", X,
      1.95, where=W2P, unit="×", along=("raw",)),
    T("ddp_loss", "DDP loss vs one GPU on the same global batch ≤ 1e-6 (max relative difference)", "ddp",
      "loss_rel_diff_max", None, 1e-6, False, stat="max", fmt="{:.1e}", exact=True, bound="—"),
    T("ddp_params", "parameters agree across ranks ≤ 1e-6 (max abs difference)", "ddp", "param_rank_diff_max", None,
      1e-6, False, stat="max", fmt="{:.1e}", exact=True, bound="—"),
    # memory
    T("waste_best", "peak reserved / peak requested ≤ 1.10 with the best class setting (seed scheme, {at})",
      "memory_waste.csv", "reserved_over_requested", None, 1.10, False, over=("k",), pick="best", fmt="{:.3f}",
      exact=True, bound="—"),
    T("varlen", "#14: varying sequence lengths: xpool (CuPy) peak reserved / peak requested ≤ CuPy's MemoryPool's (one run "
      "per arm: exact counters)", "memory_varlen.csv", "reserved_over_requested", X, dict(allocator=CP), False,
      fmt="{:.3f}", exact=True, bound="—"),
    # the step as a CUDA graph
    T("graph_threads", "2 GPUs, one thread per GPU, batch 32: xpool_graph's speed-up over one GPU ≥ 1.85 (the step "
      "as a CUDA graph)", "graph", "speedup", XG, 1.85, where=W2T, unit="×", along=(X, "raw")),
    T("graph_raw", "2 GPUs, one thread per GPU, batch 32: raw's speed-up over one GPU ≤ 1.3 beside the graph arms (the "
      "cliff stays visible)", "graph", "speedup", "raw", 1.3, False, where=W2T, unit="×", along=(XG,)),
    T("graph_procs", "2 GPUs, one process per GPU, batch 32: xpool_graph's speed-up over one GPU ≥ 1.95", "graph",
      "speedup", XG, 1.95, where=W2P, unit="×"),
    T("graph_dispatch", "host ms per step ≤ 12 at batch 32 (xpool_graph; thread CPU time of a step started on an "
      "idle device)", "graph", "dispatch_ms_per_step", XG, 12.0, False, where=dict(mode="single", batch=32),
      fmt="{:.2f}", unit=" ms", bound="host", along=(X,)),
    T("graph_vs_cupy", "one GPU, batch 32: xpool_graph's speed-up over CuPy's MemoryPool, eager ≥ 1 (tokens/s)", "graph",
      "tokens_per_s", XG, 1.0, where=dict(mode="single", batch=32), ref=dict(allocator=CP), unit="×"),
    T("graph_busy", "one GPU, batch 4: GPU busy ≥ 70% (xpool_graph; NVML over {steps}-step windows)", "graph",
      "gpu_util_mean", XG, 70.0, where=dict(mode="single", batch=4), along=(X,), **PCT),
    T("graph_mallocs", "device mallocs per step after warm-up, every graph run, private pools included (worst: {at})",
      "graph", "device_mallocs_per_step", ("cupy_pool_graph", XG), 0.0, False,
      over=("allocator", "mode", "world", "batch"), fmt="{:.2g}", exact=True),
    # PyTorch through xpool
    T("torch_step", "PyTorch's training step: xpool (PyTorch)'s speed-up over PyTorch's caching allocator ≥ 1 (tokens/s)",
      "torch_interop.csv", "value", X, 1.0, where=dict(case="train_step"), ref=dict(arm="torch"), unit="×"),
    # dynamic shapes (issue #22)
    *_dynamic(),
    *_dynamic_summary(),
    # dynamic shapes at the scale users run them, and under a memory cap (issue #46)
    *_at_scale(),
    *_at_scale_summary(),
    # the reserve recipe on the ResNets at varying sizes (python -m xlab.bench.reserve): not the default's targets,
    # which stay above; what a program that knows its peak can do with the public API
    T("reserve_ror", "#22, ResNets at varying image sizes through enable_torch()'s pool with 1.03× the peak reserved "
      "before the first step (pool.reserve before or after the model is built, and by hand): peak reserved / peak "
      "requested ≤ 1.05 (every run; worst: {at})", "reserve_probe.csv",
      "reserved_over_requested", None, 1.05, False, where=dict(frac=1.03), over=("workload",), stat="max",
      fmt="{:.4f}", exact=True, bound="—"),
    T("reserve_calls", "#22, the same: device calls in steady state = 0 (every run; worst: {at})", "reserve_probe.csv",
      "steady_calls", None, 0.0, False, where=dict(frac=1.03), over=("workload",), stat="max", fmt="{:.0f}",
      exact=True, bound="—"),
    T("reserve_ms", "#22, the same: the reserve's speed-up over the runs without it ≥ 1 (ms per step, paired by seed; "
      "worst: {at})", "reserve_probe.csv", "ms_per_step", None, 1.0, where=dict(frac=1.03),
      ref=dict(frac=0.0, when="none"), over=("workload", "when"), fmt="{:.3f}", **SPEEDUP),
    T("reserve_calls_plain", "the same without the reserve: device calls in steady state, by workload (every run)",
      "reserve_probe.csv", "steady_calls", None, where=dict(frac=0.0), over=("workload",), pick="each", stat="max",
      fmt="{:.0f}", exact=True, bound="—"),
    # correctness
    T("gate", "transparency gate: every allocator bit-identical to raw cudaMalloc (checks passing)", "correctness",
      "passed", None, 1.0, where=dict(gate=True), stat="all", exact=True, bound="—"),
    # numbers the report quotes (no goal)
    T("cpu_checks", "CPU checks passing", "correctness", "passed", None, where=dict(device="cpu"), stat="all"),
    T("gpu_checks", "GPU checks passing", "correctness", "passed", None, where=dict(device="gpu"), stat="all"),
    *(T(f"us64_{a}", f"{a} µs per pair at 64 KiB", "alloc_size", "us_per_pair", a, where=dict(size_bytes=65536),
        unit=" µs") for a in (X, CP, "cupy_torch", "cupy_async", "raw", "c_noop")),
    T("hit_best", "xpool's speed-up over CuPy's MemoryPool, best size", "alloc_size", "ratio_vs_cupy_pool", X,
      over=("size_bytes",), pick="best", unit="×"),
    *(T(f"us4_{a}", f"{a} µs per pair at 4 KiB", "alloc_size", "us_per_pair", a, where=dict(size_bytes=4096),
        unit=" µs") for a in ("raw", "raw_held")),
    *(T(f"k8_{a}", f"{a} thousand pairs/s, 8 threads", "alloc_threads", "kpairs_per_s", a,
        where=dict(threads=8, size_bytes=65536), fmt="{:.0f}", unit="k") for a in (X, CP, "raw")),
    T("k8_ratio", "xpool's speed-up over CuPy's MemoryPool, 8 threads (median of per-trial ratios)", "alloc_threads",
      "ratio_vs_cupy_pool", X, where=dict(threads=8, size_bytes=65536), unit="×"),
    T("tps_32_all", "xpool tokens/s, batch 32", "single_gpu", "tokens_per_s", X, where=dict(batch=32), fmt="{:,.0f}",
      along=(CP,)),
    T("vs_raw", "one GPU, batch 32: xpool's speed-up over raw cudaMalloc (tokens/s)", "single_gpu", "tokens_per_s", X,
      where=dict(batch=32), ref=dict(allocator="raw"), unit="×"),
    T("mallocs_raw", "raw device mallocs per step, batch 32", "single_gpu", "device_mallocs_per_step", "raw",
      where=dict(batch=32), fmt="{:.0f}", exact=True, along=(X,)),
    T("ror_32_cupy", "CuPy's pool's peak reserved / requested, batch 32", "single_gpu", "reserved_over_requested", CP,
      where=dict(batch=32), fmt="{:.3f}", exact=True, along=(X,)),
    T("ddp_threads_cupy", "CuPy's pool's speed-up over one GPU, one thread per GPU, 2 GPUs", "ddp", "speedup", CP,
      where=W2T, unit="×", along=(X, "raw")),
    T("ddp_raw_procs", "2 GPUs, one process per GPU, batch 32: raw's speed-up over one GPU", "ddp", "speedup", "raw",
      where=W2P, unit="×", along=(X,)),
    T("ddp_threads_xe", "2 GPUs, one thread per GPU, batch 32: the expandable scheme's speed-up over one GPU", "ddp",
      "speedup", "xpool_expandable", where=W2T, unit="×", along=(X,)),
    T("ddp_procs_xe", "2 GPUs, one process per GPU, batch 32: the expandable scheme's speed-up over one GPU", "ddp",
      "speedup", "xpool_expandable", where=W2P, unit="×", along=(X,)),
    *(T(f"peer_us_{a}", f"µs per one-page miss of the expandable scheme, {'with' if a == 'all' else 'without'} the "
        "other GPU's access, on two GPUs", "peer_map_cost.csv", "s_per_miss", None, where=dict(peer_access=a),
        scale=1e6, fmt="{:.0f}", unit=" µs", bound="host") for a in ("all", "none")),
    T("sweep", "xpool speedup by batch, threads, 2 GPUs", "batch_sweep", "speedup", X, where=W2T, over=("batch",),
      pick="each", unit="×"),
    T("sweep_graph", "xpool_graph speedup by batch, threads, 2 GPUs", "batch_sweep", "speedup", XG, where=W2T,
      over=("batch",), pick="each", unit="×"),
    T("graph_dispatch_eager", "xpool eager dispatch ms, batch 32, graph runs", "graph", "dispatch_ms_per_step", X,
      where=dict(mode="single", batch=32), along=(XG,), **MS),
    T("graph_threads_x", "xpool's speed-up over one GPU beside the graph arms", "graph", "speedup", X, where=W2T,
      unit="×", along=(XG, "raw")),
    T("graph_busy_x", "xpool (eager) GPU busy at batch 4, graph runs", "graph", "gpu_util_mean", X,
      where=dict(mode="single", batch=4), along=(XG,), **PCT),
    T("waste", "size-class waste by k (seed scheme)", "memory_waste.csv", "class_waste_pct", None, over=("k",),
      pick="each", fmt="{:.2g}", unit="%", exact=True),
    T("waste_peak", "peak reserved / requested by k (seed scheme)", "memory_waste.csv", "reserved_over_requested", None,
      over=("k",), pick="each", fmt="{:.2f}", unit="×", exact=True),
    T("varlen_cupy", "CuPy's pool, varying lengths", "memory_varlen.csv", "reserved_over_requested", CP, fmt="{:.3f}",
      exact=True),
    *_held_each(),
    *_held_each(SCALE, "scale", **AT_SCALE),
    *(T(f"dyn_h_calls{k}", f"{label}: device calls per step in steady state, by dynamic workload", DYN,
        "device_calls_per_steady_step", arm, where=dict(dynamic=True, framework=f), over=("workload",), pick="each",
        fmt="{:.3g}", exact=True) for k, label, arm, f in DEFAULT_ARMS),
    *(T(f"dyn_h_ms{k}", f"{label}: speed-up over the fastest peer, by workload", DYN, "ms_per_step",
        arm, where=dict(framework=f), ref=dict(allocator=PEERS), over=("workload",), pick="each", **SPEEDUP)
      for k, label, arm, f in DEFAULT_ARMS),
    T("torch_empty", "torch.empty+del: xpool's speed-up over PyTorch's caching allocator, by size", "torch_interop.csv", "value",
      X, where=dict(case="empty_del"), ref=dict(arm="torch"), over=("size_bytes",), pick="each", **SPEEDUP),
)
BY_KEY = {t.key: t for t in TARGETS}
# each #22 row of memory held and its twin on the scaled rows (issue #46): what the report's memory headlines read
# where the twin is measured (a headline of device calls or speed keeps the benchmark's size: #22's own targets)
AT_SCALE_TWIN = {k: twin for k, r in BY_KEY.items() if k.startswith("dyn_")
                 and (r.metric == HELD["metric"] or k.startswith(("dyn_calls_worst", "dyn_speed_worst")))
                 and (twin := "scale_" + k[len("dyn_"):]) in BY_KEY}


@dataclasses.dataclass
class Measured:
    """A row measured: value and interval (NaN: none), the group it came from, its source, and its verdict."""

    row: T
    value: float = math.nan
    lo: float = math.nan
    hi: float = math.nan
    n: int = 0
    at: str = ""
    steps: str = ""
    src: str = ""
    where: str = ""
    ref: str = ""                         # the reference arm, when it was the best of several
    bound: str = "—"
    goal: float | None = None
    goal_text: str = ""
    each: list = dataclasses.field(default_factory=list)
    csv: str = ""                         # the CSV of the rows (one: every comparison is within one run)
    date: str = ""                        # the latest timestamp of the rows read
    rows: pd.DataFrame | None = dataclasses.field(default=None, repr=False)   # the rows read (the arm's, ref's)
    rules: str = ""                       # the release rules the xpool rows ran, where the CSV says
    group: tuple = ()                     # the values of `over` this measurement stands for
    values: tuple = ()                    # the per-trial values (or paired ratios) behind a median: printed, sorted,
    # in place of an interval over fewer than INTERVAL_TRIALS trials

    def __format__(self, spec: str) -> str:
        r = self.row
        if self.each:                     # groups of other pools than each other's say theirs (pool_said)
            mixed = self.mixed_pools
            return ", ".join(f"{m.at}{f' ({m.pool_said})' if mixed and m.pool_said else ''}: {m:{spec}}"
                             for m in self.each)
        if r.stat in ("all", "share"):
            return "n/a" if not self.n else f"{round(self.value * self.n)} of {self.n}"
        if self._few:
            f = spec or r.fmt
            return (iv.fmt_ci(self.value, math.nan, math.nan, f, r.unit, self.goal, exact=True)
                    + f" (no interval: {self.n} trials, " + ", ".join(f.format(v) for v in sorted(self.values)) + ")")
        return iv.fmt_ci(self.value, self.lo, self.hi, spec or r.fmt, r.unit, self.goal, exact=self._exact)

    @property
    def mixed_pools(self) -> bool:
        """Whether the groups of a row over several (`each`) measured different pools: the product in some, an earlier
        xpool in others (one CSV that holds several runs)."""
        return len({m.pool_said for m in self.each}) > 1

    @property
    def pool_said(self) -> str:
        """What the arm's xpool rows measured other than the product as it ships ('release rule high_water, retired by
        decision 0001', 'before the freeze'; shared.qualifiers), '' for the product as it ships and for a peer. A row
        over groups says it where every group measured the same; where they differ, '' (each group says its own)."""
        if self.each:
            return "" if self.mixed_pools else self.each[0].pool_said
        rows, arms = self.rows, self.row.arm
        col = sources.arm_column(rows) if rows is not None else None
        if col is None or not len(rows):
            return ""
        arms = {arms} if isinstance(arms, str) else set(arms or ())
        if self.group and "allocator" in self.row.over:
            arms = {self.group[self.row.over.index("allocator")]}
        said = []
        for a, g in rows.groupby(col, sort=False):
            if str(a).startswith("xpool") and (not arms or a in arms):
                said += [q for q in shared.qualifiers(g, a) if q not in said]
        return "; ".join(said)

    @property
    def _few(self) -> bool:
        """A median over several trials, too few for an interval (INTERVAL_TRIALS): its values are printed instead."""
        return self.row.stat == "median" and 1 < self.n < INTERVAL_TRIALS and not (
            self.row.exact and len(set(self.values)) <= 1)

    @property
    def _exact(self) -> bool:
        """Judged on its value: a statistic that is not a median, or a row marked exact (a count, a replay's bytes)
        whose trials agree; one whose trials differ (the dynamic benchmark's realizations) is judged on its interval."""
        return self.row.stat != "median" or (self.row.exact and not self.hi - self.lo > 1e-6 * abs(self.value))

    @property
    def verdict(self) -> str:
        """intervals.judge's; measured on fewer trials than the row's goal speaks of, with how many (several
        without an interval are not a single run)."""
        if self.goal is None:
            return ""
        if self.under_way:              # a goal over N trials waits for them
            return f"{PENDING} ({self.n} of {self.row.trials})"
        said = iv.judge(self.value, self.lo, self.hi, self.goal, self.row.higher, exact=self._exact)
        return f"{FEW} ({self.n} trials)" if self._few else said

    @property
    def under_way(self) -> bool:
        """Measured on fewer trials than the row's goal speaks of (`trials`): a run under way."""
        return 0 < self.n < self.row.trials

    @property
    def statistic(self) -> str:
        """What the value is, named for what it is computed as."""
        r = self.row
        if r.stat == "all":
            return PASSING[r.metric][0]
        if r.stat == "share":
            return "paired trials where it holds"
        if r.stat in ("max", "min"):
            return f"the {'most' if r.stat == 'max' else 'least'} over the rows"
        if r.ref is not None:
            return "ratio of the two medians over paired trials"
        if r.metric in PER_TRIAL_RATIOS:
            return "median of per-trial ratios"
        return "value (the same in every trial)" if self._exact and not self._few else "median over trials"


# columns that hold a ratio per trial (the benchmark divided trial t by trial t): their median is a median of ratios
PER_TRIAL_RATIOS = ("ratio_vs_cupy_pool", "speedup")


def _group_label(keys, values) -> str:
    return ", ".join(iv.fmt_bytes(v) if k == "size_bytes" else f"k = {v}" if k == "k" else
                     str(v) if k in ("allocator", "arm", "mode", "workload") else f"{k} {v}"
                     for k, v in zip(keys, values))


def _value(r: T, mine: pd.DataFrame, ref: pd.DataFrame | None):
    """(value, lo, hi, n) of a row's statistic over the selected rows (and their reference)."""
    v = mine[r.metric].astype(float) * r.scale
    if r.stat == "all":
        v = v.dropna()
        return float(v.mean()) if len(v) else math.nan, math.nan, math.nan, len(v)
    if r.stat in ("max", "min"):
        return (float(getattr(v, r.stat)()) if len(v) else math.nan), math.nan, math.nan, len(v)
    if ref is None:
        return iv.median_ci(v)
    a = mine.groupby("trial")[r.metric].median() if "trial" in mine else v.reset_index(drop=True)
    b = ref.groupby("trial")[r.metric].median() if "trial" in ref else ref[r.metric].reset_index(drop=True)
    common = a.index.intersection(b.index)
    a, b = a.loc[common].to_numpy(float), b.loc[common].to_numpy(float)
    if r.stat == "share":                 # the pairs whose ratio, the way `flip` takes it, is at least 1
        return (float((b >= a if r.flip else a >= b).mean()) if len(a) else math.nan), math.nan, math.nan, len(a)
    return iv.ratio_ci(b, a) if r.flip else iv.ratio_ci(a, b)


def _values(r: T, mine: pd.DataFrame, ref: pd.DataFrame | None) -> tuple:
    """The values a median row's statistic is the median of: each trial's value, or each paired trial's ratio."""
    if r.stat != "median":
        return ()
    if ref is None:
        return tuple(float(x) for x in (mine[r.metric].astype(float) * r.scale).dropna())
    a, b = (f.groupby("trial")[r.metric].median() for f in (mine, ref))
    common = a.index.intersection(b.index)
    top, bottom = (b, a) if r.flip else (a, b)
    return tuple(float(x) for x in (top.loc[common] / bottom.loc[common]).dropna())


def _bound(r: T, *frames) -> str:
    if r.bound or r.exact or r.stat != "median":
        return r.bound or "—"
    bounds = []
    for f in frames:
        if f is not None and "bound" in f and f["bound"].notna().any():
            bounds.append((sources.arm_column(f) and f[sources.arm_column(f)].iloc[0], f["bound"].mode().iloc[0]))
    if len({b for _, b in bounds}) > 1:
        return ", ".join(f"{_named(a)} {b}" for a, b in bounds)
    return bounds[0][1] if bounds else "—"


def pools(rows: pd.DataFrame, col: str | None) -> str:
    """Which pool the xpool rows measured, where the CSV says: 'xpool: scheme expandable', 'xpool_segments: release
    rule high_water' ('' where no row says)."""
    if not any(c in rows for c in POOL_COLUMNS):
        return ""
    out = []
    for a, g in (rows[rows[col].astype(str).str.startswith("xpool")].groupby(col, sort=False) if col else
                 [("", rows)]):            # a CSV without an arm column measured xpool alone
        said = [f"{what} {'/'.join(sorted(set(g[c].dropna().astype(str))))}" for c, what in POOL_COLUMNS.items()
                if c in g and g[c].notna().any()]
        if said:
            out.append(f"{a}: {', '.join(said)}" if a else ", ".join(said))
    return "; ".join(out)


def _one(r: T, df: pd.DataFrame, col: str | None, group: dict) -> Measured | None:
    """The row measured on one CSV's rows, one group of `over`; None when the rows are not there (the arm's, its
    reference's, or those of the arms it is set beside)."""
    arms = (r.arm,) if isinstance(r.arm, str) else r.arm
    mine = sources.select(df, {**r.where, **group})
    if r.along and (not col or not set(r.along) <= set(mine[col])):
        return None                                   # the arms it is set beside: in this run, or not here
    if arms and col:
        mine = mine[mine[col].isin(arms)]
    ref = None
    if r.ref is not None:
        ref = sources.select(df, {**r.where, **group, **r.ref})
        if col and col not in r.ref and arms:
            ref = ref[ref[col].isin(arms)]
        if not len(ref):
            return None
        if col in r.ref and ref[col].nunique() > 1:       # the best of several arms (the fastest peer, say)
            ref = ref[ref[col] == iv.best(ref, r.metric, col, r.higher != r.flip)]
    if not len(mine) or r.metric not in mine or mine[r.metric].isna().all():
        return None
    if r.ref and col in r.ref and set(mine[col]) <= {r.ref[col]}:
        return None                                   # the reference over itself
    used = pd.concat([mine, ref]) if ref is not None else mine
    value, lo, hi, n = _value(r, mine, ref)
    if r.stat == "median" and n < INTERVAL_TRIALS:    # no interval over so few trials: the values are printed
        lo = hi = math.nan
    m = Measured(r, value, lo, hi, n, src=sources.sources(mine), where=sources.where(mine),
                 bound=_bound(r, mine, ref), ref=ref[col].iloc[0] if ref is not None and col in ref else "",
                 steps="/".join(str(int(s)) for s in pd.unique(mine["steps"].dropna())) if "steps" in mine else "",
                 csv=str(df["csv"].iloc[0]) if "csv" in df else "", date=sources.newest_date(used), rows=used,
                 rules=pools(used, col), values=_values(r, mine, ref) if "trial" in mine or ref is None else ())
    if isinstance(r.goal, dict):
        others = sources.select(df, {**r.where, **group, **r.goal})
        if "trial" in others and "trial" in mine:     # the goal compares the same trials as the value
            others = others[others["trial"].isin(set(mine["trial"]))]
        goal = _goal_of(r, others, col)
        if goal is None:
            return None
        m.goal, m.goal_text = goal
    else:
        m.goal = r.goal
    return m


def _goal_of(r: T, rows: pd.DataFrame, col: str | None):
    """(value, words) of a goal that is other rows: their median (stat all: the share that pass, 'arm: k of n'), the
    best arm's where they are several (stat all: of two with one share, the one with more that pass); None without
    rows."""
    rows = rows.dropna(subset=[r.metric])
    if not len(rows):
        return None
    arm = rows[col] if col else pd.Series("", index=rows.index)
    per = rows[r.metric].astype(float).groupby(arm).agg(["mean", "sum", "median"]) * r.scale
    if r.stat == "all":
        best = per.sort_values(["mean", "sum"], ascending=not r.higher, kind="stable").index[0]
        n = int((arm == best).sum())
        return float(per.loc[best, "mean"]), f"{best}: {round(per.loc[best, 'sum'])} of {n}"
    best = per["median"].idxmax() if r.higher else per["median"].idxmin()
    return float(per.loc[best, "median"]), iv.fmt_ci(per.loc[best, "median"], math.nan, math.nan, r.fmt, r.unit,
                                                     exact=True)


def _groups(r: T, parts) -> list:
    if r.over and all(c in p for p in parts for c in r.over):
        return sorted({tuple(x) for p in parts for x in p[list(r.over)].drop_duplicates().itertuples(index=False)})
    return [()]


def measure(r: T, data: pathlib.Path, history: bool = False) -> list[Measured]:
    """A row measured on the newest CSV of its lineage with its rows ([] if none); history: on each older one."""
    per_group = _per_group(r, data, first=not history)
    return _levels(r, per_group, history) if per_group else []


def _levels(r: T, per_group: list[list[Measured]], history: bool) -> list[Measured]:
    """The row combined over its groups on the newest CSV of each, or (history) on each older one in turn."""
    if not history:
        return [_combine(r, [f[0] for f in per_group])]
    depth = max(len(f) for f in per_group)
    return [_combine(r, [f[i] for f in per_group if len(f) > i]) for i in range(1, depth)]


def stale(r: T, data: pathlib.Path, csvs: dict | None = None) -> list[str]:
    """The rule "each row reads the newest CSV of its kind", checked: for every group the row reads (each group it
    chose its worst or best among), each CSV of the same benchmark (xlab.sources.of_kind: in the lineage or not)
    that holds the row's rows in the same configuration (the arm's, its reference's and those of the arms it is set
    beside; sources.CONFIG) and is newer than the CSV read. [] when the row reads the newest (or nothing)."""
    got = measure(r, data)
    if not got:
        return []
    read = got[0].each or ([f[0] for f in _per_group(r, data, first=True)] if r.over else got)
    out = []
    for name, df in sources.of_kind(data, r.kind, csvs).items():
        if not len(df):
            continue
        df = df.assign(csv=f"{name}.csv")
        col = sources.arm_column(df)
        for m in read:
            if f"{name}.csv" == m.csv:
                continue
            other = _one(r, df, col, dict(zip(r.over, m.group)))
            if other is not None and other.date > m.date and sources.same_configuration(other.rows, m.rows):
                out.append(f"{r.key} ({m.at or 'all'}): reads `{m.csv}` of {m.date[:16]}, but `{name}.csv` of "
                           f"{other.date[:16]} holds the same rows")
    return out


# What _per_group gave a row, by the bytes of its lineage's CSVs (it reads those alone, and no Measured names the
# folder): a page measures a target again only where one of its CSVs changed. The Measured are shared, never changed.
_PER_GROUP: dict[tuple, tuple] = {}


def _per_group(r: T, data: pathlib.Path, first: bool = False) -> list[list[Measured]]:
    """For each group of `over`, the row measured on each CSV of its lineage that has it, newest first (only the
    newest with `first`)."""
    key = (id(r), first, sources.lineage_fingerprint(data, r.kind))
    got = _PER_GROUP.get(key)
    if got is None or got[0] is not r:
        while len(_PER_GROUP) >= 4096:
            _PER_GROUP.pop(next(iter(_PER_GROUP)))
        got = _PER_GROUP[key] = (r, _measure_groups(r, data, first))
    return [list(f) for f in got[1]]


def _measure_groups(r: T, data: pathlib.Path, first: bool) -> list[list[Measured]]:
    parts = sources.frames(data, r.kind)[::-1]
    col = sources.arm_column(parts[0]) if parts else None
    out = []
    for g in _groups(r, parts) if parts else []:
        found = []
        for p in parts:
            m = _one(r, p, col, dict(zip(r.over, g)))
            if m is not None:
                m.at, m.group = _group_label(r.over, g), g
                found.append(m)
                if first:
                    break
        if found:
            out.append(found)
    return out


def _combine(r: T, level: list[Measured]) -> Measured:
    """One Measured of a row from its groups: the worst (or best) group, or all of them (`each`)."""
    if len(level) == 1 and not r.over:
        return level[0]
    if r.pick == "each":
        m = dataclasses.replace(level[0], each=level)
        m.src = "; ".join(dict.fromkeys(x.src for x in level))
        return m
    return (min if (r.pick == "worst") == r.higher else max)(level, key=lambda m: m.value)


# What judged and values gave for a folder, by the folder and its CSVs' bytes: a page, its README blocks and its
# tables each ask for them, and the answer follows from those bytes alone. The Measured are shared, never changed.
_MEMO: dict[tuple, object] = {}


def _memo(what: str, data: pathlib.Path, compute):
    key = (what, sources.fingerprint(data))
    if key not in _MEMO:
        while len(_MEMO) >= 64:
            _MEMO.pop(next(iter(_MEMO)))
        _MEMO[key] = compute()
    return _MEMO[key]


def judged(data: pathlib.Path) -> tuple[list[Measured], list[Measured]]:
    """(every target measured on its newest data, every target measured on older data: the history)."""
    now, then = _memo("judged", data, lambda: _judged(data))
    return list(now), list(then)


def _judged(data: pathlib.Path) -> tuple[list[Measured], list[Measured]]:
    now, then = [], []
    for r in TARGETS:
        if r.goal is None:
            continue
        per_group = _per_group(r, data)          # each group on every CSV of the lineage, once for both
        if per_group:
            now += _levels(r, per_group, history=False)
            then += _levels(r, per_group, history=True)
    return now, then


def values(data: pathlib.Path) -> dict:
    """{key: Measured} of every row measured on its newest data (what the headlines' template reads)."""
    def compute():
        known = {m.row.key: m for m in judged(data)[0]}      # the targets, measured already
        return {r.key: got[0] for r in TARGETS if (got := [known[r.key]] if r.key in known else measure(r, data))}
    return dict(_memo("values", data, compute))


def text(m: Measured) -> str:
    """A target's words, its group filled in and its goal's value when the goal is another arm's."""
    t = m.row.text.replace("{at}", _named(m.at) or "—").replace("{steps}", m.steps or "?").replace(
        "{ref}", shared.label(m.ref) if m.ref else "—")
    goal = m.goal_text
    if goal and ": " in goal:              # 'arm: k of n', the arm in its one name
        arm, _, got = goal.partition(": ")
        goal = f"{_named(arm)}: {got}"
    return t + (f" ({goal})" if goal else "") + (f" [{said}]" if (said := m.pool_said) else "")


def _named(at: str | None) -> str | None:
    """An arm id in its one name (shared.label); a workload, a size or anything else not an arm as it is."""
    if not at:
        return at
    try:
        shared.arm(at)
    except ValueError:
        return at
    return shared.label(at)


def table(rows: list[Measured]) -> list[str]:
    """Markdown: one line per judged target, with the CSV and commit its value came from."""
    out = [f"| {text(m)} | {m} | {f'**{m.verdict}**' if m.verdict.startswith(iv.MISSED) else m.verdict} | {m.bound} "
           f"| {m.src} |"
           for m in rows]
    return ["| target | measured | verdict | bound | data |", "|---|---|---|---|---|"] + out if out else []


def counts(rows: list[Measured]) -> dict:
    """How many targets are met, missed, within noise, single runs, or several trials too few for an interval
    (`few`), a verdict counted by what it opens with; and how many of them rest on a run under way (`under_way`:
    fewer trials than their goal speaks of, the verdict says how many)."""
    v = [m.verdict for m in rows]
    return {"targets": len(v), **{k: sum(x.startswith(said) for x in v) for k, said in (
                ("met", iv.MET), ("missed", iv.MISSED), ("noise", iv.NOISE), ("single", iv.SINGLE), ("few", FEW),
                ("pending", PENDING))},
            "under_way": sum(m.under_way for m in rows)}
