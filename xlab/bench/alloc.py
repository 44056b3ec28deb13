"""Allocator microbenchmark: µs per `a = cupy.empty(n, cupy.uint8); del a` pair, one thread at five sizes,
and thousands of pairs per second from 1, 4 and 8 threads on one device at 64 KiB.

    python -m xlab.bench.alloc [--quick] [--trials 5] [--out data/alloc_microbench.csv]

Host-side costs: each window synchronises the device, then times many pairs with perf_counter_ns. Every
(allocator, case) is calibrated once to about `target_s` seconds per window; then `trials` trials run the
allocators in a fixed order (A B C D, A B C D, ...), so drift hits all of them alike. The CSV keeps one row per
(trial, allocator, case); ratio_vs_cupy_pool is CuPy's pool's time over this allocator's in the same trial
(> 1: faster than CuPy's pool); the report takes medians with bootstrap intervals (xlab.intervals).
device_mallocs_per_pair comes from a separate counting pass (see allocators.py).

Each arm runs alone: before an allocator is timed, every other one gives its cached blocks back (`trim`), then
the arm warms its own cache (untimed) for each case. The raw arm times exactly `cupy.empty(n, uint8)` + `del` with
CuPy's allocator unset (cudaMalloc + cudaFree through CuPy's `Memory`), but what a raw pair costs depends on the
state of the device: 68-73 µs at 4 KiB measured alone (shared/ANCHORS.md), 2.6 µs for bare
`runtime.malloc`+`free` and 4.6 µs through `cupy.empty` in a process whose CuPy pool still held a training run's
blocks (data/raw_pair_probe.csv), and 6.8 µs in the first version of this benchmark, which timed raw beside the
other arms' cached blocks while its own calibration pass, run first on an empty device, took ~120 µs per pair.
So the first CSV's raw was not wrong but measured another state. `raw` is now timed alone; `raw_held` keeps one
512-byte block alive while timed, to show whether other live blocks are what makes a pair cheap.
PyTorch's caching allocator (`torch`) takes part where PyTorch with CUDA is installed.
"""
from __future__ import annotations

import argparse
import sys
import threading
import time

from xlab import allocators as registry
from xlab.allocators import KIB, MIB, NoGPU
from xlab.experiments.runner import interleaved
from xlab.paths import write_csv

SIZES = (4 * KIB, 64 * KIB, MIB, 12 * MIB, 96 * MIB)
THREADS = (1, 4, 8)
THREAD_SIZE = 64 * KIB
TRIALS = 5
# Debug mode syncs and copies whole blocks to the host on every pair: measure it on its own, small sizes, e.g.
#   python -m xlab.bench.alloc --allocators cupy_pool xpool_k1 xpool_k1_debug --sizes 4096 1048576 --target-s 0.2
COLUMNS = ["allocator", "sweep", "size_bytes", "threads", "trial", "us_per_pair", "kpairs_per_s",
           "ratio_vs_cupy_pool", "device_mallocs_per_pair", "pairs", "trials"]


def default_allocators() -> tuple:
    """Every arm this machine can run: raw alone and with a small block held, CuPy's two pools, PyTorch's (if
    PyTorch with CUDA is installed), xpool's two arms, and the two floors (allocators doing no work)."""
    arms = ["raw", "raw_held", "cupy_pool", "cupy_async"]
    if torch_available():
        arms.append("torch")
    return tuple(arms) + registry.xpool_arms() + ("noop", "c_noop")


def torch_available() -> bool:
    """True when PyTorch imports and sees a CUDA device."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


# --- timing (GPU)

def time_pairs(nbytes: int, pairs: int) -> tuple[int, int]:
    """(ns, pairs) for `pairs` alloc/free pairs on this thread.

    Args:
        nbytes: the request size.
        pairs: how many pairs.

    Returns:
        (nanoseconds, pairs).
    """
    import cupy
    empty, u8 = cupy.empty, cupy.uint8
    cupy.cuda.Device().synchronize()
    t0 = time.perf_counter_ns()
    for _ in range(pairs):
        a = empty(nbytes, u8)
        del a
    cupy.cuda.Device().synchronize()
    return time.perf_counter_ns() - t0, pairs


def time_threads(nbytes: int, pairs: int, threads: int) -> tuple[int, int]:
    """(ns, pairs done) with `threads` threads released together by a barrier, pairs split among them.

    Args:
        nbytes: the request size.
        pairs: pairs in all.
        threads: threads.

    Returns:
        (nanoseconds, pairs done).
    """
    import cupy
    per = max(1, pairs // threads)
    barrier, errors = threading.Barrier(threads + 1), []

    def work():
        try:
            with cupy.cuda.Device(0):
                a = cupy.empty(nbytes, cupy.uint8)      # this thread's CuPy state, before the clock
                del a
                barrier.wait()
                empty, u8 = cupy.empty, cupy.uint8
                for _ in range(per):
                    a = empty(nbytes, u8)
                    del a
        except BaseException as e:       # noqa: BLE001 - re-raised below
            errors.append(e)
            barrier.abort()

    ts = [threading.Thread(target=work, daemon=True) for _ in range(threads)]
    for t in ts:
        t.start()
    cupy.cuda.Device(0).synchronize()
    barrier.wait()
    t0 = time.perf_counter_ns()
    for t in ts:
        t.join()
    cupy.cuda.Device(0).synchronize()
    ns = time.perf_counter_ns() - t0
    if errors:
        raise errors[0]
    return ns, per * threads


def timer(case):
    """The timing function of one case.

    Args:
        case: (sweep, nbytes, threads).

    Returns:
        timer(pairs) -> (ns, pairs).
    """
    sweep, nbytes, threads = case
    if sweep == "size":
        return lambda pairs: time_pairs(nbytes, pairs)
    return lambda pairs: time_threads(nbytes, pairs, threads)


def calibrated_pairs(ns: int, pairs: int, target_s: float, lo: int = 200, hi: int = 400_000) -> int:
    """Pairs that take about target_s at the rate of a trial (ns for pairs), within [lo, hi].

    Args:
        ns, pairs: a trial window's time and pairs.
        target_s: the window to aim for.
        lo, hi: the bounds.

    Returns:
        An int.
    """
    return int(min(hi, max(lo, target_s * 1e9 * pairs / max(ns, 1))))


def measure(allocators=None, sizes=SIZES, threads=THREADS, trials=TRIALS, target_s=0.1, count_pairs=200,
            progress=True):
    """Raw samples: one row per (trial, allocator, case) with ns and pairs; and mallocs per pair by
    (allocator, size) from the counting pass (allocators that can count).

    Args:
        allocators: registry names (default: default_allocators()).
        sizes: the size sweep's request sizes.
        threads: the thread sweep's thread counts.
        trials: trials per arm.
        target_s: seconds per window.
        count_pairs: pairs of the counting pass.
        progress: progress bars.

    Returns:
        (samples DataFrame, {(allocator, size): device mallocs per pair}).
    """
    import pandas as pd
    from tqdm.auto import tqdm
    allocators = tuple(allocators or default_allocators())
    cases = [("size", n, 1) for n in sizes] + [("threads", THREAD_SIZE, t) for t in threads]
    allocs = {a: registry.make(a, **({"capacity": max(sizes)} if a.endswith("noop") else {})) for a in allocators}

    def alone(name, counting=False):
        """Every other arm gives its cache back: nothing but this arm's blocks lives on the device."""
        for other, a in allocs.items():
            if other != name:
                a.trim([0])
        return _installed(allocs[name], counting)

    pairs, samples = {}, []
    for name in tqdm(allocators, desc="calibrate", disable=not progress):
        with alone(name):
            for case in cases:
                run = timer(case)
                run(50)                                     # fill the cache
                pairs[name, case] = calibrated_pairs(*run(200), target_s)
    for trial, name in tqdm(interleaved(trials, allocators), desc="trials", disable=not progress):
        with alone(name):
            for case in cases:
                run = timer(case)
                run(50)                                     # this arm's cache, warm again after the others ran
                ns, n = run(pairs[name, case])
                samples.append(dict(allocator=name, sweep=case[0], size_bytes=case[1], threads=case[2],
                                    trial=trial, ns=ns, pairs=n))
    mallocs = {}
    for name, alloc in allocs.items():
        if name in ("cupy_async", "noop", "c_noop"):
            continue                                        # they cannot count
        with alone(name, counting=True), alloc.tracking():
            for n in sizes:
                time_pairs(n, 20)
                m0 = alloc.device_mallocs(0)
                time_pairs(n, count_pairs)
                m1 = alloc.device_mallocs(0)
                if m0 is not None and m1 is not None:
                    mallocs[name, n] = (m1 - m0) / count_pairs
    for alloc in allocs.values():
        alloc.release([0])
    return pd.DataFrame(samples), mallocs


class _installed:
    def __init__(self, alloc, counting=False):
        self.alloc, self.counting = alloc, counting

    def __enter__(self):
        self.alloc.install(self.counting)
        return self.alloc

    def __exit__(self, *exc):
        self.alloc.uninstall()
        return False


# --- pure logic (tested on a CPU with fake timings)

def trial_rows(samples, mallocs=None):
    """The CSV's rows: one per (trial, allocator, case) with µs per pair, thousand pairs/s and the ratio to CuPy's
    pool in the same trial (NaN without it); device mallocs per pair from the counting pass (size sweep only).

    Args:
        samples: measure()'s samples.
        mallocs: measure()'s counts.

    Returns:
        A DataFrame with COLUMNS.
    """
    import numpy as np
    mallocs = mallocs or {}
    df = samples.assign(us_per_pair=samples.ns / samples.pairs / 1e3, kpairs_per_s=samples.pairs * 1e6 / samples.ns)
    base = df[df.allocator == "cupy_pool"].set_index(["sweep", "size_bytes", "threads", "trial"]).us_per_pair
    df["ratio_vs_cupy_pool"] = [base.get((r.sweep, r.size_bytes, r.threads, r.trial), np.nan) / r.us_per_pair
                                for r in df.itertuples()]
    df["device_mallocs_per_pair"] = [mallocs.get((r.allocator, r.size_bytes), np.nan) if r.sweep == "size"
                                     else np.nan for r in df.itertuples()]
    df["trials"] = df["trial"].nunique() if len(df) else 0
    return df[COLUMNS].reset_index(drop=True)


def summary(rows):
    """Medians over trials with 95% intervals: one row per (allocator, sweep, size, threads) with us_per_pair,
    kpairs_per_s and ratio_vs_cupy_pool (each with _lo/_hi), n_trials and device_mallocs_per_pair. Old CSVs (one summary row per case,
    no trial column) come out as single runs.

    Args:
        rows: the CSV's rows.

    Returns:
        A DataFrame.
    """
    from xlab import intervals
    keys = ["allocator", "sweep", "size_bytes", "threads"]
    out = None
    for col in ("us_per_pair", "kpairs_per_s", "ratio_vs_cupy_pool"):
        s = intervals.summarize(rows, keys, col)
        out = s if out is None else out.merge(s.drop(columns="n_trials"), on=keys)
    counts = rows.groupby(keys, sort=False)["device_mallocs_per_pair"].median().reset_index()   # exact: no interval
    return out.merge(counts, on=keys)


def table(summary) -> str:
    """Two plain-text tables of medians over trials: µs per pair by size, and kpairs/s by threads; (x) = speed
    relative to CuPy's pool in the same trial (median of the paired ratios).

    Args:
        summary: summary()'s frame.

    Returns:
        The text.
    """
    from xlab.plots import fmt_bytes
    lines = []
    for sweep, col, value, unit in (("size", "size_bytes", "us_per_pair", "µs per pair (median)"),
                                    ("threads", "threads", "kpairs_per_s", "thousand pairs/s, 64 KiB")):
        part = summary[summary.sweep == sweep]
        if part.empty:
            continue
        heads = list(dict.fromkeys(part[col]))
        names = list(dict.fromkeys(part.allocator))
        label = fmt_bytes if sweep == "size" else (lambda h: f"{h} thr")
        lines.append(f"{unit}; (x) = speed vs cupy_pool")
        lines.append(f"{'allocator':<12}" + "".join(f"{label(h):>18}" for h in heads))
        for name in names:
            cells = []
            for h in heads:
                r = part[(part.allocator == name) & (part[col] == h)]
                cells.append(f"{r[value].iloc[0]:9.2f} ({r.ratio_vs_cupy_pool.iloc[0]:5.2f}x)" if len(r) else "")
            lines.append(f"{name:<12}" + "".join(f"{c:>18}" for c in cells))
        lines.append("")
    return "\n".join(lines)


def with_provenance(rows, **params):
    """Every row gets the provenance columns (GPU, driver, CUDA, CuPy, commit, date) and the run's params.

    Args:
        rows: the CSV's rows.
        **params: the run's parameters.

    Returns:
        A new DataFrame.
    """
    from xlab.provenance import provenance
    return rows.assign(**provenance(bench="alloc", **params))


def run(out="data/alloc_microbench.csv", quick=False, trials=None, target_s=None, allocators=None,
        progress=True, sizes=SIZES):
    """Measure, print the table of medians, write the CSV (one row per trial).

    Args:
        out: the CSV (None: none).
        quick: a smoke run (2 trials, 5 ms windows).
        trials: trials per arm (default 5).
        target_s: seconds per timed window (default 0.1).
        allocators: registry names (default: default_allocators()).
        progress: progress bars.
        sizes: request sizes of the size sweep, bytes.

    Returns:
        The per-trial DataFrame that was written.
    """
    registry.require_gpus(1, "xlab.bench.alloc")
    trials = trials or (2 if quick else TRIALS)
    target_s = target_s or (0.005 if quick else 0.1)
    allocators = tuple(allocators or default_allocators())
    samples, mallocs = measure(allocators, sizes=tuple(sizes), trials=trials, target_s=target_s,
                               progress=progress)
    df = with_provenance(trial_rows(samples, mallocs), target_s=target_s, quick=quick)
    print(table(summary(df)))
    if out:
        write_csv(df, out)
        print(f"wrote {out}")
    return df


def main(argv=None) -> int:
    """The command line (see --help).

    Args:
        argv: arguments (default: sys.argv[1:]).

    Returns:
        The exit status: 2 without a GPU.
    """
    ap = argparse.ArgumentParser(prog="python -m xlab.bench.alloc", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="data/alloc_microbench.csv")
    ap.add_argument("--quick", action="store_true", help="fewer pairs and trials: a smoke run")
    ap.add_argument("--trials", type=int, help="trials per arm, interleaved (default 5; 2 with --quick)")
    ap.add_argument("--allocators", nargs="+", help="registry names (default: every arm this machine can run)")
    ap.add_argument("--sizes", nargs="+", type=int, default=list(SIZES), help="request sizes in bytes")
    ap.add_argument("--target-s", type=float, help="seconds per timed window (default 0.1; 0.005 with --quick)")
    args = ap.parse_args(argv)
    if args.allocators and "cupy_pool" not in args.allocators:
        ap.error("the ratios need cupy_pool among --allocators")
    if any(n <= 0 for n in args.sizes):
        ap.error("--sizes must be positive byte counts")
    if args.trials is not None and args.trials < 1:
        ap.error("--trials must be at least 1")
    try:
        run(args.out, args.quick, args.trials, args.target_s, allocators=args.allocators, sizes=args.sizes)
    except NoGPU as e:
        print(f"xlab.bench.alloc: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
