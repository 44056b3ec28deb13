"""The issues' targets, and the numbers the headlines quote, as one table (TARGETS), judged by one rule.

A row names a lineage of CSVs (xlab.sources.KINDS, or one CSV), a selection (`where`), a metric column, the arm(s),
an optional reference (`ref`: the arm's rows with these columns replaced; the value is then the ratio of the two,
paired by trial; several arms there: the best of them by median, the fastest peer, say), the worst (or best, or
each) group `over` some columns, and a goal with its direction. `measure` takes the median over trials with its 95%
bootstrap interval from the newest CSV of the lineage that has the rows; the verdict is intervals.judge's, the
report's rule. A row without a goal is a number for the headlines; the same row on older CSVs is its history.

    T(key, text, kind, metric, arm, goal=..., higher=..., where={...}, ref={...}, over=(...), ...)

To add a target: one `T(...)` line (goal and direction set); to quote a number in a headline: a row without a
goal, its key in report.md's template ({key}: the value [interval]; {key.src}: its CSV and commit).
"""
from __future__ import annotations

import dataclasses
import math
import pathlib

import pandas as pd

import xpool

from . import intervals as iv, sources
from .allocators import DEFAULT_SCHEME, SETS, TORCH_DEFAULT_SCHEME
from .bench.dynamic import WORKLOADS, xpool_arms


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
    stat: str = "median"                  # median (with interval), max or min (exact), all (k of n pass)
    fmt: str = "{:.2f}"
    unit: str = ""
    scale: float = 1.0
    exact: bool = False
    bound: str | None = None              # what bounds the steps, when the rows do not say


X, XS, XG, CP = "xpool", "xpool_seed", "xpool_graph", "cupy_pool"
BOTH = ((X, ""), (XS, "_seed"))            # rows measured for the default scheme and for the seed scheme
DYN, XD, PEERS = "dynamic_shapes", ("xpool", f"xpool_{DEFAULT_SCHEME}"), SETS["dynamic"]   # XD: the default arm
DYN_HELD_OUT = "dynamic_heldout"          # the CSV of xlab.bench.dynamic's held-out workloads
# a PyTorch workload's default arm: the pool xpool.enable_torch() makes (its scheme, and its release rule when the
# front end sets one: xpool_expandable_peak)
XDT = f"xpool_{TORCH_DEFAULT_SCHEME}"
# the dynamic headlines' two defaults: (key suffix, label, arm, framework of the workloads)
TORCH_LABEL = f" for PyTorch ({TORCH_DEFAULT_SCHEME})"
DEFAULT_ARMS = (("", f" ({DEFAULT_SCHEME})", XD, "cupy"), ("_torch", TORCH_LABEL, XDT, "torch"))
MS, PCT, K = dict(fmt="{:.1f}", unit=" ms"), dict(fmt="{:.0f}", unit="%"), dict(fmt="{:.1f}", unit="k", scale=1e-3)
W2T, W2P = dict(mode="threads", world=2), dict(mode="processes", world=2)


def _dynamic() -> list:
    """#22's targets per workload of xlab.bench.dynamic: xpool's default (a PyTorch workload's: the pool
    enable_torch() makes), its best arm for memory, and the device calls of the expandable arms (what "bounded"
    trades for memory: docs/decisions/0001-one-release-rule-per-scheme.md)."""
    schemes = xpool_arms()
    rows = []
    for w, spec in WORKLOADS.items():      # a held-out workload: its own CSV, and "held out" in its targets' names
        kind, w_ = (DYN_HELD_OUT, f"{w} (held out)") if spec.held_out else (DYN, w)
        ror = dict(kind=kind, metric="reserved_over_requested", higher=False, fmt="{:.3f}", exact=True, bound="—")
        xd, on = XDT if spec.framework == "torch" else XD, dict(where=dict(workload=w))
        name = f"xpool's default for PyTorch: {XDT}" if xd == XDT else "xpool"
        who = (("", name, dict(arm=xd)), ("_best", "the best xpool arm: {at}",
                                         dict(arm=schemes, over=("allocator",), pick="best")))
        if spec.dynamic:
            rows += [T(f"dyn_ror{k}_{w}", f"#22, {w_}: peak reserved / peak requested ≤ 1.05 ({n})", goal=1.05,
                       **arms, **on, **ror) for k, n, arms in who]
            rows += [T(f"dyn_calls{k}_{w}", f"#22, {w_}: device calls per step in steady state = 0 ({n})", kind,
                       "device_calls_per_steady_step", arm, 0.0, False, fmt="{:.3g}", exact=True, bound="—", **on)
                     for k, n, arm in (("", name, xd), *((f"_{a[6:]}", a, a) for a in schemes
                                                         if "expandable" in a and a != xd))]
        rows.append(T(f"dyn_ms_{w}", f"#22, {w_}: ms per step ≤ the fastest peer's ({{ref}}; {name}, paired by trial)",
                      kind, "ms_per_step", xd, 1.0, False, ref=dict(allocator=PEERS), unit="×", fmt="{:.3f}", **on))
        if spec.framework == "torch" and spec.dynamic:
            rows += [T(f"dyn_vs_expandable{k}_{w}", f"#22, {w_}: peak reserved / peak requested ≤ PyTorch's with "
                       f"expandable segments ({n}; paired by trial)", **arms, **on, ref=dict(allocator="torch_expandable"),
                       goal=1.0, unit="×", **ror) for k, n, arms in who]
    return rows


# the goal 91.2k tokens/s: CuPy's pool at batch 32, flat-buffer AdamW, on an H200 at 8ea8461 (shared/ANCHORS.md)
TARGETS = (
    # the allocator microbenchmark, through CuPy (cached arms: the final hit path's sweep)
    *(T(f"us_vs_cupy{s}", f"{a} µs per pair ≤ 1.05× CuPy MemoryPool's, every size (worst: {{at}})", "alloc_size",
        "time_vs_cupy_pool", a, 1.05, False, over=("size_bytes",), unit="×", bound="host") for a, s in BOTH),
    T("hit_worst", "#14: xpool alloc+free no slower than CuPy MemoryPool's, every size (CuPy's time / xpool's per "
      "trial; worst: {at})", "alloc_size", "ratio_vs_cupy_pool", X, 1.0, over=("size_bytes",), unit="×",
      bound="host"),
    *(T(f"threads_8{s}", f"{a}: 8 threads ≥ 1 thread in pairs/s (64 KiB)", "alloc_threads", "kpairs_per_s", a, 1.0,
        where=dict(threads=8), ref=dict(threads=1), unit="×", bound="host") for a, s in BOTH),
    # one GPU
    *(T(f"vs_raw{s}", f"one GPU, batch 32: {a} ≥ 2.9× raw (tokens/s)", "single_gpu", "tokens_per_s", a, 2.9,
        where=dict(batch=32), ref=dict(allocator="raw"), unit="×") for a, s in BOTH),
    *(T(f"vs_cupy_{b}{s}", f"{'#14: ' * (a == X)}one GPU, batch {b}: {a} ≥ 1.00× CuPy MemoryPool (tokens/s)",
        "single_gpu", "tokens_per_s", a, 1.0, where=dict(batch=b), ref=dict(allocator=CP), unit="×")
      for a, s in BOTH for b in (32, 4)),
    T("tps_32", "one GPU, batch 32: xpool ≥ 91.2k tokens/s (CuPy's pool on an H200 at 8ea8461)", "single_gpu",
      "tokens_per_s", X, 91.2, where=dict(batch=32), **K),
    T("dispatch_32", "host ms per step ≤ 12 at batch 32 (xpool; thread CPU time of a step started on an idle "
      "device)", "single_gpu", "dispatch_ms_per_step", X, 12.0, False, where=dict(batch=32), bound="host", **MS),
    T("busy_4", "one GPU, batch 4: GPU busy ≥ 70% (xpool; NVML over {steps}-step windows)", "busy_b4",
      "gpu_util_mean", X, 70.0, **PCT),
    T("mallocs_all", "device mallocs per step after warm-up, every xpool arm (worst: {at})", "single_gpu",
      "device_mallocs_per_step", (X, XS), 0.0, False, over=("allocator", "batch"), fmt="{:.2g}", exact=True),
    T("mallocs", "#14: xpool device mallocs per step after warm-up, batch 4 and 32 (worst: {at})", "single_gpu",
      "device_mallocs_per_step", X, 0.0, False, over=("batch",), fmt="{:.2g}", exact=True),
    T("ror_32", "#14: batch 32: xpool peak reserved / peak requested ≤ 1.05", "single_gpu", "reserved_over_requested",
      X, 1.05, False, where=dict(batch=32), fmt="{:.3f}", exact=True),
    T("ror_4", "#14: batch 4: xpool peak reserved / peak requested ≤ CuPy MemoryPool's", "single_gpu",
      "reserved_over_requested", X, dict(allocator=CP), False, where=dict(batch=4), fmt="{:.3f}", exact=True),
    # several GPUs
    T("ddp_threads", "2 GPUs, one thread per GPU, batch 32: xpool ≥ 1.85×", "ddp", "speedup", X, 1.85, where=W2T,
      unit="×"),
    T("ddp_raw", "2 GPUs, one thread per GPU, batch 32: raw ≤ 1.3× (the cliff stays visible)", "ddp", "speedup",
      "raw", 1.3, False, where=W2T, unit="×"),
    T("ddp_procs", "2 GPUs, one process per GPU, batch 32: xpool ≥ 1.95×", "ddp", "speedup", X, 1.95, where=W2P,
      unit="×"),
    T("ddp_raw_procs", "2 GPUs, one process per GPU, batch 32: raw (no goal)", "ddp", "speedup", "raw", where=W2P,
      unit="×"),
    T("ddp_threads_xe", "2 GPUs, one thread per GPU, batch 32: the expandable scheme (no goal)", "ddp", "speedup",
      "xpool_expandable", where=W2T, unit="×"),
    T("ddp_procs_xe", "2 GPUs, one process per GPU, batch 32: the expandable scheme (no goal)", "ddp", "speedup",
      "xpool_expandable", where=W2P, unit="×"),
    T("ddp_loss", "DDP loss vs one GPU on the same global batch ≤ 1e-6 (max relative difference)", "ddp",
      "loss_rel_diff_max", None, 1e-6, False, stat="max", fmt="{:.1e}", exact=True, bound="—"),
    T("ddp_params", "parameters agree across ranks ≤ 1e-6 (max abs difference)", "ddp", "param_rank_diff_max", None,
      1e-6, False, stat="max", fmt="{:.1e}", exact=True, bound="—"),
    # memory
    T("waste_best", "peak reserved / peak requested ≤ 1.10 with the best class setting (seed scheme, {at})",
      "memory_waste.csv", "reserved_over_requested", None, 1.10, False, over=("k",), pick="best", fmt="{:.3f}",
      exact=True, bound="—"),
    T("varlen", "#14: varying sequence lengths: xpool peak reserved / peak requested ≤ CuPy MemoryPool's (one run "
      "per arm: exact counters)", "memory_varlen.csv", "reserved_over_requested", X, dict(allocator=CP), False,
      fmt="{:.3f}", exact=True, bound="—"),
    # the step as a CUDA graph
    T("graph_threads", "2 GPUs, one thread per GPU, batch 32: xpool_graph ≥ 1.85× (step as a CUDA graph)", "graph",
      "speedup", XG, 1.85, where=W2T, unit="×"),
    T("graph_raw", "2 GPUs, one thread per GPU, batch 32: raw ≤ 1.3× beside the graph arms (the cliff stays "
      "visible)", "graph", "speedup", "raw", 1.3, False, where=W2T, unit="×"),
    T("graph_procs", "2 GPUs, one process per GPU, batch 32: xpool_graph ≥ 1.95×", "graph", "speedup", XG, 1.95,
      where=W2P, unit="×"),
    T("graph_dispatch", "host ms per step ≤ 12 at batch 32 (xpool_graph; thread CPU time of a step started on an "
      "idle device)", "graph", "dispatch_ms_per_step", XG, 12.0, False, where=dict(mode="single", batch=32),
      fmt="{:.2f}", unit=" ms", bound="host"),
    T("graph_tps", "one GPU, batch 32: xpool_graph ≥ 91.2k tokens/s", "graph", "tokens_per_s", XG, 91.2,
      where=dict(mode="single", batch=32), **K),
    T("graph_vs_cupy", "one GPU, batch 32: xpool_graph ≥ 1.00× CuPy MemoryPool, eager (tokens/s)", "graph",
      "tokens_per_s", XG, 1.0, where=dict(mode="single", batch=32), ref=dict(allocator=CP), unit="×"),
    T("graph_busy", "one GPU, batch 4: GPU busy ≥ 70% (xpool_graph; NVML over {steps}-step windows)", "graph",
      "gpu_util_mean", XG, 70.0, where=dict(mode="single", batch=4), **PCT),
    T("graph_mallocs", "device mallocs per step after warm-up, every graph run, private pools included (worst: {at})",
      "graph", "device_mallocs_per_step", ("cupy_pool_graph", XG), 0.0, False,
      over=("allocator", "mode", "world", "batch"), fmt="{:.2g}", exact=True),
    # dynamic shapes (issue #22)
    *_dynamic(),
    # the reserve recipe on the ResNets at varying sizes (python -m xlab.bench.reserve): not the default's targets,
    # which stay above; what a program that knows its peak can do with the public API
    T("reserve_ror", "#22, ResNets at varying image sizes through enable_torch()'s pool with 1.03× the peak reserved "
      "before the first step (pool.reserve before or after the model is built, and by hand): peak reserved / peak "
      "requested ≤ 1.05 (every seed; worst: {at})", "reserve_probe.csv",
      "reserved_over_requested", None, 1.05, False, where=dict(frac=1.03), over=("workload",), stat="max",
      fmt="{:.4f}", exact=True, bound="—"),
    T("reserve_calls", "#22, the same: device calls in steady state = 0 (every seed; worst: {at})", "reserve_probe.csv",
      "steady_calls", None, 0.0, False, where=dict(frac=1.03), over=("workload",), stat="max", fmt="{:.0f}",
      exact=True, bound="—"),
    T("reserve_ms", "#22, the same: ms per step with the reserve ≤ without (paired by seed; worst: {at})",
      "reserve_probe.csv", "ms_per_step", None, 1.0, False, where=dict(frac=1.03), ref=dict(frac=0.0, when="none"),
      over=("workload", "when"), fmt="{:.3f}", unit="×"),
    T("reserve_calls_plain", "the same without the reserve: device calls in steady state, by workload (every seed)",
      "reserve_probe.csv", "steady_calls", None, where=dict(frac=0.0), over=("workload",), pick="each", stat="max",
      fmt="{:.0f}", exact=True, bound="—"),
    # correctness
    T("gate", "transparency gate: every allocator bit-identical to raw cudaMalloc (checks passing)", "correctness",
      "passed", None, 1.0, where=dict(gate=True), stat="all", exact=True, bound="—"),
    # numbers the headlines quote (no goal)
    T("cpu_checks", "CPU checks passing", "correctness", "passed", None, where=dict(device="cpu"), stat="all"),
    T("gpu_checks", "GPU checks passing", "correctness", "passed", None, where=dict(device="gpu"), stat="all"),
    *(T(f"us64_{a}", f"{a} µs per pair at 64 KiB", "alloc_size", "us_per_pair", a, where=dict(size_bytes=65536),
        unit=" µs") for a in (X, CP, "cupy_torch", "cupy_async", "raw", "c_noop")),
    T("hit_best", "CuPy's time / xpool's, best size", "alloc_size", "ratio_vs_cupy_pool", X, over=("size_bytes",),
      pick="best", unit="×"),
    *(T(f"us4_{a}", f"{a} µs per pair at 4 KiB", "alloc_size", "us_per_pair", a, where=dict(size_bytes=4096),
        unit=" µs") for a in ("raw", "raw_held")),
    *(T(f"k8_{a}", f"{a} thousand pairs/s, 8 threads", "alloc_threads", "kpairs_per_s", a,
        where=dict(threads=8, size_bytes=65536), fmt="{:.0f}", unit="k") for a in (X, CP, "raw")),
    T("k8_ratio", "CuPy's time / xpool's, 8 threads", "alloc_threads", "ratio_vs_cupy_pool", X,
      where=dict(threads=8, size_bytes=65536), unit="×"),
    T("tps_32_all", "xpool tokens/s, batch 32", "single_gpu", "tokens_per_s", X, where=dict(batch=32), fmt="{:,.0f}"),
    T("mallocs_raw", "raw device mallocs per step, batch 32", "single_gpu", "device_mallocs_per_step", "raw",
      where=dict(batch=32), fmt="{:.0f}", exact=True),
    T("ror_32_cupy", "CuPy's pool's peak reserved / requested, batch 32", "single_gpu", "reserved_over_requested", CP,
      where=dict(batch=32), fmt="{:.3f}", exact=True),
    T("ddp_threads_vs_cupy", "xpool's tokens/s over CuPy's pool's, one thread per GPU, 2 GPUs", "ddp",
      "tokens_per_s", X, where=W2T, ref=dict(allocator=CP), unit="×"),
    T("ddp_threads_cupy", "CuPy's pool's speedup, one thread per GPU, 2 GPUs", "ddp", "speedup", CP, where=W2T,
      unit="×"),
    *(T(f"peer_us_{a}", f"µs per one-page miss of the expandable scheme, peer_access {a!r}, on two GPUs",
        "peer_map_cost.csv", "s_per_miss", None, where=dict(peer_access=a), scale=1e6, fmt="{:.0f}", unit=" µs",
        bound="host") for a in ("all", "none")),
    T("peer_cost", "a one-page miss with the other GPU given access over one without (paired by trial)",
      "peer_map_cost.csv", "s_per_miss", None, where=dict(peer_access="all"), ref=dict(peer_access="none"),
      unit="×", bound="host"),
    T("ddp_raw_threads_all", "raw speedup, threads", "ddp", "speedup", "raw", where=W2T, unit="×"),
    T("sweep", "xpool speedup by batch, threads, 2 GPUs", "batch_sweep", "speedup", X, where=W2T, over=("batch",),
      pick="each", unit="×"),
    T("sweep_graph", "xpool_graph speedup by batch, threads, 2 GPUs", "batch_sweep", "speedup", XG, where=W2T,
      over=("batch",), pick="each", unit="×"),
    T("graph_dispatch_eager", "xpool eager dispatch ms, batch 32, graph runs", "graph", "dispatch_ms_per_step", X,
      where=dict(mode="single", batch=32), **MS),
    T("graph_threads_x", "xpool speedup beside the graph arms", "graph", "speedup", X, where=W2T, unit="×"),
    T("graph_busy_x", "xpool (eager) GPU busy at batch 4, graph runs", "graph", "gpu_util_mean", X,
      where=dict(mode="single", batch=4), **PCT),
    T("waste", "size-class waste by k (seed scheme)", "memory_waste.csv", "class_waste_pct", None, over=("k",),
      pick="each", fmt="{:.2g}", unit="%", exact=True),
    T("waste_peak", "peak reserved / requested by k (seed scheme)", "memory_waste.csv", "reserved_over_requested", None,
      over=("k",), pick="each", fmt="{:.2f}", unit="×", exact=True),
    T("varlen_cupy", "CuPy's pool, varying lengths", "memory_varlen.csv", "reserved_over_requested", CP, fmt="{:.3f}",
      exact=True),
    *(T(f"dyn_h_ror{k}", f"xpool's default{label}: peak reserved / requested by dynamic workload", DYN,
        "reserved_over_requested", arm, where=dict(dynamic=True, framework=f), over=("workload",), pick="each",
        fmt="{:.3f}", exact=True) for k, label, arm, f in DEFAULT_ARMS),
    T("dyn_h_expandable", "the same, PyTorch's expandable segments", DYN, "reserved_over_requested",
      "torch_expandable", where=dict(dynamic=True), over=("workload",), pick="each", fmt="{:.3f}", exact=True),
    # the held-out PyTorch workloads (data/dynamic_heldout.csv): the default, "growth" and PyTorch's expandable segments
    *(T(f"dyn_ho{k}{m}", f"held-out PyTorch workloads, {who}: {what}, by workload", DYN_HELD_OUT, metric, arm,
        over=("workload",), pick="each", fmt=fmt, exact=True)
      for k, who, arm in (("", f"xpool's default for PyTorch ({XDT})", XDT),
                          ("_growth", "xpool, release_on_miss growth", "xpool_expandable_growth"),
                          ("_expandable", "PyTorch's expandable segments", "torch_expandable"))
      for m, what, metric, fmt in (("_ror", "peak reserved / requested", "reserved_over_requested", "{:.3f}"),
                                   ("_calls", "device calls per step in steady state", "device_calls_per_steady_step",
                                    "{:.3g}"))),
    *(T(f"dyn_h_calls{k}", f"xpool's default{label}: device calls per step in steady state, by dynamic workload", DYN,
        "device_calls_per_steady_step", arm, where=dict(dynamic=True, framework=f), over=("workload",), pick="each",
        fmt="{:.3g}", exact=True) for k, label, arm, f in DEFAULT_ARMS),
    *(T(f"dyn_h_calls_timed{k}", f"xpool's default{label}: device calls per timed step, by dynamic workload", DYN,
        "device_calls_per_step", arm, where=dict(dynamic=True, framework=f), over=("workload",), pick="each",
        fmt="{:.3g}", exact=True) for k, label, arm, f in DEFAULT_ARMS),
    *(T(f"dyn_h_peak_step{k}", f"the step of the demand's last new high under xpool's default{label}, by dynamic "
        "workload", DYN, "demand_peak_step", arm, where=dict(dynamic=True, framework=f), over=("workload",),
        pick="each", fmt="{:.0f}", exact=True) for k, label, arm, f in DEFAULT_ARMS),
    *(T(f"dyn_h_{k}{m}", f"the expandable scheme{label}: {what}, by dynamic workload", DYN, metric, f"xpool_{n}",
        where=dict(dynamic=True), over=("workload",), pick="each", fmt=fmt, exact=True)
      for k, n, label in (("xe", "expandable", ""), ("xe_bounded", "expandable_bounded", ", release_on_miss bounded"),
                          ("xe_growth", "expandable_growth", ", release_on_miss growth"),
                          ("xe_until_churn", "expandable_until_churn", ", release_on_miss until_churn"),
                          ("xe_peak", "expandable_peak", ", release_on_miss peak"))
      for m, what, metric, fmt in (("", "peak reserved / requested", "reserved_over_requested", "{:.3f}"),
                                   ("_calls", "device calls per step in steady state", "device_calls_per_steady_step",
                                    "{:.2g}"))),
    *(T(f"dyn_h_ms{k}", f"xpool's default{label}: ms per step / the fastest peer's, by workload", DYN, "ms_per_step",
        arm, higher=False, where=dict(framework=f), ref=dict(allocator=PEERS), over=("workload",), pick="each",
        unit="×") for k, label, arm, f in DEFAULT_ARMS),
    T("torch_step", "PyTorch's training step, xpool / PyTorch's allocator (tokens/s)", "torch_interop.csv", "value", X,
      where=dict(case="train_step"), ref=dict(arm="torch"), unit="×"),
    T("torch_empty", "torch.empty+del, PyTorch's allocator's time / xpool's, by size", "torch_interop.csv", "value",
      "torch", where=dict(case="empty_del"), ref=dict(arm=X), over=("size_bytes",), pick="each", unit="×"),
)
BY_KEY = {t.key: t for t in TARGETS}


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

    def __format__(self, spec: str) -> str:
        r = self.row
        if self.each:
            return ", ".join(f"{m.at}: {m:{spec}}" for m in self.each)
        if r.stat == "all":
            return "n/a" if not self.n else f"{round(self.value * self.n)} of {self.n}"
        return iv.fmt_ci(self.value, self.lo, self.hi, spec or r.fmt, r.unit, self.goal, exact=self._exact)

    @property
    def _exact(self) -> bool:
        """Judged on its value: a statistic that is not a median, or a row marked exact (a count, a replay's bytes)
        whose trials agree; one whose trials differ (the dynamic benchmark's realizations) is judged on its interval."""
        return self.row.stat != "median" or (self.row.exact and not self.hi - self.lo > 1e-6 * abs(self.value))

    @property
    def verdict(self) -> str:
        if self.goal is None:
            return ""
        return iv.judge(self.value, self.lo, self.hi, self.goal, self.row.higher, exact=self._exact)


def _group_label(keys, values) -> str:
    return ", ".join(iv.fmt_bytes(v) if k == "size_bytes" else f"k = {v}" if k == "k" else
                     str(v) if k in ("allocator", "arm", "mode", "workload") else f"{k} {v}"
                     for k, v in zip(keys, values))


def _value(r: T, mine: pd.DataFrame, ref: pd.DataFrame | None):
    """(value, lo, hi, n) of a row's statistic over the selected rows (and their reference)."""
    v = mine[r.metric].astype(float) * r.scale
    if r.stat == "all":
        return float(v.mean()) if len(v) else math.nan, math.nan, math.nan, len(v)
    if r.stat in ("max", "min"):
        return (float(getattr(v, r.stat)()) if len(v) else math.nan), math.nan, math.nan, len(v)
    if ref is None:
        return iv.median_ci(v)
    a = mine.groupby("trial")[r.metric].median() if "trial" in mine else v.reset_index(drop=True)
    b = ref.groupby("trial")[r.metric].median() if "trial" in ref else ref[r.metric].reset_index(drop=True)
    common = a.index.intersection(b.index)
    return iv.ratio_ci(a.loc[common].to_numpy(float), b.loc[common].to_numpy(float))


def _bound(r: T, *frames) -> str:
    if r.bound or r.exact or r.stat != "median":
        return r.bound or "—"
    bounds = []
    for f in frames:
        if f is not None and "bound" in f and f["bound"].notna().any():
            bounds.append((sources.arm_column(f) and f[sources.arm_column(f)].iloc[0], f["bound"].mode().iloc[0]))
    if len({b for _, b in bounds}) > 1:
        return ", ".join(f"{a} {b}" for a, b in bounds)
    return bounds[0][1] if bounds else "—"


def _one(r: T, df: pd.DataFrame, col: str | None, group: dict) -> Measured | None:
    """The row measured on one CSV's rows, one group of `over`; None when the rows are not there."""
    arms = (r.arm,) if isinstance(r.arm, str) else r.arm
    mine = sources.select(df, {**r.where, **group})
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
            ref = ref[ref[col] == iv.best(ref, r.metric, col, r.higher)]
    if not len(mine) or r.metric not in mine or mine[r.metric].isna().all():
        return None
    if r.ref and col in r.ref and set(mine[col]) <= {r.ref[col]}:
        return None                                   # the reference over itself
    m = Measured(r, *_value(r, mine, ref), src=sources.sources(mine), where=sources.where(mine),
                 bound=_bound(r, mine, ref), ref=ref[col].iloc[0] if ref is not None and col in ref else "",
                 steps="/".join(str(int(s)) for s in pd.unique(mine["steps"].dropna())) if "steps" in mine else "")
    if isinstance(r.goal, dict):
        g = sources.select(df, {**r.where, **group, **r.goal})[r.metric].dropna()
        if not len(g):
            return None
        m.goal = float(g.median() * r.scale)
        m.goal_text = iv.fmt_ci(m.goal, math.nan, math.nan, r.fmt, r.unit, exact=True)
    else:
        m.goal = r.goal
    return m


def measure(r: T, data: pathlib.Path, history: bool = False) -> list[Measured]:
    """A row measured on the newest CSV of its lineage with its rows ([] if none); history: on each older one."""
    parts = sources.frames(data, r.kind)[::-1]
    if not parts:
        return []
    col = sources.arm_column(parts[0])
    groups = [()]
    if r.over and all(c in p for p in parts for c in r.over):
        groups = sorted({tuple(x) for p in parts for x in p[list(r.over)].drop_duplicates().itertuples(index=False)})
    per_group = []
    for g in groups:
        found = [m for p in parts for m in [_one(r, p, col, dict(zip(r.over, g)))] if m is not None]
        for m in found:
            m.at = _group_label(r.over, g)
        if found:
            per_group.append(found)
    if not per_group:
        return []
    if not history:
        return [_combine(r, [f[0] for f in per_group])]
    depth = max(len(f) for f in per_group)
    return [_combine(r, [f[i] for f in per_group if len(f) > i]) for i in range(1, depth)]


def _combine(r: T, level: list[Measured]) -> Measured:
    """One Measured of a row from its groups: the worst (or best) group, or all of them (`each`)."""
    if len(level) == 1 and not r.over:
        return level[0]
    if r.pick == "each":
        m = dataclasses.replace(level[0], each=level)
        m.src = "; ".join(dict.fromkeys(x.src for x in level))
        return m
    return (min if (r.pick == "worst") == r.higher else max)(level, key=lambda m: m.value)


def judged(data: pathlib.Path) -> tuple[list[Measured], list[Measured]]:
    """(every target measured on its newest data, every target measured on older data: the history)."""
    now, then = [], []
    for r in TARGETS:
        if r.goal is None:
            continue
        got = measure(r, data)
        now += got
        then += measure(r, data, history=True) if got else []
    return now, then


def values(data: pathlib.Path) -> dict:
    """{key: Measured} of every row measured on its newest data (what the headlines' template reads)."""
    return {r.key: got[0] for r in TARGETS if (got := measure(r, data))}


def text(m: Measured) -> str:
    """A target's words, its group filled in and its goal's value when the goal is another arm's."""
    t = m.row.text.replace("{at}", m.at or "—").replace("{steps}", m.steps or "?").replace("{ref}", m.ref or "—")
    return t + (f" ({m.goal_text})" if m.goal_text else "")


def table(rows: list[Measured]) -> list[str]:
    """Markdown: one line per judged target, with the CSV and commit its value came from."""
    out = [f"| {text(m)} | {m} | {'**missed**' if m.verdict == iv.MISSED else m.verdict} | {m.bound} | {m.src} |"
           for m in rows]
    return ["| target | measured | verdict | bound | data |", "|---|---|---|---|---|"] + out if out else []


def counts(rows: list[Measured]) -> dict:
    """How many targets are met, missed, within noise, or single runs."""
    v = [m.verdict for m in rows]
    return {"targets": len(v), "met": v.count(iv.MET), "missed": v.count(iv.MISSED), "noise": v.count(iv.NOISE),
            "single": sum(x.startswith(iv.SINGLE) for x in v)}
