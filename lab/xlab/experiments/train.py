"""One rank's training run and the row it becomes: the pieces the experiments' runner (runner.py) composes. What a
run times and records: Note [The timed window], above run_rank.

Data-parallel ranks flatten their gradients and the loss into one buffer, sum it over the ranks (one all-reduce
per step) and scale by 1/world. Everything here runs on NumPy too, with `HostComm` standing in for NCCL, so the
loop, the checks and the rows are tested on a CPU.
"""
from __future__ import annotations

import collections
import functools
import gc
import math
import os
import threading
import time

import numpy as np

from tapegpt import AdamW, GPT, GPTConfig, get_batch
from tapegpt import blas as tapegpt_blas
from tapegpt import launch as tapegpt_launch
from tapegpt.graph import CapturedStep
from tapegpt.tape import array_module
from xlab.shared import HOST_BOUND_UTIL, step_bound  # noqa: F401 - the rows' bound, shared with the report

LR, WEIGHT_DECAY, SEED = 3e-4, 0.1, 0
# The optimizer's form: "foreach" (one flat buffer, a dozen ops per step: the default) or "per_param" (a dozen
# ops per parameter, bit-identical: the workload as first measured). An environment variable, so launched ranks
# inherit it.
ADAMW_ENV = "XPOOL_ADAMW"
ADAMW_FORMS = ("foreach", "per_param")
ADAMW_DEFAULT = "foreach"


def adamw_form() -> str:
    """The optimizer form, "foreach" or "per_param": $XPOOL_ADAMW, else foreach."""
    form = os.environ.get(ADAMW_ENV, ADAMW_DEFAULT)
    if form not in ADAMW_FORMS:
        raise ValueError(f"{ADAMW_ENV}={form!r}: expected one of {', '.join(ADAMW_FORMS)}")
    return form


# Steps a rank may have on the GPU while it dispatches the next: the host stays ahead of the GPU (two steps of
# work queued is plenty) but never fills CUDA's launch queue, where a launch would block: tapegpt.launch keeps
# the GIL during a launch, and a thread blocked there holding it would stall the other rank threads.
AHEAD = 2

LOSS_TOL = 1e-6     # DDP loss vs one GPU on the same global batch: max relative difference
PARAM_TOL = 1e-6    # parameters across ranks: max absolute difference

CONFIGS = {
    "reference": {},                                                     # GPTConfig's defaults
    "small": dict(n_layer=4, n_head=4, n_embd=128, n_ffn=512, block_size=64),
    "tiny": dict(n_layer=2, n_head=2, n_embd=32, n_ffn=64, block_size=16, dtype="float64"),
}

# The rows' columns, in order; provenance columns follow (xlab.provenance).
COLUMNS = [
    "mode", "allocator", "world", "batch", "trial", "tokens_per_s", "ms_per_step", "speedup", "speedup_vs_raw",
    "ratio_vs_cupy_pool", "host_ms_per_step", "dispatch_ms_per_step", "gpu_ms_per_step", "gpu_busy_ms_per_step",
    "bound", "gpu_util_mean", "gc_ms_per_step", "gc_collections", "gc", "fenced", "device_mallocs_per_step",
    "peak_reserved_bytes", "peak_requested_bytes", "reserved_over_requested", "loss_first", "loss_last",
    "loss_rel_diff_max", "param_rank_diff_max", "checks_passed", "launcher", "config", "n_params", "block_size",
    "steps", "warmup", "count_steps", "adamw", "fused", "gemm", "launch", "graph", "graph_pool_bytes"]
GC_POLICY = "on, pauses timed"   # the `gc` column: the collector runs as usual in every arm; its pauses are shown


def make_config(config=None) -> GPTConfig:
    """A GPTConfig from a name in CONFIGS ('reference' when None), a dict of fields, or itself."""
    if isinstance(config, GPTConfig):
        return config
    if isinstance(config, dict):
        return GPTConfig(**config)
    name = config or "reference"
    if name not in CONFIGS:
        raise ValueError(f"unknown config {name!r}; known: {', '.join(CONFIGS)}")
    return GPTConfig(**CONFIGS[name])


def config_name(config) -> str:
    """The name for the CSV of what make_config takes: its name, "reference" for None, "custom" otherwise."""
    return config if isinstance(config, str) else ("reference" if config is None else "custom")


# --- one step
def flatten(grads: dict, loss=None):
    """One new 1-d buffer: every gradient raveled in the dict's order, then the loss if given."""
    xp = array_module(next(iter(grads.values())))
    parts = [g.ravel() for g in grads.values()]
    if loss is not None:
        parts.append(loss.reshape(1))
    return xp.concatenate(parts)


def unflatten(flat, like: dict):
    """(grads, loss): views into `flat` shaped like `like`; loss the 0-d tail, or None."""
    out, offset = {}, 0
    for k, g in like.items():
        out[k] = flat[offset:offset + g.size].reshape(g.shape)
        offset += g.size
    return out, flat[offset] if flat.size > offset else None


def train_step(model, opt, x, y, comm=None, world: int = 1, loss_and_grads=None):
    """Forward, backward, all-reduce mean of gradients and loss over the `world` ranks of `comm` (if given), AdamW:
    the loss on the device. loss_and_grads: default model.loss_and_grads (eager), or a CapturedStep (a CUDA graph)."""
    loss, grads = (loss_and_grads or model.loss_and_grads)(x, y)
    if comm is not None:
        flat = flatten(grads, loss)     # allocates a fresh buffer every step, as a framework would
        comm.allreduce(flat)
        flat *= 1.0 / world
        grads, loss = unflatten(flat, grads)
    opt.step(grads)
    return loss


# --- communicators
class HostComm:
    """NCCL's sum all-reduce and broadcast for ranks that are threads of one process (NumPy, CPU tests)."""

    def __init__(self, world: int):
        self.world = world
        self._slots = [None] * world
        self._barrier = threading.Barrier(world, timeout=120)

    def rank(self, r: int) -> "_HostRank":
        return _HostRank(self, r)


class _HostRank:
    def __init__(self, comm: HostComm, rank: int):
        self.comm, self.r = comm, rank

    def _exchange(self, buf, combine):
        c = self.comm
        c._slots[self.r] = buf.copy()
        c._barrier.wait()
        result = combine(c._slots)        # same order on every rank: identical bits everywhere
        c._barrier.wait()                 # nobody refills a slot before everyone has read
        buf[...] = result

    def allreduce(self, buf):
        self._exchange(buf, lambda slots: functools.reduce(np.add, slots))

    def bcast(self, buf, root: int = 0):
        self._exchange(buf, lambda slots: slots[root].copy())


FENCE_ENV = "XLAB_FENCE"   # "always": keep every threads-mode all-reduce fenced, whatever the allocator


def fence_always() -> bool:
    """$XLAB_FENCE=always: threads mode fences the timed steps of every allocator too (rows say so)."""
    value = os.environ.get(FENCE_ENV, "auto")
    if value not in ("always", "auto"):
        raise ValueError(f"${FENCE_ENV} must be 'always' or 'auto', got {value!r}")
    return value == "always"


# Note [The fence]
# In threads mode NCCL turns peer access on between the GPUs of one process; then a cudaMalloc or cudaFree waits
# for the peers too, so a rank allocating while a peer's NCCL kernel waits for that rank's launch deadlocks (seen
# on two H200s with raw cudaMalloc and with CuPy's pool during warm-up). Fenced meets the other ranks, runs the
# collective and waits for it: no rank is inside its step while a collective is in flight. The fence costs the
# overlap of one rank's host work with another's GPU work, so it is armed only where it is needed: during warm-up
# for every allocator (pools call cudaMalloc while they fill), and in the timed steps only for allocators that
# still call the device once warm (device_calls_when_warm: raw, cudaMallocAsync); a pool that makes no device call
# once warm cannot meet that deadlock. bcast (the checks after the run) is always fenced: the check allocates fresh
# buffers. $XLAB_FENCE=always keeps every all-reduce fenced whatever the allocator (the rows' `fenced` says so).


class Fenced:
    """A communicator for rank threads: meet, run the collective, wait for it, while armed (Note [The fence])."""

    def __init__(self, comm, barrier, sync):
        self.comm, self.barrier, self.sync = comm, barrier, sync
        self.armed = True

    def allreduce(self, buf):
        if not self.armed:
            self.comm.allreduce(buf)
            return
        self.barrier()
        self.comm.allreduce(buf)
        self.sync()

    def bcast(self, buf, root: int = 0):
        self.barrier()
        self.comm.bcast(buf, root)
        self.sync()


def param_rank_diff(params: dict, comm) -> float:
    """Max |p - p_rank0| over this rank's parameters, rank 0's broadcast to every rank (0.0 on rank 0)."""
    mine = flatten(params)
    root = mine.copy()
    comm.bcast(root, 0)
    return float(abs(mine - root).max())


# --- one rank's run
class GcPauses:
    """Time spent in Python's garbage collector while active (every thread's collections: gc.callbacks)."""

    def __init__(self):
        self.seconds, self.collections, self._t0 = 0.0, 0, None

    def __call__(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.seconds += time.perf_counter() - self._t0
            self.collections += 1
            self._t0 = None

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)
        return False


class Window:
    """The timed part of a run: synchronise, meet the other ranks, read counters and clocks; again at the end.
    host_seconds: this thread's CPU time up to `dispatched()` (the closing synchronisation's wait is not dispatch)."""

    def __init__(self, mallocs, sync, barrier=None, sampler=None):
        self.mallocs, self.sync, self.barrier, self.sampler = mallocs, sync, barrier, sampler
        self.seconds, self.host_seconds, self.device_mallocs, self.util = math.nan, math.nan, None, {}
        self.gc = GcPauses()

    def __enter__(self):
        self.sync()
        if self.barrier:
            self.barrier()
        self.m0 = self.mallocs()
        if self.sampler:
            self.sampler.start()
        self.gc.__enter__()
        self.h0, self._h1 = time.thread_time(), None
        self.t0 = time.perf_counter()
        return self

    def dispatched(self) -> None:
        self._h1 = time.thread_time()

    def __exit__(self, exc_type, *_):
        self.gc.__exit__()
        if exc_type is not None:              # a run stopped (an out-of-memory error under a cap): no time, and
            if self.sampler:                  # no NVML thread left polling beside the next run
                self.sampler.stop()
            return False
        h1 = self._h1 if self._h1 is not None else time.thread_time()
        self.sync()
        self.seconds = time.perf_counter() - self.t0
        self.host_seconds = h1 - self.h0
        if self.barrier:
            self.barrier()
        if self.sampler:
            self.util = self.sampler.stop()
        m1 = self.mallocs()
        self.device_mallocs = None if self.m0 is None else m1 - self.m0
        return False


class StepEvents:
    """CUDA events around each timed step (made before the window); ms(): a step's mean span on the stream."""

    def __init__(self, xp, steps):
        self.pairs = [] if xp is np else [(xp.cuda.Event(), xp.cuda.Event()) for _ in range(steps)]
        self.xp = xp

    def start(self, i):
        if self.pairs:
            self.pairs[i][0].record()

    def stop(self, i):
        if self.pairs:
            self.pairs[i][1].record()

    def ms(self) -> float:
        return float(np.mean([self.xp.cuda.get_elapsed_time(a, b) for a, b in self.pairs])) if self.pairs else math.nan


def synchronizer(xp, device):
    """A function that waits for `device` (nothing on NumPy)."""
    return (lambda: None) if xp is np else xp.cuda.Device(device).synchronize


# Note [The timed window]
# One rank's run is a fresh model and optimiser (seed SEED), `warmup` steps, a timed window of `steps` steps, then
# `dispatch_steps` dispatch probes. Per step the window records: wall time; the dispatching thread's CPU time
# (time.thread_time: the host's work; it excludes waiting for the GIL and includes spinning in a synchronising CUDA
# call); the step's span on the GPU's stream (CUDA events before and after each step); and NVML's utilisation over the
# window (bound: gpu when the GPU was busy at least HOST_BOUND_UTIL % of it, else host; thread time alone cannot tell,
# since a host ahead of the GPU fills the launch queue and spins in the driver). Python's garbage collector stays on
# in every arm alike; its pauses inside the window are timed (gc.callbacks) and recorded: freezing it would change the
# workload's memory (the tape's cycles would live to the window's end). A dispatch probe is a step started on an idle
# device, whose thread CPU time is the host's work without waiting. The rows (COLUMNS, shared by the one-GPU and
# data-parallel experiments): tokens_per_s over the timed steps; host_ms_per_step, dispatch_ms_per_step,
# gpu_ms_per_step, gpu_util_mean, bound; device_mallocs_per_step after warm-up (raw and cupy_pool: counted in a
# separate counting run in trial 0, since counting costs them time); peak reserved and requested bytes over the whole
# run (model, warm-up and steps); loss_rel_diff_max against the first allocator's loss curve at the same batch (or a
# one-GPU run on the same global batch). GPU clocks are not locked (they cannot be on the lent machines): interleaving
# is the control (docs/decisions/0008-how-the-lab-measures.md).


def run_rank(alloc, cfg, data, batch, steps, warmup, *, xp=np, device=0, rank=0, world=1, comm=None,
             barrier=None, sampler=None, dispatch_steps: int = 0) -> dict:
    """One rank (Note [The timed window]): a dict of host values (seconds, losses, peaks, ...). alloc is
    installed by the caller; comm: None for one rank, a Fenced one disarmed after warm-up unless the allocator calls
    the device once warm; barrier, sampler: the window's edges, NVML (rank 0). Losses stay on the device until read."""
    window = Window(lambda: alloc.device_mallocs(device), synchronizer(xp, device), barrier, sampler)
    fence = comm if isinstance(comm, Fenced) else None
    with alloc.tracking():              # everything allocated in the run, parameters too, is seen
        model = GPT(cfg, xp=xp, seed=SEED)
        opt = AdamW(model.params, lr=LR, weight_decay=WEIGHT_DECAY, foreach=adamw_form() == "foreach")
        captured = None
        if getattr(alloc, "graph", False):       # a `_graph` arm: forward and backward replayed as a CUDA graph
            if xp is np:
                raise ValueError(f"allocator {alloc.name!r} captures CUDA graphs: it needs CuPy, not NumPy")
            captured = CapturedStep(model, alloc.graph_pool().malloc)
        losses = xp.zeros(warmup + steps + dispatch_steps, dtype=cfg.dtype)
        events = StepEvents(xp, steps)

        in_flight = collections.deque()     # events recorded after each step still on the GPU (CuPy only)

        def step(i):
            if len(in_flight) >= AHEAD:
                in_flight.popleft().synchronize()
            x, y = get_batch(data, batch, cfg.block_size, i, seed=SEED, xp=xp, rank=rank, world=world)
            losses[i] = train_step(model, opt, x, y, comm, world, captured)
            alloc.sample(device)
            if xp is not np:
                in_flight.append(xp.cuda.Event(disable_timing=True))
                in_flight[-1].record()

        if fence is not None:
            fence.armed = True
        for i in range(warmup):
            step(i)
        if fence is not None:       # every rank switches after the same step: their barriers stay matched
            fence.armed = alloc.device_calls_when_warm or fence_always()
        try:
            with window:
                for i in range(steps):
                    events.start(i)
                    step(warmup + i)
                    events.stop(i)
                window.dispatched()
        finally:
            if fence is not None:
                fence.armed = True
        dispatch = []
        for i in range(dispatch_steps):
            window.sync()
            t0 = time.thread_time()
            step(warmup + steps + i)
            dispatch.append(1000 * (time.thread_time() - t0))
        window.sync()
        param_diff = param_rank_diff(model.params, comm) if comm is not None else None
        out = dict(rank=rank, device=device, seconds=window.seconds, host_seconds=window.host_seconds,
                   dispatch_ms=float(np.median(dispatch)) if dispatch else math.nan,
                   gpu_ms_per_step=events.ms(), gc_seconds=window.gc.seconds, gc_collections=window.gc.collections,
                   device_mallocs=window.device_mallocs, util=window.util,
                   losses=[float(v) for v in (losses.get() if xp is not np else losses)],
                   param_rank_diff=param_diff, peak_reserved=alloc.peak_reserved(device),
                   peak_requested=alloc.peak_requested(device), n_params=model.num_params(),
                   fenced=fence is not None and (alloc.device_calls_when_warm or fence_always()),
                   fused=getattr(model, "fused", None),   # the workload's fused kernels (tapegpt's GPT(fused=)), if any
                   gemm="cublas" if tapegpt_blas.enabled and xp is not np else "matmul",   # how GEMMs were made
                   launch=("direct" if tapegpt_launch.direct else "cupy") if xp is not np else None,
                   graph=captured is not None, graph_pool_bytes=alloc.graph_pool_bytes(device))
        del model, opt, losses, captured
    return out


# --- checks
def loss_rel_diff(losses, reference) -> float:
    """Max |loss - ref| / |ref| over the steps both loss curves have (NaN if a loss is not finite)."""
    n = min(len(losses), len(reference))
    a, b = np.asarray(losses[:n], dtype=float), np.asarray(reference[:n], dtype=float)
    if n == 0 or not (np.isfinite(a).all() and np.isfinite(b).all()):
        return math.nan
    return float(np.max(np.abs(a - b) / np.abs(b)))


def checks_passed(loss_rel_diff_max=None, param_rank_diff_max=None, loss_tol=LOSS_TOL,
                  param_tol=PARAM_TOL) -> bool:
    """Every check that was made passed (None: not made; NaN fails)."""
    return ((loss_rel_diff_max is None or bool(loss_rel_diff_max <= loss_tol))        # NaN compares False
            and (param_rank_diff_max is None or bool(param_rank_diff_max < param_tol)))


# --- rows
def _maximum(values):
    values = [v for v in values if v is not None]
    return max(values) if values else math.nan


def _mean(values):
    values = [v for v in values if v is not None and math.isfinite(v)]
    return float(np.mean(values)) if values else math.nan


def build_row(mode, m, world, batch, cfg, steps, warmup, ref_losses=None, launcher="none",
              config="reference", trial=0) -> dict:
    """One tidy row (COLUMNS; ratios NaN until `frame`) of runner.run_arm's result over all ranks."""
    timed, counted = m["timed"], m["counted"]
    seconds = max(r["seconds"] for r in timed)
    ms_per_step = 1000 * seconds / steps
    util = {d: u for r in timed for d, u in r["util"].items()}
    gpu_util = float(np.mean(list(util.values()))) if util else math.nan
    host_ms = _mean(1000 * r.get("host_seconds", math.nan) / steps for r in timed)
    if counted is None:
        mallocs_per_step, reserved, requested = math.nan, math.nan, math.nan
    else:
        mallocs = [r["device_mallocs"] for r in counted]
        mallocs_per_step = (math.nan if any(v is None for v in mallocs)
                            else sum(mallocs) / (m["counted_steps"] * world))     # per GPU per step
        reserved = _maximum(r["peak_reserved"] for r in counted)                    # per GPU: the largest
        requested = _maximum(r["peak_requested"] for r in counted)
    if requested is not None and reserved is not None and requested > reserved:
        # impossible (a pool never reserves less than is asked of it): a counting artefact, seen with CuPy's
        # thread-local memory hooks at two threads; blank it rather than report it
        requested = math.nan
    losses = timed[0]["losses"]
    loss_diff = loss_rel_diff(losses, ref_losses) if ref_losses is not None else None
    param_diffs = [r["param_rank_diff"] for r in timed if r["param_rank_diff"] is not None]
    param_diff = max(param_diffs) if param_diffs else None
    return dict(
        mode=mode, allocator=m["allocator"], world=world, batch=batch, trial=trial,
        tokens_per_s=world * batch * cfg.block_size * steps / seconds, ms_per_step=ms_per_step,
        speedup=math.nan, speedup_vs_raw=math.nan, ratio_vs_cupy_pool=math.nan,
        host_ms_per_step=host_ms, dispatch_ms_per_step=_mean(r.get("dispatch_ms", math.nan) for r in timed),
        gpu_ms_per_step=_mean(r.get("gpu_ms_per_step", math.nan) for r in timed),
        gpu_busy_ms_per_step=ms_per_step * gpu_util / 100, bound=step_bound(gpu_util, host_ms, ms_per_step),
        gpu_util_mean=gpu_util, gc_ms_per_step=_mean(1000 * r.get("gc_seconds", math.nan) / steps for r in timed),
        gc_collections=max(r.get("gc_collections", 0) for r in timed), gc=GC_POLICY,
        fenced=any(r.get("fenced", False) for r in timed),
        device_mallocs_per_step=mallocs_per_step, peak_reserved_bytes=reserved, peak_requested_bytes=requested,
        reserved_over_requested=reserved / requested if requested and not math.isnan(requested) else math.nan,
        loss_first=losses[0], loss_last=losses[-1], loss_rel_diff_max=math.nan if loss_diff is None else loss_diff,
        param_rank_diff_max=math.nan if param_diff is None else param_diff,
        checks_passed=checks_passed(loss_diff, param_diff), launcher=launcher, config=config, adamw=adamw_form(),
        fused=timed[0].get("fused"), gemm=timed[0].get("gemm"), launch=timed[0].get("launch"),
        graph=bool(timed[0].get("graph", False)), graph_pool_bytes=_maximum(r.get("graph_pool_bytes") for r in timed),
        n_params=timed[0]["n_params"], block_size=cfg.block_size, steps=steps, warmup=warmup,
        count_steps=m["counted_steps"] if counted is not None else 0,   # steps mallocs and peaks were counted over
    )


def add_ratios(df):
    """Fill speedup, speedup_vs_raw and ratio_vs_cupy_pool against the run of the same trial, in place."""
    if "trial" not in df:
        df["trial"] = 0
    tps = {(r.mode, r.allocator, r.world, r.batch, r.trial): r.tokens_per_s for r in df.itertuples()}

    def ratio(key_fn):
        return [t / tps.get(key_fn(r), math.nan) for r, t in zip(df.itertuples(), df["tokens_per_s"])]

    df["speedup"] = ratio(lambda r: (r.mode, r.allocator, 1, r.batch, r.trial))
    df["speedup_vs_raw"] = ratio(lambda r: (r.mode, "raw", r.world, r.batch, r.trial))
    df["ratio_vs_cupy_pool"] = ratio(lambda r: (r.mode, "cupy_pool", r.world, r.batch, r.trial))
    return df


def frame(rows):
    """build_row's rows (with provenance) as a DataFrame, COLUMNS first, ratios filled (no rows: empty, COLUMNS)."""
    import pandas as pd
    df = pd.DataFrame(rows)
    if df.empty:
        return pd.DataFrame(columns=COLUMNS)
    df = add_ratios(df)
    return df[COLUMNS + [c for c in df.columns if c not in COLUMNS]]
