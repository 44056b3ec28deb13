"""Dynamic shapes (issue #22): peak reserved / peak requested, device calls per step and ms per step of every
allocator on workloads whose shapes change every step, beside fixed-shape controls. Trial t runs one process per
(framework, arm), in an order rotated by t, forked from this one (which never starts CUDA); one CSV row per (trial,
workload, arm), appended as each process ends. Why the processes are cut this way, and what steady state means:
Note [Dynamic-shape benchmark], below; what each arm counts as a device call: Note [Dynamic-shape benchmark: device
calls] in xlab/allocators.py.

    python -m xlab.bench.dynamic                     # every workload and arm, 5 trials: data/dynamic_shapes.csv
    python -m xlab.bench.dynamic --quick             # 1 trial, 3 steps: a smoke test
    python -m xlab.bench.dynamic --workloads torch_varlen,torch_fixed        # a piece (a rerun resumes)
    python -m xlab.bench.dynamic --same-seed         # every trial on the seed itself (the rows before a38a5d9)

Trial t draws its shapes, sizes and data from seed + t, the same for every arm of the trial: a trial is one more
realization of each dynamic workload, so its bytes and device calls vary between trials and are judged on their
median and interval over realizations, paired by trial against the peers (Note [Trials are realizations]).
"""
from __future__ import annotations

import argparse
import gc
import math
import os
import pathlib
import re
import sys
import time
import traceback
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from functools import partial
from importlib import metadata
from multiprocessing import get_context

import pandas as pd
from tqdm.auto import tqdm

import xpool
from xlab import allocators as registry
from xlab import shared
from xlab.experiments.runner import installed
from xlab.experiments.train import Window, step_bound   # with tapegpt: imported once, before the forks (no CUDA)
from xlab.nvml import UtilSampler
from xlab.paths import write_csv
from xlab.provenance import git_commit, gpu_info, provenance

from . import dynamic_workloads as wl
from .alloc import rotated


# Note [Dynamic-shape benchmark]
# Workloads (dynamic_workloads.py): cupy_mix, rfft (15 lengths, all in CuPy's plan cache once warm), sort, cumsum
# and fp32 matmul of sizes drawn log-uniformly up to 16 MiB, six a step, each result kept 2^U(0,5) steps (inputs are
# views of one array, so only results allocate); gpt_varlen, tapegpt's GPT at batch 16 with a length drawn in 32-256
# every step, gpt_b32 and gpt_b4 at length 256; torch_varlen, a causal pre-norm nn.TransformerEncoder (6 layers,
# 512 wide, batch 16, AdamW, bf16 autocast) at lengths in buckets of 64 up to 512, torch_fixed at 256; resnet_varres,
# a ResNet-18 written out (torchvision's layout; torchvision is not in the device image) in channels_last under bf16
# autocast with SGD, batch 32 of random images whose side is drawn in 128-224 px by 32, resnet_fixed at 224 px;
# cupy_image (issue #49), an image and volume pipeline over crops of 256-2048 px (volumes 40-161 a side) drawn every
# step: gaussian blur, Sobel edges, zoom x0.5-2 (cupyx.scipy.ndimage) and an rfftn of each, results kept 1-7 steps;
# cupy_fill (#49), 22 arrays a step of 16 KiB-16 MiB drawn log-uniformly, written and kept 2^U(0,5) steps (x64 in
# dynamic_scale: 1 MiB-1 GiB, most of a GPU). The
# held-out workloads (held_out=True) run only when named.
# Steady state: every workload's first warm-up step has its largest shape, and later shapes are new draws, never
# larger: a pool is judged on shapes it has not seen, never on one larger than it has. But where results outlive
# their step (cupy_mix) the demand keeps setting new highs long after the largest step, and a pool that grows then
# meets demand it has not met. So the counting run probes every step (steady_state: the device calls so far and the
# peak requested so far), and each row has demand_peak_step (the last step that raised the peak requested),
# steady_steps (the timed steps after it) and device_calls_per_steady_step, what "0 device calls in steady state" is
# judged on; device_calls_per_step (every timed step) stays beside it. Every CuPy arm has a second, counting run (a
# read costs microseconds inside a millisecond step); PyTorch's one run is both, at well under 1% of a step.
# Processes: PyTorch picks its allocator once per process, so each PyTorch arm needs its own, and a fresh CUDA
# context drops what libraries cache from the allocator (cuBLAS workspaces, FFT plans, the driver's async pool).
# Trial t starts one process per (framework, arm), order rotated by t, each forked from the runner, which imports
# torch, CuPy and tapegpt once and never starts CUDA (under pytest, whose conftest asks CuPy for the GPU count, use
# start="spawn"). In a process a CuPy workload gets a fresh allocator (everything released between workloads, FFT
# plans cleared); PyTorch workloads share the arm's allocator, emptied, its cuBLAS workspaces freed and its peaks
# reset between them with reset_peak_stats(history=True), so each is judged against its own demand, as a process of
# its own would be (reserved_at_start_bytes says what it still held). A process per (trial, workload, arm) would add a
# CUDA context per workload for no cleaner state. A full run (5 trials, every arm) outlasts one 10-minute device
# call, so it resumes: a rerun measures only the trials its CSV lacks.

# Note [Trials are realizations]
# Trial t draws its shapes, sizes and data from seed + t (for_trial), the same for every arm of the trial, so arms stay
# paired by trial and each trial is another realization of every workload; the rows' `seed` says which, and
# --same-seed runs every trial on the seed itself. Bytes and device calls then vary between trials as times do and
# are judged the same way: a value the trials agree on as it is, one that differs on its median and 95% interval
# (xlab.targets). Why: docs/decisions/0010-trials-are-realizations.md. The fixed-shape workloads change only their
# data with the seed. `python -m xlab.bench.dynamic_traces --seeds` records other realizations for the replays.

# Note [Pinned arms]
# Where a step is bound by the host (cupy_mix, gpt_varlen, gpt_b4, every PyTorch workload on the H200), ms per step
# has wide intervals, and the cause is the machine: on the lent H200 host (16 KVM vCPUs) the same program at the same
# shapes ran at levels of host speed that held for seconds and switched within a run, with nothing else running
# (gpt_b4 took 14.5 to 27.3 ms a step from one process to the next, host_speed_probe.csv at f8122c0); longer windows
# did not narrow it. Pinning every arm's process to
# given CPUs (--cpus, run(cpus=...): os.sched_setaffinity in the child, the rows' `pinned` part of the key, so a
# pinned run is a measurement of its own) did not halve that spread in a probe on one, two and other CPUs, so full
# runs are unpinned; the option stays for machines whose cores differ. What bounds each row: the rows carry
# host_ms_per_step (the main thread's CPU time per timed step) and gpu_util_mean (NVML over the window:
# xlab.nvml.UtilSampler, device 0 every 25 ms), and `bound` is train.step_bound's: from NVML where it was sampled,
# else from the thread time, which only a CuPy row can use (PyTorch runs backward on its autograd thread, which the
# main thread's time does not count). A counting run has no sampler. The probes' CSVs and logs (host_speed_probe.csv,
# pin_probe.csv) are in the record at tag record-2026-12-05.


@dataclass(frozen=True)
class Workload:
    framework: str     # "cupy" or "torch": which arms run it
    dynamic: bool      # its shapes change every step
    fn: object         # fn(steps, warmup, seed, window, gpu, small, after_step) -> dict(batch, shape)
    steps: int         # timed steps
    warmup: int        # untimed steps first (the first has the largest shape)
    held_out: bool = False   # not in the benchmark's default set: programs no release rule was chosen on


# How each workload of xlab.shared.WORKLOADS runs (its front end, whether its shapes change and whether it is held
# out are the shared table's): fn(steps, warmup, seed, window, gpu, small, after_step) -> dict(batch, shape), timed
# steps, warm-up steps. A workload is a row in both tables.
RUNS = {
    "cupy_mix": (wl.cupy_mix, 200, 30),
    "cupy_image": (wl.cupy_image, 60, 10),
    "cupy_fill": (wl.cupy_fill, 100, 30),
    "gpt_varlen": (partial(wl.gpt, batch=16, lo=32, hi=256), 20, 5),
    "gpt_b32": (partial(wl.gpt, batch=32, lo=256), 10, 3),
    "gpt_b4": (partial(wl.gpt, batch=4, lo=256), 20, 3),
    "torch_varlen": (partial(wl.torch_lm, lo=64, hi=512), 30, 5),
    "torch_fixed": (partial(wl.torch_lm, lo=256), 30, 5),
    "resnet_varres": (partial(wl.resnet, lo=128, hi=224), 30, 5),
    "resnet_fixed": (partial(wl.resnet, lo=224), 30, 5),
    "torch_varlen_b32": (partial(wl.torch_lm, lo=64, hi=320, batch=32, multiple=32), 30, 5),
    "torch_fixed_b32": (partial(wl.torch_lm, lo=128, batch=32), 30, 5),
    "resnet_varres_b64": (partial(wl.resnet, lo=64, hi=160, batch=64), 30, 5),
}
if set(RUNS) != set(shared.WORKLOADS):
    raise ImportError(f"xlab.bench.dynamic.RUNS and xlab.shared.WORKLOADS name other workloads: "
                      f"{sorted(set(RUNS) ^ set(shared.WORKLOADS))}")
WORKLOADS = {w: Workload(k.framework, k.dynamic, *RUNS[w], held_out=k.held_out) for w, k in shared.WORKLOADS.items()}
PEERS_ALL, PEERS = shared.DYNAMIC_PEERS, shared.DYNAMIC_PEERS_BY_FRAMEWORK
DEVICE_CALLS = ("device_mallocs", "device_frees", "device_maps", "device_unmaps")   # xpool's counters, summed
QUICK = dict(trials=1, steps=3, warmup=2)
TRIALS, SEED, OUT = 5, 0, "data/dynamic_shapes.csv"
KEYS = ("trial", "workload", "allocator", "steps", "warmup", "seed", "pinned", "commit")   # names one measurement
COLUMNS = ["trial", "workload", "dynamic", "framework", "allocator", "peak_reserved_bytes", "peak_requested_bytes",
           "reserved_over_requested", "device_calls_per_step", "device_calls", "device_calls_per_steady_step",
           "device_calls_steady", "steady_steps", "demand_peak_step", "ms_per_step", "steps", "warmup",
           "seed", "batch", "shape", "counted_in", "reserved_at_start_bytes", "position", "gc_ms_per_step",
           "host_ms_per_step", "gpu_util_mean", "bound", "pinned"]


# --- arms
def xpool_arms() -> tuple:
    """`xpool_<scheme>` for every scheme this xpool has (xpool.settings.SCHEMES); rows of the release rules xpool had
    before the freeze (`xpool_expandable_<rule>`) stay readable (xlab.allocators: legacy arms)."""
    return tuple(f"xpool_{s}" for s in xpool.settings.SCHEMES)


def resolve(workloads=None, arms=None, cpu: bool = False) -> tuple[list, dict]:
    """(workloads, {framework: arms}), None for all (the benchmark's own: not the held-out ones); an `xpool_<scheme>`
    this xpool lacks is skipped with a message, so one command line serves before and after a scheme lands.
    ValueError: an unknown name, or no arm for them."""
    workloads = list(workloads or (w for w, spec in WORKLOADS.items() if not spec.held_out))
    bad = [w for w in workloads if w not in WORKLOADS]
    if bad:
        raise ValueError(f"unknown workload(s) {', '.join(bad)}; known: {', '.join(WORKLOADS)}")
    per = arms_for(dict.fromkeys(WORKLOADS[w].framework for w in workloads), arms, cpu)
    if not per:
        raise ValueError(f"no arm of {', '.join(arms)} runs the workloads {', '.join(workloads)}")
    return workloads, per


def arms_for(frameworks, arms=None, cpu: bool = False) -> dict:
    """{framework: its arms} of `arms` (None: every peer and xpool scheme; cpu: NumPy's stand-in), frameworks without
    one left out; an `xpool_<scheme>` this xpool lacks is skipped with a message. ValueError: an unknown arm."""
    if cpu:
        return {f: ("numpy",) for f in frameworks}
    have = xpool_arms()
    if arms:
        known = PEERS["cupy"] + PEERS["torch"] + ("xpool",) + have   # `xpool`: the default scheme, by name
        bad = [a for a in arms if a not in known and not re.fullmatch(r"xpool_[a-z]\w*", a)]
        if bad:
            raise ValueError(f"unknown arm(s) {', '.join(bad)}; known: {', '.join(known)}")
        if set(arms) - set(known):
            print(f"skipping {', '.join(a for a in arms if a not in known)}: this xpool has no such scheme (its arms: "
                  f"{', '.join(have)})")
    per = {f: tuple(a for a in (arms or PEERS[f] + have) if a in PEERS[f] + ("xpool",) + have) for f in frameworks}
    return {f: a for f, a in per.items() if a}


def device_calls(alloc, device: int = 0):
    """Device calls the arm made so far (None: not counted in this run); Note [Dynamic-shape benchmark]."""
    if hasattr(alloc, "device_calls"):
        return alloc.device_calls(device)
    if isinstance(alloc, registry.XPool):
        counters = alloc.pool.stats().per_device.get(device, {})
        return sum(int(counters.get(k, 0)) for k in DEVICE_CALLS)
    if isinstance(alloc, registry.CupyTorch):
        stats = alloc.torch.cuda.memory_stats(device)
        return int(stats.get("num_device_alloc", 0)) + int(stats.get("num_device_free", 0))
    return alloc.device_mallocs(device)       # cupy_pool: it calls cudaFree only in free_all_blocks


# --- one process: one arm over its workloads
def spec_of(workload, opts) -> Workload:
    """The workload of that name in the run's table: opts["specs"] where a benchmark brings its own
    (xlab.bench.dynamic_scale's scaled workloads), else WORKLOADS."""
    return opts.get("specs", WORKLOADS)[workload]


def run_settings(workload, opts) -> tuple:
    """(steps, warm-up steps, seed) of a run of `workload`: the options' where they set them, else its own."""
    spec = spec_of(workload, opts)
    return opts["steps"] or spec.steps, opts["warmup"] or spec.warmup, opts["seed"]


def for_trial(opts, trial: int) -> dict:
    """The options of trial `trial`: its seed is the run's seed + trial, unless opts["same_seed"] (every trial on the
    run's seed, the benchmark before d5211c4)."""
    return opts if opts.get("same_seed") else {**opts, "seed": opts["seed"] + trial}


def steady_state(probes: list, warmup: int) -> dict:
    """The steady state of one run, from its probes after every step in order, each (device calls so far, peak
    requested bytes so far): the timed steps (from `warmup` on) after the last step that raised the peak requested
    (the demand's last new high, `demand_peak_step`), and the device calls made in them. Issue #22's "once the
    longest shape has been seen": a workload whose live set keeps growing after its largest shape (cupy_mix's
    results live 1-32 steps) is judged only on demand it has already met (Note [Dynamic-shape benchmark])."""
    nan = dict(demand_peak_step=math.nan, steady_steps=math.nan, device_calls_steady=math.nan)
    if not probes or any(c is None or p is None for c, p in probes):
        return nan
    calls, peaks = zip(*probes)
    last = max(i for i, p in enumerate(peaks) if i == 0 or p > peaks[i - 1])
    first = max(last + 1, warmup)
    return dict(demand_peak_step=last, steady_steps=len(probes) - first,
                device_calls_steady=calls[-1] - calls[first - 1] if first < len(probes) else math.nan)


def measure(alloc, workload, opts, sync, probe: bool, timed: bool = True, probes: list | None = None) -> dict:
    """One run of `workload`; probe: read the device calls and the peak requested after every step (a cost inside
    the timed window, so only in runs that count: steady_state) into `probes` (the caller's list, if given: a run
    an error stopped leaves there the steps it finished); timed: the run whose time the row reports, over which
    NVML samples the GPU's utilisation on a GPU (a thread reading it every 25 ms: what bounds the step)."""
    steps, warmup, seed = run_settings(workload, opts)
    sampler = UtilSampler([0]) if timed and opts["gpu"] else None
    window, probes = Window(lambda: device_calls(alloc), sync, sampler=sampler), [] if probes is None else probes

    def after_step():
        alloc.sample(0)
        if probe:
            probes.append((device_calls(alloc), alloc.peak_requested(0)))

    with alloc.tracking():
        info = spec_of(workload, opts).fn(steps, warmup, seed, window, opts["gpu"], opts["small"],
                                          after_step=after_step)
    return dict(info, seconds=window.seconds, host_seconds=window.host_seconds, calls=window.device_mallocs,
                gc_seconds=window.gc.seconds, gpu_util=window.util.get(0, math.nan),
                reserved=alloc.peak_reserved(0), requested=alloc.peak_requested(0),
                steady=steady_state(probes, warmup) if probe else None)


def _cupy_arm(arm, workloads, opts) -> list:
    """A fresh allocator per workload: a timed run, then a counting run with the per-step probes (their reads would
    cost the short cupy_mix steps ~1-2% inside the timed window, where counting is otherwise free)."""
    sync = lambda: None     # noqa: E731
    if opts["gpu"]:
        import cupy
        sync = cupy.cuda.Device().synchronize
    out = []
    for w in workloads:
        runs = []
        for counting in (False, True):
            with installed(arm, counting, [0]) as alloc:
                runs.append(measure(alloc, w, opts, sync, probe=counting, timed=not counting))
                check_torch_setting(alloc, arm, opts["gpu"])     # cupy_torch_expandable: before its cache goes
        out.append((w, runs[0], runs[-1], 0))
    return out


def _torch_arm(arm, workloads, opts) -> list:
    """One allocator for the process (PyTorch keeps its first), emptied with its peaks reset between workloads; one run
    per workload,
    probed every step (a read of the counters costs well under 1% of a 17-50 ms step)."""
    import torch
    alloc, gpu = torch_allocator(arm), opts["gpu"]
    out = []
    for w in workloads:
        at_start = torch_reset(alloc, gpu)
        run = measure(alloc, w, opts, torch.cuda.synchronize if gpu else (lambda: None), probe=True)
        check_torch_setting(alloc, arm, gpu)
        out.append((w, run, run, at_start))
        torch_empty(alloc, gpu)
    return out


def torch_allocator(arm):
    """The arm's allocator serving PyTorch in this process (xpool's pool through enable_torch), made and installed."""
    alloc = registry.make(arm)
    if isinstance(alloc, registry.XPool):
        xpool.enable_torch(pool=alloc.pool)
    else:
        alloc.install()
    return alloc


def torch_reset(alloc, gpu) -> float:
    """Reset the peaks of the allocator serving PyTorch, so the next run is judged on its own demand; the bytes it
    still reserves (NaN on a CPU)."""
    import torch
    if isinstance(alloc, registry.XPool):
        alloc.pool.reset_peak_stats()
        return alloc.pool.stats().per_device.get(0, {}).get("bytes_reserved", 0)
    if not gpu:
        return math.nan
    torch.cuda.reset_peak_memory_stats(0)
    return torch.cuda.memory_stats(0)["reserved_bytes.all.current"]


def torch_empty(alloc, gpu) -> None:
    """Give back everything the allocator serving PyTorch caches, cuBLAS's workspaces included (allocator memory):
    the next run starts empty."""
    import torch
    gc.collect()
    if gpu:
        torch.cuda.synchronize()
        torch._C._cuda_clearCublasWorkspaces()
        alloc.pool.empty_cache() if isinstance(alloc, registry.XPool) else torch.cuda.empty_cache()


def check_torch_setting(alloc, arm, gpu) -> None:
    """For an arm of PyTorch's allocator, raise unless its segments are expandable exactly when the arm says so: the
    setting took, or the arm measured the other allocator."""
    if gpu and isinstance(alloc, registry.CupyTorch):
        kinds = {bool(s["is_expandable"]) for s in alloc.torch.cuda.memory_snapshot() if "is_expandable" in s}
        if kinds - {isinstance(alloc, registry.TorchExpandable)}:
            raise RuntimeError(f"arm {arm!r} ran with expandable segments {sorted(kinds)}: its PyTorch allocator "
                               "setting did not take")


def arm_process(framework, arm, workloads, trial, position, opts) -> list:
    """Run `arm` over `workloads` (all of `framework`) in this process, on opts["cpus"] if given (Note [Pinned
    arms]): their rows, with provenance."""
    if opts.get("cpus"):
        os.sched_setaffinity(0, opts["cpus"])      # exactly these CPUs, or OSError
    opts, t0 = for_trial(opts, trial), time.perf_counter()
    runs = (_cupy_arm if framework == "cupy" else _torch_arm)(arm, workloads, opts)
    prov = provenance(experiment="dynamic_shapes", **library_versions(), process_s=round(time.perf_counter() - t0, 2),
                      start=opts["start"])
    return [{**build_row(trial, position, w, arm, timed, counted, at_start, opts), **prov}
            for w, timed, counted, at_start in runs]


def library_versions() -> dict:
    """The versions of PyTorch and RMM (None: not installed), for the rows beside xlab.provenance's CuPy."""
    return dict(torch=package_version("torch"), rmm=package_version("rmm-cu13", "rmm-cu12"))


def package_version(*names) -> str | None:
    """The first of these distributions installed: its version."""
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return None


def release_rule(arm) -> str | None:
    """The release rule an xpool arm ran with, None for the others: the rows say which rule ran, whatever a later
    build does. Since the freeze every scheme has one, "never" (docs/decisions/0001-one-release-rule-per-scheme.md)."""
    return "never" if registry.arm(arm).make == "XPool" else None


def build_row(trial, position, workload, arm, timed, counted, at_start, opts) -> dict:
    """One row: bytes from the run that counted them, device calls from the counting run, time from the timed.
    host_ms_per_step: the main thread's CPU time per timed step (to the last dispatch, Window); gpu_util_mean: NVML's
    utilisation over the timed window (NaN: not sampled). `bound` (train.step_bound) on a GPU from NVML where it was
    sampled (since 8f95231), else from the thread's time for the CuPy workloads, whose host work is all
    on that thread; a PyTorch row without NVML says nothing: PyTorch runs backward on its autograd thread, which that
    time does not count (Note [Pinned arms])."""
    spec, (steps, warmup, seed) = spec_of(workload, opts), run_settings(workload, opts)
    reserved, requested, calls = (math.nan if v is None else v for v in (
        counted["reserved"] if timed["reserved"] is None else timed["reserved"],
        counted["requested"] if timed["requested"] is None else timed["requested"], counted["calls"]))
    steady = counted["steady"] or steady_state([], warmup)
    ms, host_ms = (1000 * timed[k] / steps for k in ("seconds", "host_seconds"))
    util = timed.get("gpu_util")
    sampled = util is not None and math.isfinite(util)
    by_thread = spec.framework == "cupy"        # the thread's time tells only where all host work is on it
    per_steady = (steady["device_calls_steady"] / steady["steady_steps"] if steady["steady_steps"] else math.nan)
    return dict(trial=trial, workload=workload, dynamic=spec.dynamic, framework=spec.framework, allocator=arm,
                peak_reserved_bytes=reserved, peak_requested_bytes=requested,
                reserved_over_requested=reserved / requested if requested > 0 else math.nan,
                device_calls_per_step=calls / steps, device_calls=calls, device_calls_per_steady_step=per_steady,
                **steady, ms_per_step=ms, host_ms_per_step=host_ms,
                gpu_util_mean=util if sampled else math.nan,
                bound=step_bound(util if sampled else None, host_ms, ms) if opts.get("gpu") and (sampled or by_thread)
                else "",
                steps=steps, warmup=warmup, seed=seed, batch=timed["batch"], shape=timed["shape"],
                counted_in="timed run" if counted is timed else "counting run", reserved_at_start_bytes=at_start,
                position=position, gc_ms_per_step=1000 * timed["gc_seconds"] / steps, release_on_miss=release_rule(arm),
                pinned=pinned(opts))


# --- the run
def plan(trials, workloads, per_framework, opts, done=frozenset(), commit="") -> tuple[list, set]:
    """The run's processes in order (framework, arm, workloads to do, trial, position), and every key (KEYS)."""
    units = [(f, a) for f, arms in per_framework.items() for a in arms]
    jobs, wanted = [], set()
    for t in range(trials):
        for pos, (f, a) in enumerate(rotated(units, t)):
            keys = {w: tuple(map(str, (t, w, a, *run_settings(w, for_trial(opts, t)), pinned(opts), commit)))
                    for w in workloads if WORKLOADS[w].framework == f}
            wanted |= set(keys.values())
            todo = [w for w, k in keys.items() if k not in done]
            if todo:
                jobs.append((f, a, todo, t, pos))
    return jobs, wanted


def _keys(df) -> list:
    return [tuple(str(v) for v in r) for r in df.reindex(columns=KEYS).itertuples(index=False)] if "commit" in df else []


def check_cpus(cpus) -> frozenset | None:
    """cpus as a set this process may run on; ValueError naming `cpus` otherwise."""
    if cpus is None:
        return None
    allowed = os.sched_getaffinity(0)
    try:
        items = list(cpus)
        got = frozenset(int(c) for c in items)
    except (TypeError, ValueError):
        raise ValueError(f"cpus must be CPU numbers (this process may use {sorted(allowed)}), got {cpus!r}") from None
    if not got or got - allowed or any(isinstance(c, bool) for c in items):
        raise ValueError(f"cpus must be CPUs this process may use ({sorted(allowed)}), got {cpus!r}")
    return got


def pinned(opts) -> str:
    """The CPUs every arm's process was pinned to ("2", "2,3"), or "no"."""
    return ",".join(map(str, sorted(opts["cpus"]))) if opts.get("cpus") else "no"


def _n_gpus() -> int:
    return gpu_info()["n_gpus"]


def in_process(fn, *args, start="fork"):
    """fn(*args) in a new process (a fork inherits this one's imports); its exceptions are raised here."""
    with ProcessPoolExecutor(1, mp_context=get_context(start)) as ex:
        return ex.submit(fn, *args).result()


def run(workloads=None, arms=None, trials: int = TRIALS, steps: int | None = None, warmup: int | None = None,
        seed: int = SEED, out=OUT, fresh: bool = False, cpu: bool = False, small: bool | None = None,
        start: str = "fork", progress: bool = True, cpus=None, same_seed: bool = False) -> pd.DataFrame:
    """Measure every (trial, workload, arm) `out` lacks for this commit and these settings (fresh: discard them), rows
    appended after each process; the run's rows (attrs["failed"]: arms that raised). steps, warmup: None for each
    workload's own; cpu: NumPy and PyTorch's CPU under arm 'numpy' (tests the code); start: "fork" or "spawn";
    cpus: CPUs every arm's process is pinned to (Note [Pinned arms]), None: not pinned; trial t runs on seed + t, or
    on seed itself when same_seed."""
    for name, v in (("trials", trials), ("steps", steps), ("warmup", warmup)):
        if v is not None and not (isinstance(v, int) and v >= 1):
            raise ValueError(f"{name} must be a whole number >= 1, got {v!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be a whole number >= 0, got {seed!r}")
    cpus = check_cpus(cpus)
    workloads, per_framework = resolve(workloads, arms, cpu)
    opts = dict(steps=steps, warmup=warmup, seed=seed, gpu=not cpu, small=cpu if small is None else small,
                start=start, cpus=cpus, same_seed=bool(same_seed))
    if not cpu and in_process(_n_gpus, start=start) < 1:    # asked in a child: this process must not start CUDA
        raise registry.NoGPU("xlab.bench.dynamic needs a CUDA GPU (none visible; --cpu runs the code on the CPU)")
    old = pd.read_csv(out) if out and pathlib.Path(out).is_file() and not fresh else pd.DataFrame()
    commit = git_commit()
    jobs, wanted = plan(trials, workloads, per_framework, opts, set(_keys(old)), commit)
    for name in ("cupy",) * (not cpu) + ("torch",) * ("torch" in per_framework):
        __import__(name)
    tqdm.monitor_interval = 0                  # no monitor thread in a process that forks
    failed = []
    for f, a, todo, t, pos in (bar := tqdm(jobs, desc="dynamic", disable=not progress)):
        bar.set_postfix_str(f"trial {t} {a}")
        try:
            rows = in_process(arm_process, f, a, todo, t, pos, opts, start=start)
        except Exception as e:                 # noqa: BLE001 - reported; the other arms go on
            failed.append(a)
            print(f"\narm {a} ({', '.join(todo)}, trial {t}) failed:", *traceback.format_exception(e), file=sys.stderr)
            continue
        new = pd.DataFrame(rows)
        old = new if old.empty else pd.concat([old, new], ignore_index=True)
        old = old[COLUMNS + [c for c in old if c not in COLUMNS]]    # COLUMNS first, one new since older rows too
        write_csv(old, out)
    mine = old[[k in wanted for k in _keys(old)]].reset_index(drop=True)
    mine.attrs["failed"] = failed
    return mine


def main(argv=None) -> int:
    """The command line; exit status 1 when an arm failed."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", help=f"comma-separated (default: all): {', '.join(WORKLOADS)}")
    p.add_argument("--arms", help="comma-separated (default: every peer and xpool scheme)")
    p.add_argument("--trials", type=int, help=f"trials (default {TRIALS}; --quick: 1)")
    p.add_argument("--steps", type=int, help="timed steps of every workload (default: each workload's own)")
    p.add_argument("--warmup", type=int, help="warm-up steps of every workload (default: each workload's own)")
    p.add_argument("--seed", type=int, default=SEED, help=f"trial t runs on seed + t (default {SEED})")
    p.add_argument("--same-seed", action="store_true", help="every trial on the seed itself: one realization")
    p.add_argument("--quick", action="store_true", help="1 trial, 3 steps after 2 warm-up steps: a smoke test")
    p.add_argument("--out", default=OUT, help=f"the CSV (default {OUT})")
    p.add_argument("--fresh", action="store_true", help="discard the CSV's rows instead of resuming")
    p.add_argument("--cpu", action="store_true", help="NumPy and PyTorch on the CPU, small models: tests the code")
    p.add_argument("--start", default="fork", choices=("fork", "spawn"), help="how the arms' processes start")
    p.add_argument("--cpus", help="pin every arm's process to these CPUs, comma-separated (Note [Pinned arms])")
    a = p.parse_args(argv)
    kw = {k: v for k, v in (("trials", a.trials), ("steps", a.steps), ("warmup", a.warmup)) if v is not None}
    split = (lambda s: [x for x in s.split(",") if x] if s else None)   # noqa: E731
    df = run(split(a.workloads), split(a.arms), seed=a.seed, out=a.out, fresh=a.fresh, cpu=a.cpu, start=a.start,
             cpus=split(a.cpus), same_seed=a.same_seed,
             **{**(QUICK if a.quick else {}), **kw})
    if len(df):
        print(f"{len(df)} rows in {a.out}: `python -m xlab.summaries dynamic {a.out}` summarises them (`make report`: "
              "the figure)")
    return 1 if df.attrs.get("failed") else 0


if __name__ == "__main__":
    sys.exit(main())
