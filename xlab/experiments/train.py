"""The training measurement shared by the single-GPU and data-parallel experiments.

One rank's run (`run_rank`) is: a fresh model and optimiser (seed 0), `warmup` steps, then a timed
window of `steps` steps. Data-parallel ranks flatten their gradients and the loss into one buffer,
sum it over the ranks (one all-reduce per step) and scale by 1/world. Everything here runs on NumPy
too, with `HostComm` standing in for NCCL, so the loop, the checks and the rows are tested on a CPU.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import math
import os
import threading
import time

import numpy as np

from tapegpt import AdamW, GPT, GPTConfig, get_batch
from tapegpt.tape import array_module

from xlab import allocators as registry

LR, WEIGHT_DECAY, SEED = 3e-4, 0.1, 0
# The optimizer's form: "per_param" (a dozen ops per parameter: the measured default) or "foreach" (one flat
# buffer, bit-identical, a dozen ops per step). An environment variable, so launched ranks inherit it.
ADAMW_ENV = "XPOOL_ADAMW"
ADAMW_FORMS = ("per_param", "foreach")


def adamw_form() -> str:
    form = os.environ.get(ADAMW_ENV, "per_param")
    if form not in ADAMW_FORMS:
        raise ValueError(f"{ADAMW_ENV}={form!r}: expected one of {', '.join(ADAMW_FORMS)}")
    return form
LOSS_TOL = 1e-6     # DDP loss vs one GPU on the same global batch: max relative difference
PARAM_TOL = 1e-6    # parameters across ranks: max absolute difference

CONFIGS = {
    "reference": {},                                                     # GPTConfig's defaults
    "small": dict(n_layer=4, n_head=4, n_embd=128, n_ffn=512, block_size=64),
    "tiny": dict(n_layer=2, n_head=2, n_embd=32, n_ffn=64, block_size=16, dtype="float64"),
}

# The rows' columns, in order; provenance columns follow (xlab.provenance).
COLUMNS = [
    "mode", "allocator", "world", "batch", "tokens_per_s", "ms_per_step", "speedup", "speedup_vs_raw",
    "ratio_vs_cupy_pool", "gpu_util_mean", "device_mallocs_per_step", "peak_reserved_bytes",
    "peak_requested_bytes", "reserved_over_requested", "loss_first", "loss_last", "loss_rel_diff_max",
    "param_rank_diff_max", "checks_passed", "launcher", "config", "n_params", "block_size", "steps",
    "warmup", "count_steps", "adamw",
]


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
    return config if isinstance(config, str) else ("reference" if config is None else "custom")


# --- one step

def flatten(grads: dict, loss=None):
    """One contiguous buffer: every gradient raveled in the dict's order, then the loss (one all-reduce)."""
    xp = array_module(next(iter(grads.values())))
    parts = [g.ravel() for g in grads.values()]
    if loss is not None:
        parts.append(loss.reshape(1))
    return xp.concatenate(parts)


def unflatten(flat, like: dict):
    """(grads, loss): views into `flat` shaped like `like`; loss is the 0-d tail (None if there is none)."""
    out, offset = {}, 0
    for k, g in like.items():
        out[k] = flat[offset:offset + g.size].reshape(g.shape)
        offset += g.size
    loss = flat[offset] if flat.size > offset else None
    return out, loss


def train_step(model, opt, x, y, comm=None, world: int = 1):
    """Forward, backward, (all-reduce mean of gradients and loss), AdamW; returns the (global mean) loss."""
    loss, grads = model.loss_and_grads(x, y)
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


class Fenced:
    """A communicator for ranks that are threads of one process: meet, run the collective, wait for it.

    NCCL turns peer access on between the GPUs of one process; then a cudaMalloc or cudaFree waits for
    the peers too, so a rank allocating while a peer's NCCL kernel waits for that rank's launch
    deadlocks (seen on two H200s with raw cudaMalloc and with CuPy's pool during warm-up). With the
    fence no rank is inside its step while a collective is in flight.
    """

    def __init__(self, comm, barrier, sync):
        self.comm, self.barrier, self.sync = comm, barrier, sync

    def allreduce(self, buf):
        self.barrier()
        self.comm.allreduce(buf)
        self.sync()

    def bcast(self, buf, root: int = 0):
        self.barrier()
        self.comm.bcast(buf, root)
        self.sync()


def param_rank_diff(params: dict, comm) -> float:
    """Max |p - p_rank0| over all parameters, rank 0's broadcast to every rank."""
    mine = flatten(params)
    root = mine.copy()
    comm.bcast(root, 0)
    return float(abs(mine - root).max())


# --- one rank's run

class Window:
    """The timed part of a run: synchronise, meet the other ranks, read counters and clock; again at the end."""

    def __init__(self, mallocs, sync, barrier=None, sampler=None):
        self.mallocs, self.sync, self.barrier, self.sampler = mallocs, sync, barrier, sampler
        self.seconds, self.device_mallocs, self.util = math.nan, None, {}

    def __enter__(self):
        self.sync()
        if self.barrier:
            self.barrier()
        self.m0 = self.mallocs()
        if self.sampler:
            self.sampler.start()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is not None:
            return False
        self.sync()
        self.seconds = time.perf_counter() - self.t0
        if self.barrier:
            self.barrier()
        if self.sampler:
            self.util = self.sampler.stop()
        m1 = self.mallocs()
        self.device_mallocs = None if self.m0 is None else m1 - self.m0
        return False


def synchronizer(xp, device):
    if xp is np:
        return lambda: None
    return xp.cuda.Device(device).synchronize


def run_rank(alloc, cfg, data, batch, steps, warmup, *, xp=np, device=0, rank=0, world=1, comm=None,
             barrier=None, sampler=None) -> dict:
    """One rank: fresh model, `warmup` steps, `steps` timed steps; a dict of host values.

    The allocator must already be installed (by the caller: it is process-wide). Losses stay on the
    device until the end: reading one per step would synchronise every step.
    """
    window = Window(lambda: alloc.device_mallocs(device), synchronizer(xp, device), barrier, sampler)
    with alloc.tracking():              # everything allocated in the run, parameters too, is seen
        model = GPT(cfg, xp=xp, seed=SEED)
        opt = AdamW(model.params, lr=LR, weight_decay=WEIGHT_DECAY, foreach=adamw_form() == "foreach")
        losses = xp.zeros(warmup + steps, dtype=cfg.dtype)

        def step(i):
            x, y = get_batch(data, batch, cfg.block_size, i, seed=SEED, xp=xp, rank=rank, world=world)
            losses[i] = train_step(model, opt, x, y, comm, world)
            alloc.sample(device)

        for i in range(warmup):
            step(i)
        with window:
            for i in range(warmup, warmup + steps):
                step(i)
        param_diff = param_rank_diff(model.params, comm) if comm is not None else None
        n_params = model.num_params()
        out = dict(rank=rank, device=device, seconds=window.seconds, device_mallocs=window.device_mallocs,
                   util=window.util, losses=[float(v) for v in (losses.get() if xp is not np else losses)],
                   param_rank_diff=param_diff, peak_reserved=alloc.peak_reserved(device),
                   peak_requested=alloc.peak_requested(device), n_params=n_params)
        del model, opt, losses
    return out


def measure(name, run_ranks, steps, count_steps, devices) -> dict:
    """One allocator: a timed run and, unless counting is free, a counting run, each with a fresh allocator.

    run_ranks(alloc, steps) runs every rank with `alloc` installed and returns their run_rank dicts.
    """
    alloc, timed = fresh_run(name, run_ranks, steps, False, devices)
    if alloc.free_counting:
        return dict(allocator=name, timed=timed, counted=timed, counted_steps=steps)
    _, counted = fresh_run(name, run_ranks, count_steps, True, devices)
    return dict(allocator=name, timed=timed, counted=counted, counted_steps=count_steps)


def fresh_run(name, run_ranks, steps, counting, devices):
    alloc = registry.make(name)
    alloc.install(counting)
    try:
        return alloc, run_ranks(alloc, steps)
    finally:
        alloc.uninstall()
        gc.collect()                     # arrays in reference cycles die before their pool does
        alloc.release(devices)


def run_threads(world: int, fn, device_ctx=None, timeout: float = 900.0) -> list:
    """fn(rank) on one thread per rank (inside device_ctx(rank) when given); results in rank order."""
    results, errors = [None] * world, []

    def target(r):
        try:
            with (device_ctx(r) if device_ctx else contextlib.nullcontext()):
                results[r] = fn(r)
        except BaseException as e:          # noqa: BLE001 - re-raised in the caller's thread
            errors.append((r, e))

    threads = [threading.Thread(target=target, args=(r,), daemon=True, name=f"rank{r}") for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError(f"{t.name} still running after {timeout} s (a peer failed inside NCCL?)")
    if errors:
        r, e = errors[0]
        raise RuntimeError(f"rank {r} failed: {e!r}") from e
    return results


# --- checks

def loss_rel_diff(losses, reference) -> float:
    """Max |loss - ref| / |ref| over the steps both curves have (NaN if a loss is not finite)."""
    n = min(len(losses), len(reference))
    a, b = np.asarray(losses[:n], dtype=float), np.asarray(reference[:n], dtype=float)
    if n == 0:
        return math.nan
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        return math.nan
    return float(np.max(np.abs(a - b) / np.abs(b)))


def checks_passed(loss_rel_diff_max=None, param_rank_diff_max=None, loss_tol=LOSS_TOL,
                  param_tol=PARAM_TOL) -> bool:
    """Every check that was made passed (None: not made; NaN fails)."""
    ok = True
    if loss_rel_diff_max is not None:
        ok &= bool(loss_rel_diff_max <= loss_tol)          # NaN compares False
    if param_rank_diff_max is not None:
        ok &= bool(param_rank_diff_max < param_tol)
    return ok


# --- rows

def _maximum(values):
    values = [v for v in values if v is not None]
    return max(values) if values else math.nan


def build_row(mode, m, world, batch, cfg, steps, warmup, ref_losses=None, launcher="none",
              config="reference") -> dict:
    """One tidy row (without provenance) from measure()'s result over all ranks of one run."""
    timed, counted = m["timed"], m["counted"]
    seconds = max(r["seconds"] for r in timed)
    util = {}
    for r in timed:
        util.update(r["util"])
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
        mode=mode, allocator=m["allocator"], world=world, batch=batch,
        tokens_per_s=world * batch * cfg.block_size * steps / seconds, ms_per_step=1000 * seconds / steps,
        speedup=math.nan, speedup_vs_raw=math.nan, ratio_vs_cupy_pool=math.nan,
        gpu_util_mean=float(np.mean(list(util.values()))) if util else math.nan,
        device_mallocs_per_step=mallocs_per_step, peak_reserved_bytes=reserved, peak_requested_bytes=requested,
        reserved_over_requested=reserved / requested if requested and not math.isnan(requested) else math.nan,
        loss_first=losses[0], loss_last=losses[-1],
        loss_rel_diff_max=math.nan if loss_diff is None else loss_diff,
        param_rank_diff_max=math.nan if param_diff is None else param_diff,
        checks_passed=checks_passed(loss_diff, param_diff), launcher=launcher, config=config, adamw=adamw_form(),
        n_params=timed[0]["n_params"], block_size=cfg.block_size, steps=steps, warmup=warmup,
        count_steps=m["counted_steps"],     # the steps that device mallocs and peaks were counted over
    )


def add_ratios(df):
    """Fill speedup (over world 1: same mode, allocator, batch), speedup_vs_raw and ratio_vs_cupy_pool
    (both: same mode, world, batch); NaN where the reference row is absent."""
    tps = {(r.mode, r.allocator, r.world, r.batch): r.tokens_per_s for r in df.itertuples()}

    def ratio(key_fn):
        return [t / tps.get(key_fn(r), math.nan) for r, t in zip(df.itertuples(), df["tokens_per_s"])]

    df["speedup"] = ratio(lambda r: (r.mode, r.allocator, 1, r.batch))
    df["speedup_vs_raw"] = ratio(lambda r: (r.mode, "raw", r.world, r.batch))
    df["ratio_vs_cupy_pool"] = ratio(lambda r: (r.mode, "cupy_pool", r.world, r.batch))
    return df


def frame(rows):
    """Rows (dicts with provenance) as a DataFrame: COLUMNS first, then provenance, with ratios filled."""
    import pandas as pd
    df = pd.DataFrame(rows)
    if df.empty:
        return pd.DataFrame(columns=COLUMNS)
    df = add_ratios(df)
    return df[COLUMNS + [c for c in df.columns if c not in COLUMNS]]


def write_csv(df, out) -> None:
    """Write df to out (making its folder); nothing when out is None."""
    if out is None:
        return
    folder = os.path.dirname(os.path.abspath(out))
    os.makedirs(folder, exist_ok=True)
    df.to_csv(out, index=False)
