"""The experiments' runner: trials interleaved across arms; each arm is a fresh allocator installed around the
rank functions an experiment composes from train.py.

    for trial, name in interleaved(5, ("raw", "cupy_pool", "xpool")):     # A B C, A B C, ...
        m = run_arm(name, ranks, steps, count_steps, devices, count=trial == 0)

`ranks(alloc, steps)` runs every rank of one arm (in this thread, one thread per GPU, or this process's one rank)
and returns their `train.run_rank` dicts. The runner owns the allocator's life: make, install, run, uninstall,
collect garbage, release; and, for allocators whose counting costs time (raw, CuPy's pool), a separate short
counting run, made in the first trial only (counts do not vary between trials; timing does).
"""
from __future__ import annotations

import contextlib
import gc
import threading

from xlab import allocators as registry

RANK_TIMEOUT = 900.0      # seconds a rank thread may run before run_threads gives up on it (a hang inside NCCL)


def interleaved(trials: int, arms):
    """(trial, arm) pairs in the order A B C, A B C, ...: drift between trials hits every arm alike.

    Args: trials: how many trials (at least 1); arms: the arms, in a fixed order. Returns: A list of (trial, arm).
    Raises: ValueError: trials < 1 or no arms.
    """
    arms = list(arms)
    if trials < 1 or not arms:
        raise ValueError(f"trials must be >= 1 and arms non-empty; got trials={trials!r}, arms={arms!r}")
    return [(t, a) for t in range(trials) for a in arms]


@contextlib.contextmanager
def installed(name: str, counting: bool, devices):
    """A fresh allocator `name`, installed for the block; afterwards uninstalled, garbage collected (arrays in
    reference cycles die before their pool) and released on `devices`.

    Args: name: a registry name; counting: install the counting variant; devices: the devices to release on
    afterwards. Returns: A context manager giving the installed Allocator.
    """
    alloc = registry.make(name)
    alloc.install(counting)
    try:
        yield alloc
    finally:
        alloc.uninstall()
        gc.collect()
        alloc.release(devices)


def run_arm(name: str, ranks, steps: int, count_steps: int, devices, count: bool = True) -> dict:
    """One arm of one trial: a timed run and, unless counting is free (or count is False or count_steps is 0),
    a counting run, each with a fresh allocator.

    Args: name: the allocator's registry name; ranks: ranks(alloc, steps) -> every rank's run_rank dict; steps,
    count_steps: timed steps, and steps of the counting run; devices: the devices the ranks use (released
    afterwards); count: make the counting run (the experiments do so in trial 0 only). Returns: dict(allocator,
    timed, counted, counted_steps) for train.build_row; counted is None when not counted.
    """
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
    """fn(rank) on one thread per rank (inside device_ctx(rank) when given); results in rank order.

    Raises: TimeoutError: a rank still runs after `timeout` seconds (a peer failed inside NCCL?); RuntimeError: a
    rank raised (the first failure, chained). Args: world: threads; fn: fn(rank) -> result; device_ctx:
    device_ctx(rank) -> a context entered in the thread (e.g. cupy.cuda.Device), or None; timeout: seconds to wait
    for each thread (default RANK_TIMEOUT). Returns: [fn(0), ..., fn(world - 1)].
    """
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
    """The rows an earlier, interrupted run of the same experiment left in `out`, to finish it instead of
    starting over (a stage stopped by a time limit: never fewer trials, the rest in a later run).

    Args: out: the CSV (None or missing: nothing to resume); keys: the columns that name one run, e.g. ("trial",
    "batch", "allocator"); **same: columns whose values must match this run (commit, config, steps, ...); rows that
    differ are dropped, so a CSV of another commit or another setting is never mixed in. Returns: (rows as dicts,
    the set of key tuples already measured).
    """
    import pathlib

    import pandas as pd
    if out is None or not pathlib.Path(out).is_file():
        return [], set()
    df = pd.read_csv(out)
    for col, value in same.items():
        if col not in df:
            return [], set()
        df = df[df[col].astype(str) == str(value)]
    if not set(keys) <= set(df.columns):
        return [], set()
    rows = df.to_dict("records")
    return rows, {tuple(r[k] for k in keys) for r in rows}
