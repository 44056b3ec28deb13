"""Allocator microbenchmark: µs per `a = cupy.empty(n, cupy.uint8); del a` pair, one thread at five sizes,
and thousands of pairs per second from 1, 4 and 8 threads on one device at 64 KiB.

    python -m xlab.bench.alloc [--quick] [--out data/alloc_microbench.csv]

Host-side costs: each measurement synchronises the device, then times many pairs with perf_counter_ns.
Every (allocator, case) is warmed up and calibrated to about `target_s` seconds once; then the repeats
interleave the allocators (rotating their order) so drift hits all of them alike. Reported: median,
min and max over the repeats; ratio_vs_cupy_pool = CuPy pool's median µs / this median µs (> 1: faster
than CuPy's pool). device_mallocs_per_pair comes from a separate counting pass (see allocators.py).
"""
from __future__ import annotations

import argparse
import sys
import threading
import time

from xlab import allocators as registry
from xlab.allocators import KIB, MIB, NoGPU

SIZES = (4 * KIB, 64 * KIB, MIB, 12 * MIB, 96 * MIB)
THREADS = (1, 4, 8)
THREAD_SIZE = 64 * KIB
ALLOCATORS = ("raw", "cupy_pool", "cupy_async", "xpool", "xpool_seed", "noop", "c_noop")
# Debug mode syncs and copies whole blocks to the host on every pair: measure it on its own, small sizes, e.g.
#   python -m xlab.bench.alloc --allocators cupy_pool xpool xpool_debug --sizes 4096 1048576 --target-s 0.2
COUNTED = ("raw", "cupy_pool", "xpool", "xpool_seed")
COLUMNS = ["allocator", "sweep", "size_bytes", "threads", "us_per_pair", "us_per_pair_min", "us_per_pair_max",
           "kpairs_per_s", "kpairs_per_s_max", "ratio_vs_cupy_pool", "device_mallocs_per_pair", "pairs", "repeats"]


# --- timing (GPU)

def time_pairs(nbytes: int, pairs: int) -> tuple[int, int]:
    """(ns, pairs) for `pairs` alloc/free pairs on this thread."""
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
    """(ns, pairs done) with `threads` threads released together by a barrier, pairs split among them."""
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
    sweep, nbytes, threads = case
    if sweep == "size":
        return lambda pairs: time_pairs(nbytes, pairs)
    return lambda pairs: time_threads(nbytes, pairs, threads)


def calibrated_pairs(ns: int, pairs: int, target_s: float, lo: int = 200, hi: int = 400_000) -> int:
    """Pairs that take about target_s at the rate of a trial (ns for pairs), within [lo, hi]."""
    return int(min(hi, max(lo, target_s * 1e9 * pairs / max(ns, 1))))


def measure(allocators=ALLOCATORS, sizes=SIZES, threads=THREADS, repeats=7, target_s=0.05, count_pairs=200,
            progress=True):
    """Raw samples: one row per (repeat, allocator, case) with ns and pairs; and mallocs per pair by
    (allocator, size) from the counting pass."""
    import pandas as pd
    from tqdm.auto import tqdm
    cases = [("size", n, 1) for n in sizes] + [("threads", THREAD_SIZE, t) for t in threads]
    allocs = {a: registry.make(a, **({"capacity": max(sizes)} if a.endswith("noop") else {})) for a in allocators}
    pairs, samples = {}, []
    for name in tqdm(allocators, desc="warm-up", disable=not progress):
        with _installed(allocs[name]):
            for case in cases:
                run = timer(case)
                run(50)                                     # fill the caches
                pairs[name, case] = calibrated_pairs(*run(200), target_s)
    for rep in tqdm(range(repeats), desc="repeats", disable=not progress):
        order = list(allocators[rep % len(allocators):]) + list(allocators[:rep % len(allocators)])
        for name in order:
            with _installed(allocs[name]):
                for case in cases:
                    ns, n = timer(case)(pairs[name, case])
                    samples.append(dict(allocator=name, sweep=case[0], size_bytes=case[1], threads=case[2],
                                        repeat=rep, ns=ns, pairs=n))
    mallocs = {}
    for name in [a for a in allocators if a in COUNTED]:
        alloc = allocs[name]
        with _installed(alloc, counting=True), alloc.tracking():
            for n in sizes:
                time_pairs(n, 20)
                m0 = alloc.device_mallocs(0)
                time_pairs(n, count_pairs)
                mallocs[name, n] = (alloc.device_mallocs(0) - m0) / count_pairs
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

def summarize(samples, mallocs=None):
    """One row per (allocator, sweep, size, threads): median/min/max over repeats, ratio to CuPy's pool."""
    import numpy as np
    import pandas as pd
    mallocs = mallocs or {}
    s = samples.assign(us=samples.ns / samples.pairs / 1e3, kps=samples.pairs * 1e6 / samples.ns)
    keys = ["allocator", "sweep", "size_bytes", "threads"]
    g = s.groupby(keys, sort=False)
    df = pd.DataFrame({
        "us_per_pair": g.us.median(), "us_per_pair_min": g.us.min(), "us_per_pair_max": g.us.max(),
        "kpairs_per_s": g.kps.median(), "kpairs_per_s_max": g.kps.max(), "pairs": g.pairs.median(),
        "repeats": g.us.size()}).reset_index()
    base = df[df.allocator == "cupy_pool"].set_index(["sweep", "size_bytes", "threads"]).us_per_pair
    df["ratio_vs_cupy_pool"] = [base.get((r.sweep, r.size_bytes, r.threads), np.nan) / r.us_per_pair
                                for r in df.itertuples()]
    df["device_mallocs_per_pair"] = [mallocs.get((r.allocator, r.size_bytes), np.nan) if r.sweep == "size"
                                     else np.nan for r in df.itertuples()]
    return df[COLUMNS]


def fmt_size(n: int) -> str:
    for unit, scale in (("MiB", MIB), ("KiB", KIB)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def table(summary) -> str:
    """Two plain-text tables: µs per pair by size, and kpairs/s by threads; (×) = ratio vs CuPy's pool."""
    lines = []
    for sweep, col, value, unit in (("size", "size_bytes", "us_per_pair", "µs per pair (median)"),
                                    ("threads", "threads", "kpairs_per_s", "thousand pairs/s, 64 KiB")):
        part = summary[summary.sweep == sweep]
        if part.empty:
            continue
        heads = list(dict.fromkeys(part[col]))
        names = list(dict.fromkeys(part.allocator))
        label = (lambda h: fmt_size(h)) if sweep == "size" else (lambda h: f"{h} thr")
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


def with_provenance(summary, **params):
    """Every row gets the provenance columns (GPU, driver, CUDA, CuPy, commit, date) and the run's params."""
    from xlab.provenance import provenance
    prov = provenance(bench="alloc", **params)
    return summary.assign(**prov)


def write_csv(df, out) -> None:
    import os
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    df.to_csv(out, index=False)


def run(out="data/alloc_microbench.csv", quick=False, repeats=None, target_s=None, allocators=ALLOCATORS,
        progress=True, sizes=SIZES):
    """Measure, summarise, print the table, write the CSV; returns the summary DataFrame."""
    registry.require_gpus(1, "xlab.bench.alloc")
    repeats = repeats or (5 if quick else 9)
    # 50 ms windows (the first H200 run) let the spread within one case reach 2x: time longer
    target_s = target_s or (0.005 if quick else 0.25)
    samples, mallocs = measure(allocators, sizes=tuple(sizes), repeats=repeats, target_s=target_s,
                               progress=progress)
    df = with_provenance(summarize(samples, mallocs), repeats=repeats, target_s=target_s, quick=quick)
    print(table(df))
    if out:
        write_csv(df, out)
        print(f"wrote {out}")
    return df


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m xlab.bench.alloc", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="data/alloc_microbench.csv")
    ap.add_argument("--quick", action="store_true", help="fewer pairs and repeats: a smoke run")
    ap.add_argument("--repeats", type=int, help="repeats (default 7; 5 with --quick)")
    ap.add_argument("--allocators", nargs="+", default=list(ALLOCATORS))
    ap.add_argument("--sizes", nargs="+", type=int, default=list(SIZES), help="request sizes in bytes")
    ap.add_argument("--target-s", type=float, help="seconds per timed window (default 0.25; 0.005 with --quick)")
    args = ap.parse_args(argv)
    if "cupy_pool" not in args.allocators:
        ap.error("the ratios need cupy_pool among --allocators")
    if any(n <= 0 for n in args.sizes):
        ap.error("--sizes must be positive byte counts")
    try:
        run(args.out, args.quick, args.repeats, args.target_s, allocators=tuple(args.allocators), sizes=args.sizes)
    except NoGPU as e:
        print(f"xlab.bench.alloc: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
