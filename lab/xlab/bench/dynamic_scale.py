"""Dynamic shapes at the scale users run them, and under a memory cap (issue #46): each dynamic workload of
xlab.bench.dynamic grown to a peak requested of 33-40 GiB (SCALED, Note [Scaled workloads]: both in xlab/shared.py),
under every peer and xpool scheme, trial t on seed + t. One process per (framework, arm, trial), in an order rotated
by the trial, runs for each of its workloads the uncapped run, whose row goes to data/dynamic_scale.csv and whose
peak requested sets the caps, then a run under each cap (1.05x, 1.10x, 1.25x that peak), stopped by its first
out-of-memory error, into data/memory_cap.csv: which allocator finishes the job. How each allocator is capped:
Note [Memory caps] in xlab/allocators.py; how the runs are cut, and what they cost on an H200: Note [Scaled runs].

    python -m xlab.bench.dynamic_scale                  # every scaled workload and arm, 5 trials: both CSVs
    python -m xlab.bench.dynamic_scale --estimate       # the scaled sizes and the peaks the committed rows predict
    python -m xlab.bench.dynamic_scale --quick          # 1 trial, 2 timed steps after 1 warm-up step: a smoke test
    python -m xlab.bench.dynamic_scale --workloads torch_varlen --caps 1.1      # a piece (a rerun resumes)
    python -m xlab.bench.dynamic_scale --cpu --out build/s.csv --cap-out build/c.csv    # the code, on a CPU

The rows' `scale` is the factor over the benchmark's size (its batch; cupy_mix: its arrays), `is_default` whether
the arm is what a user of that front end gets from xpool by default (xlab.shared.default_arm). Their summaries, for
the report and notebook 06, are the analysis floor's (xlab.summaries: `python -m xlab.summaries scale CSV CAP_CSV`).
measure is run for a notebook: the scaled rows returned, the cap rows written beside them.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import inspect
import math
import numbers
import pathlib
import sys
import time
import traceback
from dataclasses import dataclass
from functools import partial

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

from xlab import allocators as registry
from xlab.paths import data_dir, write_csv
from xlab.provenance import git_commit, gpu_info, provenance
from xlab.shared import AT_LEAST, GIB, SCALE_TRIALS, SCALED, Scaled, default_arm  # noqa: F401 - the module's names

from . import dynamic
from . import dynamic_workloads as wl
from .alloc import rotated

CAPS = (1.05, 1.10, 1.25)
TRIALS, SEED = SCALE_TRIALS, 0
OUT, CAP_OUT = "data/dynamic_scale.csv", "data/memory_cap.csv"
QUICK = dict(trials=1, steps=2, warmup=1)
SCALE_COLUMNS = dynamic.COLUMNS + ["scale", "is_default"]
SCALE_KEYS = dynamic.KEYS
CAP_COLUMNS = ["trial", "workload", "framework", "allocator", "is_default", "cap_over_peak_requested", "cap_bytes",
               "peak_requested_bytes", "completed", "oom", "steps_done", "device_calls_per_step",
               "device_calls_per_steady_step", "ms_per_step", "host_ms_per_step", "gpu_util_mean", "bound",
               "peak_reserved_bytes", "reserved_at_start_bytes", "steps", "warmup", "seed", "scale", "position",
               "oom_error"]
CAP_KEYS = ("trial", "workload", "allocator", "cap_over_peak_requested", "steps", "warmup", "seed", "commit")
TIMED = ("device_calls_per_step", "device_calls_per_steady_step", "ms_per_step", "host_ms_per_step", "gpu_util_mean")


# Note [Scaled runs]
# Steps: a model's first step has its largest shape, so its demand is within 0.5% of its peak from then on (what
# a later step at that shape adds, the optimizer's state made by the first step and the gradients kept into the
# next forward, is 0.07-0.15 GiB of 33; measured at f7709ef, dynamic_scale.csv: every model's peak within 1.3% of
# Note [Scaled workloads]'s estimate, torch_varlen's 0.3-0.4 GiB above it): 3 warm-up steps, 5 timed. cupy_mix's live set is stationary once the
# first step's results (kept up to 32 steps) are gone: 32 warm-up, 64 timed (its peaks: Note [Scaled workloads]).
# One run per (arm, workload, cap) both times and counts: its per-step probes (dynamic.steady_state) cost
# microseconds against 10-300 ms steps, where the benchmark's separate timed and counting CuPy runs would double the
# device time; NVML samples every run's timed window (`bound`).
# A process per (framework, arm, trial), as the benchmark's (Note [Dynamic-shape benchmark]): per workload the
# uncapped run, then a run under each cap, a multiple of that run's peak requested (the same for every arm of a
# trial: one realization). A CuPy arm's runs each get a fresh allocator; a PyTorch arm's share the process's, reset
# and emptied between runs. A capped run stops at its first out-of-memory error (is_oom) with the steps it finished;
# its frames, CuPy's FFT plans, cuBLAS's workspaces and the cache are freed and the next run starts. An arm that
# counts no bytes (the CPU's numpy) runs its capped runs uncapped: rows that test the code.
# Resuming: both CSVs are rewritten after each process; a rerun runs only the rows this commit lacks, a capped
# run's cap from the uncapped row where that exists.
# Device time on an H200 (estimated; to be measured): a process costs ~5 s (CuPy) to ~8 s (PyTorch) beside its runs
# (dynamic_shapes.csv: process_s minus its steps); a run ~1.2 s (cupy_mix: 96 steps of ~10 ms and its largest),
# ~1.2 s (gpt), ~0.8 s (the language model), ~1.8 s (the ResNet), less where a cap stops it; so a CuPy process
# ~15 s, a PyTorch one ~19 s, and 5 trials of 7 CuPy and 5 PyTorch arms ~17 min, two or three calls of 540 s.


def scaled(name: str) -> dynamic.Workload:
    """The benchmark's workload `name` at its SCALED size and steps (a ValueError names an unknown one)."""
    if name not in SCALED:
        raise ValueError(f"workloads: {name!r} has no scaled size; scaled workloads: {', '.join(SCALED)}")
    base, s = dynamic.WORKLOADS[name], SCALED[name]
    knob = _knob(base.fn)
    return dataclasses.replace(base, fn=partial(base.fn, **{knob: _default(base.fn, knob) * s.factor}),
                               steps=s.steps, warmup=s.warmup)


def _knob(fn) -> str:
    """The keyword that sizes a workload function: cupy_mix's `scale`, a model's `batch`."""
    return "scale" if "scale" in inspect.signature(fn).parameters else "batch"


def _default(fn, name: str):
    """What `fn` (a workload function or a partial of one) passes for keyword `name`."""
    return inspect.signature(fn).parameters[name].default


SPECS = {name: scaled(name) for name in SCALED}


# --- the sizes' estimates (Note [Scaled workloads])
def units(spec: dynamic.Workload) -> int:
    """What a workload's memory grows with, at its largest step: tokens (sequences x the longest length) for the
    language models, pixels (images x the largest side squared) for the ResNet, cupy_mix's scale."""
    fn = spec.fn
    if _knob(fn) == "scale":
        return _default(fn, "scale")
    longest = _default(fn, "hi") or _default(fn, "lo")
    return _default(fn, "batch") * longest ** (2 if fn.func is wl.resnet else 1)


def committed_peaks(folder=None) -> pd.Series:
    """The least peak requested bytes each workload of the dynamic benchmark measured (data/dynamic_shapes.csv and
    dynamic_heldout.csv), by workload."""
    folder = pathlib.Path(folder or data_dir())
    rows = pd.concat(pd.read_csv(folder / name, usecols=["workload", "peak_requested_bytes"])
                     for name in ("dynamic_shapes.csv", "dynamic_heldout.csv"))
    return rows.groupby("workload")["peak_requested_bytes"].min()


def peak_line(name: str, peaks: pd.Series) -> tuple[float, float]:
    """(bytes, bytes per unit): the least-squares line through the committed `peaks` of every benchmark workload of
    `name`'s model (its other batches and lengths: gpt_b4 and gpt_b32 beside gpt_varlen, ...) against their units.
    ValueError where they measured fewer than two sizes."""
    model = dynamic.WORKLOADS[name].fn.func
    points = [(units(s), peaks[w]) for w, s in dynamic.WORKLOADS.items()
              if getattr(s.fn, "func", None) is model and w in peaks]
    if len({u for u, _ in points}) < 2:
        raise ValueError(f"{name}: the committed rows measured its model at one size: no line")
    slope, intercept = np.polyfit(*np.array(points, dtype=float).T, 1)
    return float(intercept), float(slope)


def live_peak(timeline: pd.DataFrame, steps: int) -> int:
    """The most requested bytes live at once in a recorded trace's first `steps` steps (its step 0 holds the
    events before the first step's end)."""
    from xlab.memory_study import ALLOC_EVENTS
    ev = timeline[timeline["step"] < steps]
    sign = ev["event"].isin(ALLOC_EVENTS).astype(int) - (ev["event"] == "free").astype(int)
    return int((sign * ev["requested"]).cumsum().max())


def estimated_peak(name: str, folder=None) -> tuple[float, float]:
    """The peak requested bytes SCALED[name]'s runs should reach, (lowest, highest) over the trials' realizations,
    from the benchmark's committed measurements (Note [Scaled workloads]): a model's peak_line at its scaled units;
    cupy_fill's, its plan's (wl.plan_peak); cupy_mix's, its factor times each realization's peak within the scaled
    run's steps, from the recorded traces (data/memory_trace_dyn_cupy_mix[_s<seed>].csv.gz; its 230-step rows would
    overstate a 96-step run)."""
    spec = SPECS[name]
    if spec.fn.func is wl.cupy_fill:                    # its requests are its plan
        steps = spec.warmup + spec.steps
        peaks = [wl.plan_peak(wl.fill_plan(steps, seed, scale=SCALED[name].factor))
                 for seed in range(SEED, SEED + TRIALS)]
        return min(peaks), max(peaks)
    if _knob(spec.fn) == "scale":
        from xlab.memory_study import dyn_trace
        steps = spec.warmup + spec.steps
        peaks = [live_peak(dyn_trace(name + (f"_s{seed}" if seed else ""), folder), steps)
                 for seed in range(SEED, SEED + TRIALS)]
        return SCALED[name].factor * min(peaks), SCALED[name].factor * max(peaks)
    intercept, slope = peak_line(name, committed_peaks(folder))
    return (intercept + slope * units(spec),) * 2


def estimates(folder=None) -> pd.DataFrame:
    """The scaled workloads: factor, size (its batch, cupy_mix's scale), units, steps and estimated peak requested
    GiB (lowest and highest over the realizations)."""
    rows = []
    for name, s in SCALED.items():
        lo, hi = estimated_peak(name, folder)
        spec = SPECS[name]
        knob = _knob(spec.fn)
        rows.append(dict(workload=name, scale=s.factor, knob=knob, size=_default(spec.fn, knob), units=units(spec),
                         warmup=s.warmup, steps=s.steps, peak_requested_gib_low=lo / GIB,
                         peak_requested_gib_high=hi / GIB))
    return pd.DataFrame(rows)


# --- arms and caps
def is_default(arm: str, framework: str) -> bool:
    """Whether `arm` runs xpool as `framework`'s front end does by default (the `xpool` arm too where its scheme is
    that one). A peer never is, its own library's default or not: the question is xpool's default."""
    try:
        return registry.arm(arm).kwargs == registry.arm(default_arm(framework)).kwargs
    except ValueError:
        return False


def resolve(workloads=None, arms=None, cpu: bool = False) -> tuple[list, dict]:
    """(scaled workloads, {framework: arms}), None for all (dynamic.arms_for); rmm_pool is skipped with a message
    where RMM is not installed. ValueError naming `workloads` or `arms`."""
    workloads = list(workloads or SCALED)
    bad = [w for w in workloads if w not in SCALED]
    if bad:
        raise ValueError(f"workloads: unknown {', '.join(map(str, bad))}; scaled workloads: {', '.join(SCALED)}")
    per = dynamic.arms_for(dict.fromkeys(SPECS[w].framework for w in workloads), arms, cpu)
    if "rmm_pool" in per.get("cupy", ()) and importlib.util.find_spec("rmm") is None:
        print("skipping rmm_pool: RMM is not installed (pip install rmm-cu13)")
        per = {f: tuple(a for a in these if a != "rmm_pool") for f, these in per.items()}
    per = {f: these for f, these in per.items() if these}
    if not per:
        raise ValueError(f"arms: none of {', '.join(arms or ())} runs the workloads {', '.join(workloads)}")
    return workloads, per


def check_caps(caps) -> tuple[float, ...]:
    """`caps` as floats, each a number > 1 (a multiple of the uncapped run's peak requested: at 1 or under, no
    allocator can finish); ValueError naming `caps` otherwise."""
    try:
        items = tuple(caps)
    except TypeError:
        items = (caps,)
    if any(isinstance(c, bool) or not isinstance(c, numbers.Real) or not math.isfinite(c) or c <= 1 for c in items):
        raise ValueError(f"caps must be numbers > 1 (multiples of the peak requested), got {caps!r}")
    return tuple(float(c) for c in dict.fromkeys(items))


def cap_bytes(peak_requested, over: float) -> int:
    """The cap `over` times a run's peak requested bytes, in whole bytes; 0 (none) where it counted no bytes."""
    if peak_requested is None or not math.isfinite(peak_requested) or peak_requested <= 0:
        return 0
    return int(over * peak_requested)


def is_oom(error: BaseException) -> bool:
    """Whether `error` is an allocator refusing memory: a MemoryError (CuPy's and xpool's OutOfMemoryError, RMM's
    out_of_memory, a sort's std::bad_alloc through CuPy's thrust allocator), PyTorch's OutOfMemoryError, or the
    RuntimeError PyTorch makes of xpool's (xpool/_torch.c: its message names it)."""
    torch = sys.modules.get("torch")
    return (isinstance(error, MemoryError)
            or (torch is not None and isinstance(error, torch.cuda.OutOfMemoryError))
            or (isinstance(error, RuntimeError) and "xpool: out of memory" in str(error)))


# --- one process: one arm's runs
@dataclass(frozen=True)
class Todo:
    """One workload of one process: its uncapped run (unless done: then the caps take `peak_requested`, that run's
    bytes from the CSV), and a run under each of `caps`."""
    workload: str
    uncapped: bool
    peak_requested: float
    caps: tuple


@dataclass(frozen=True)
class Outcome:
    """One run: dynamic.measure's dict (None: an out-of-memory error stopped it), the steps it finished, that
    error's first line, the allocator's peak reserved bytes and what it held at the start."""
    run: dict | None
    steps_done: int
    oom_error: str
    peak_reserved: float
    at_start: float


def attempt(alloc, workload, opts, sync, at_start: float) -> Outcome:
    """One run of `workload` that times and counts (Note [Scaled runs]), or the steps it finished before an
    out-of-memory error and the peak reserved so far; any other error is raised."""
    probes = []
    try:
        run = dynamic.measure(alloc, workload, opts, sync, probe=True, probes=probes)
    except Exception as e:                   # noqa: BLE001 - only an out-of-memory error is a result
        if not is_oom(e):
            raise
        reserved = alloc.peak_reserved(0)
        return Outcome(None, len(probes), str(e).strip().split("\n")[0][:300],
                       math.nan if reserved is None else reserved, at_start)
    return Outcome(run, len(probes), "", run["reserved"], at_start)


class CupyRuns:
    """A CuPy arm's runs in one process: each on a fresh allocator, capped before install, then released with
    CuPy's FFT plans (their work areas are the allocator's)."""

    def __init__(self, arm, opts):
        self.arm, self.opts = arm, opts
        self.sync = lambda: None
        if opts["gpu"]:
            import cupy
            self.sync = cupy.cuda.Device().synchronize

    def run(self, workload, cap: int) -> Outcome:
        alloc, gpu = registry.make(self.arm), self.opts["gpu"]
        alloc.set_limit(cap)
        alloc.install(counting=True)
        try:
            out = attempt(alloc, workload, self.opts, self.sync, 0)
            dynamic.check_torch_setting(alloc, self.arm, gpu)     # cupy_torch_expandable: before its cache goes
        finally:
            alloc.uninstall()
            if gpu:
                import cupy
                cupy.fft.config.get_plan_cache().clear()
            gc.collect()
            alloc.release([0])
        return out


class TorchRuns:
    """A PyTorch arm's runs in one process: its one allocator (PyTorch keeps its first), capped and reset before
    each run, emptied after."""

    def __init__(self, arm, opts):
        import torch
        self.arm, self.opts, self.alloc = arm, opts, dynamic.torch_allocator(arm)
        self.sync = torch.cuda.synchronize if opts["gpu"] else (lambda: None)

    def run(self, workload, cap: int) -> Outcome:
        gpu = self.opts["gpu"]
        at_start = dynamic.torch_reset(self.alloc, gpu)
        self.alloc.set_limit(cap)
        try:
            out = attempt(self.alloc, workload, self.opts, self.sync, at_start)
            dynamic.check_torch_setting(self.alloc, self.arm, gpu)
        finally:
            dynamic.torch_empty(self.alloc, gpu)
        return out


def arm_process(framework, arm, todo, trial, position, opts) -> tuple[list, list]:
    """Run `arm` over its Todos in this process: (scaled rows, cap rows), with provenance."""
    opts, t0 = dynamic.for_trial(opts, trial), time.perf_counter()
    runs = (CupyRuns if framework == "cupy" else TorchRuns)(arm, opts)
    scale_rows, cap_rows = [], []
    for item in todo:
        w, peak = item.workload, item.peak_requested
        if item.uncapped:
            out = runs.run(w, 0)
            if out.run is None:
                raise RuntimeError(f"{arm} ran out of memory on {w} without a cap: {out.oom_error}")
            scale_rows.append(scale_row(trial, position, w, arm, out, opts))
            peak = out.run["requested"]
        for over in item.caps:
            cap = cap_bytes(peak, over)
            cap_rows.append(cap_row(trial, position, w, arm, over, cap, peak, runs.run(w, cap), opts))
    common = dict(**dynamic.library_versions(), process_s=round(time.perf_counter() - t0, 2), start=opts["start"])
    return ([{**r, **provenance(experiment="dynamic_scale", **common)} for r in scale_rows],
            [{**r, **provenance(experiment="memory_cap", **common)} for r in cap_rows])


def scale_row(trial, position, workload, arm, out: Outcome, opts) -> dict:
    """An uncapped run's row: the dynamic benchmark's columns (dynamic.build_row), then `scale` and `is_default`."""
    return {**dynamic.build_row(trial, position, workload, arm, out.run, out.run, out.at_start, opts),
            "scale": SCALED[workload].factor, "is_default": is_default(arm, dynamic.spec_of(workload, opts).framework)}


def cap_row(trial, position, workload, arm, over, cap, peak, out: Outcome, opts) -> dict:
    """A capped run's row (CAP_COLUMNS): whether it finished, the steps it did, and, where it finished, its device
    calls, time and what bounds it; the peak reserved bytes either way, and what the allocator still held when the
    run began (a PyTorch arm's: what the runs before it left)."""
    framework, (steps, warmup, seed) = dynamic.spec_of(workload, opts).framework, dynamic.run_settings(workload, opts)
    done = out.run is not None
    timed = dynamic.build_row(trial, position, workload, arm, out.run, out.run, out.at_start, opts) if done else {}
    return dict(trial=trial, workload=workload, framework=framework, allocator=arm,
                is_default=is_default(arm, framework), cap_over_peak_requested=over, cap_bytes=cap or math.nan,
                peak_requested_bytes=peak, completed=done, oom=not done, steps_done=out.steps_done,
                **{k: timed.get(k, math.nan) for k in TIMED}, bound=timed.get("bound", ""),
                peak_reserved_bytes=out.peak_reserved, reserved_at_start_bytes=out.at_start, steps=steps,
                warmup=warmup, seed=seed,
                scale=SCALED[workload].factor, position=position, oom_error=out.oom_error)


# --- the run
def plan(trials, workloads, per_framework, caps, opts, done=None, done_caps=frozenset(),
         commit="") -> tuple[list, set, set]:
    """The run's processes in order, (framework, arm, [Todo], trial, position): each (framework, arm) once a trial,
    in an order rotated by the trial; and the keys of every scaled row (SCALE_KEYS) and cap row (CAP_KEYS) the run
    wants. done: {a scaled row's key: its peak requested bytes} of the rows measured; done_caps: the cap rows' keys."""
    done, pairs = done or {}, [(f, a) for f, arms in per_framework.items() for a in arms]
    jobs, wanted, wanted_caps = [], set(), set()
    for t in range(trials):
        o = dynamic.for_trial(opts, t)
        for pos, (f, a) in enumerate(rotated(pairs, t)):
            todo = []
            for w in (w for w in workloads if dynamic.spec_of(w, o).framework == f):
                steps, warmup, seed = dynamic.run_settings(w, o)
                key = _key((t, w, a, steps, warmup, seed, dynamic.pinned(o), commit))
                cap_keys = {c: _key((t, w, a, c, steps, warmup, seed, commit)) for c in caps}
                wanted.add(key)
                wanted_caps |= set(cap_keys.values())
                missing = tuple(c for c, k in cap_keys.items() if k not in done_caps)
                if key not in done or missing:
                    todo.append(Todo(w, key not in done, done.get(key, math.nan), missing))
            if todo:
                jobs.append((f, a, todo, t, pos))
    return jobs, wanted, wanted_caps


def _key(values) -> tuple:
    return tuple(str(v) for v in values)


def _keys(df: pd.DataFrame, keys) -> list:
    return [_key(r) for r in df.reindex(columns=keys).itertuples(index=False)] if "commit" in df else []


def _read(out, fresh: bool) -> pd.DataFrame:
    return pd.read_csv(out) if out and pathlib.Path(out).is_file() and not fresh else pd.DataFrame()


def _appended(old: pd.DataFrame, rows: list, columns: list) -> pd.DataFrame:
    """`old` with `rows` after it, `columns` first."""
    if not rows:
        return old
    df = pd.DataFrame(rows) if old.empty else pd.concat([old, pd.DataFrame(rows)], ignore_index=True)
    return df[columns + [c for c in df if c not in columns]]


def run(workloads=None, arms=None, trials: int = TRIALS, caps=CAPS, steps: int | None = None,
        warmup: int | None = None, seed: int = SEED, out=OUT, cap_out=CAP_OUT, fresh: bool = False, cpu: bool = False,
        start: str = "fork", progress: bool = True) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Measure every scaled row `out` and cap row `cap_out` lack for this commit and these settings (fresh: discard
    them), both rewritten after each process; (this run's scaled rows, its cap rows), attrs["failed"]: arms that
    raised. steps, warmup: None for each workload's own; cpu: NumPy and PyTorch's CPU under arm 'numpy' (tests the
    code); start: "fork" or "spawn"; trial t runs on seed + t."""
    for name, v in (("trials", trials), ("steps", steps), ("warmup", warmup)):
        if v is not None and not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            raise ValueError(f"{name} must be a whole number >= 1, got {v!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a whole number >= 0, got {seed!r}")
    caps = check_caps(caps)
    workloads, per_framework = resolve(workloads, arms, cpu)
    opts = dict(steps=steps, warmup=warmup, seed=seed, gpu=not cpu, small=cpu, start=start, specs=SPECS)
    if not cpu and dynamic.in_process(gpu_info, start=start)["n_gpus"] < 1:   # asked in a child: no CUDA here
        raise registry.NoGPU("xlab.bench.dynamic_scale needs a CUDA GPU (none visible; --cpu runs the code on the CPU)")
    old, old_caps, commit = _read(out, fresh), _read(cap_out, fresh), git_commit()
    done = dict(zip(_keys(old, SCALE_KEYS), old.get("peak_requested_bytes", ())))
    jobs, wanted, wanted_caps = plan(trials, workloads, per_framework, caps, opts, done,
                                     set(_keys(old_caps, CAP_KEYS)), commit)
    for name in ("cupy",) * (not cpu) + ("torch",) * ("torch" in per_framework):
        __import__(name)                     # imported once, before the forks (neither starts CUDA)
    tqdm.monitor_interval = 0                # no monitor thread in a process that forks
    failed = []
    for f, a, todo, t, pos in (bar := tqdm(jobs, desc="dynamic_scale", disable=not progress)):
        bar.set_postfix_str(f"trial {t} {a}")
        try:
            rows, cap_rows = dynamic.in_process(arm_process, f, a, todo, t, pos, opts, start=start)
        except Exception as e:               # noqa: BLE001 - reported; the other arms go on
            failed.append(a)
            print(f"\narm {a} ({', '.join(i.workload for i in todo)}, trial {t}) failed:",
                  *traceback.format_exception(e), file=sys.stderr)
            continue
        old, old_caps = _appended(old, rows, SCALE_COLUMNS), _appended(old_caps, cap_rows, CAP_COLUMNS)
        write_csv(old, out)
        if cap_rows:
            write_csv(old_caps, cap_out)
    mine = old[[k in wanted for k in _keys(old, SCALE_KEYS)]].reset_index(drop=True)
    mine_caps = old_caps[[k in wanted_caps for k in _keys(old_caps, CAP_KEYS)]].reset_index(drop=True)
    mine.attrs["failed"] = mine_caps.attrs["failed"] = failed
    return mine, mine_caps


def measure(out=OUT, **kwargs) -> pd.DataFrame:
    """run's scaled rows into `out`, its cap rows into memory_cap.csv beside it: what a notebook measures through
    notebook_utils.load_or_measure (one CSV a call)."""
    return run(out=out, cap_out=pathlib.Path(out).with_name(pathlib.Path(CAP_OUT).name), **kwargs)[0]


def _caps_arg(text: str) -> tuple:
    """argparse's type for --caps: comma-separated numbers > 1."""
    try:
        return check_caps(float(x) for x in text.split(",") if x.strip())
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv=None) -> int:
    """The command line; exit status 1 when an arm failed."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", help=f"comma-separated (default: all): {', '.join(SCALED)}")
    p.add_argument("--arms", help="comma-separated (default: every peer and xpool scheme)")
    p.add_argument("--trials", type=int, help=f"trials (default {TRIALS}; --quick: 1)")
    p.add_argument("--caps", type=_caps_arg, default=CAPS,
                   help=f"caps over the peak requested, comma-separated (default {','.join(map(str, CAPS))})")
    p.add_argument("--steps", type=int, help="timed steps of every workload (default: each workload's own)")
    p.add_argument("--warmup", type=int, help="warm-up steps of every workload (default: each workload's own)")
    p.add_argument("--seed", type=int, default=SEED, help=f"trial t runs on seed + t (default {SEED})")
    p.add_argument("--quick", action="store_true", help="1 trial, 2 steps after 1 warm-up step: a smoke test")
    p.add_argument("--out", default=OUT, help=f"the scaled rows' CSV (default {OUT})")
    p.add_argument("--cap-out", default=CAP_OUT, help=f"the capped rows' CSV (default {CAP_OUT})")
    p.add_argument("--fresh", action="store_true", help="discard both CSVs' rows instead of resuming")
    p.add_argument("--cpu", action="store_true", help="NumPy and PyTorch on the CPU, small models: tests the code")
    p.add_argument("--start", default="fork", choices=("fork", "spawn"), help="how the arms' processes start")
    p.add_argument("--estimate", action="store_true", help="print the scaled sizes and their estimated peaks; no run")
    a = p.parse_args(argv)
    if a.estimate:
        print(estimates().to_string(index=False))
        return 0
    kw = {k: v for k, v in (("trials", a.trials), ("steps", a.steps), ("warmup", a.warmup)) if v is not None}
    split = (lambda s: [x for x in s.split(",") if x] if s else None)   # noqa: E731
    df, caps = run(split(a.workloads), split(a.arms), caps=a.caps, seed=a.seed, out=a.out, cap_out=a.cap_out,
                   fresh=a.fresh, cpu=a.cpu, start=a.start, **{**(QUICK if a.quick else {}), **kw})
    if len(df) or len(caps):
        print(f"{len(df)} rows in {a.out}, {len(caps)} in {a.cap_out}: `python -m xlab.summaries scale {a.out} "
              f"{a.cap_out}` summarises them")
    return 1 if df.attrs.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
