"""The experiments' runner: trials interleaved across arms (A B C, A B C, ...); each arm a fresh allocator
installed around the rank functions an experiment composes from train.py. `ranks(alloc, steps)` runs every rank of
one arm and returns their `train.run_rank` dicts; the runner owns the allocator's life (make, install, run,
uninstall, collect garbage, release) and, where counting costs time (raw, CuPy's pool), a separate short counting
run in the first trial only (counts do not vary between trials; timing does).
"""
from __future__ import annotations

import contextlib
import gc
import pathlib
import threading

import pandas as pd
from tqdm.auto import tqdm

from xlab import allocators as registry
from xlab.paths import write_csv
from xlab.provenance import git_commit, provenance

from . import train

RANK_TIMEOUT = 900.0      # seconds a rank thread may run before run_threads gives up on it (a hang inside NCCL)


def interleaved(trials: int, arms):
    """(trial, arm) pairs in the order A B C, A B C, ...: drift between trials hits every arm alike."""
    arms = list(arms)
    if trials < 1 or not arms:
        raise ValueError(f"trials must be >= 1 and arms non-empty; got trials={trials!r}, arms={arms!r}")
    return [(t, a) for t in range(trials) for a in arms]


@contextlib.contextmanager
def installed(name: str, counting: bool, devices):
    """A fresh allocator, installed for the block; then uninstalled, collected, released on `devices`."""
    alloc = registry.make(name)
    alloc.install(counting)
    try:
        yield alloc
    finally:
        alloc.uninstall()
        gc.collect()
        alloc.release(devices)


def run_arm(name: str, ranks, steps: int, count_steps: int, devices, count: bool = True) -> dict:
    """One arm of one trial, fresh allocators released on `devices`: `steps` timed steps and, unless counting is
    free or not asked for, a counting run of `count_steps`; dict(allocator, timed, counted, counted_steps)."""
    with installed(name, False, devices) as alloc:
        timed = ranks(alloc, steps)
        free = alloc.free_counting
    if free:
        return dict(allocator=name, timed=timed, counted=timed, counted_steps=steps)
    if not count or count_steps <= 0:
        return dict(allocator=name, timed=timed, counted=None, counted_steps=0)
    with installed(name, True, devices) as alloc:
        counted = ranks(alloc, count_steps)
    return dict(allocator=name, timed=timed, counted=counted, counted_steps=count_steps)


def run_threads(world: int, fn, device_ctx=None, timeout: float | None = None) -> list:
    """[fn(0), ..., fn(world - 1)], each on a thread of its own inside device_ctx(rank) if given; TimeoutError after
    `timeout` seconds (a peer failed inside NCCL?), RuntimeError chaining the first rank's failure."""
    results, errors = [None] * world, []
    timeout = RANK_TIMEOUT if timeout is None else timeout

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


def resumed(out, keys, **same) -> tuple[list, set]:
    """(rows, their `keys`) an interrupted run of this experiment and these settings (`same`) left in `out`."""
    if out is None or not pathlib.Path(out).is_file():
        return [], set()
    df = pd.read_csv(out)
    if not set(keys) | set(same) <= set(df.columns):
        return [], set()
    for col, value in same.items():
        df = df[df[col].astype(str) == str(value)]
    rows = df.to_dict("records")
    return rows, {tuple(r[k] for k in keys) for r in rows}


def run_trials(name: str, one, configs, trials: int, out, keys, resume: bool, progress: bool, **same):
    """one(trial, *config)'s rows of every interleaved (trial, config) not yet in `out`, rewritten each time."""
    rows, done = resumed(out, keys, commit=git_commit(), **same) if resume else ([], set())
    for trial, config in tqdm(interleaved(trials, configs), desc=name, disable=not progress):
        if (trial, *config) not in done:
            rows.append({**one(trial, *config), **provenance(experiment=name, trials=trials)})
            write_csv(train.frame(rows), out)
    return train.frame(rows)
