"""Where one alloc+free pair's time goes on CuPy's path: xpool against the floor of CuPy's C-callback path, piece by
piece (the hit path must cost no more than CuPy's pool). The arms, the pieces and the differences taken:
Note [Hit path breakdown], below.

    python -m xlab.bench.hit [--trials 9] [--sizes 4096 12582912] [--out data/hit_breakdown.csv]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import pandas as pd
from tqdm.auto import tqdm

import xpool
import xpool_twin
from xlab import intervals
from xlab.allocators import KIB, MIB
from xlab.bench import at_least, gc_paused
from xlab.bench.alloc import rotated
from xlab.intervals import fmt_bytes, fmt_ci
from xlab.paths import publish
from xlab.provenance import has_gpu, provenance

# Note [Hit path breakdown]
# Arms timed in place, ns per pair (a CuPy memory object made through the arm, then dropped):
# - c_noop: CuPy's CFunctionAllocator calling C functions that do nothing: the floor of any allocator that plugs in
#   as xpool does (CuPy builds its memory object in Cython either way);
# - xpool_core: xpool's hooks with no stream lookup (every block on stream 0): free lists, counters, the pool mutex,
#   the allocator's reference per block, the exception checks;
# - xpool: xpool as shipped: + CuPy's get_stream_ptr(device) on every malloc (GPU only);
# - xpool_old_lookup: + CuPy's get_current_stream_ptr() instead (what CuPy's own pool calls): a thread-local and a
#   cudaGetDevice more (GPU only);
# - cupy_pool: CuPy's MemoryPool (GPU only).
# Pieces timed in C alone, nothing around them: core_c (xpool_core's pair, xlab._probes.time_pairs), lookup_c and
# old_lookup_c (one call of each lookup, xlab._probes.time_calls; GPU only). The breakdown subtracts arms paired by
# trial: core in place = xpool_core - c_noop, lookup in place = xpool - xpool_core, old lookup = xpool_old_lookup -
# xpool_core, CuPy's pool above the floor = cupy_pool - c_noop.
# On a GPU a pair is allocator.malloc(n) + del (cupy.empty adds the same ndarray to every arm); on a CPU, where CuPy
# cannot ask CUDA for the current device, it is CFunctionAllocatorMemory + MemoryPointer, what
# CFunctionAllocator.malloc makes, over host memory. Within a trial the arms take turns window by window (order
# rotated each round and each trial; Note [The microbenchmark's interleaving] in xlab/bench/alloc.py), an arm's
# time in the trial is the median of its windows, and the garbage collector is off while timing. What the GPU's
# breakdown decided: docs/decisions/0004-c-hot-path-through-cupys-cfunctionallocator.md.
SIZES = (4 * KIB, 12 * MIB)
TRIALS = 9
WINDOWS = 5
WINDOW_S = 0.02
COLUMNS = ["arm", "size_bytes", "trial", "ns", "calls", "windows", "trials"]
DIFFERENCES = (("core in place", "xpool_core", "c_noop"), ("lookup in place", "xpool", "xpool_core"),
               ("old lookup in place", "xpool_old_lookup", "xpool_core"), ("xpool above floor", "xpool", "c_noop"),
               ("cupy_pool above floor", "cupy_pool", "c_noop"), ("xpool - cupy_pool", "xpool", "cupy_pool"))


def pair_runner(arm, gpu: bool):
    """run(nbytes, pairs) -> ns of an in-place arm: a CuPy allocator (GPU), or C functions (CPU)."""
    if gpu:
        malloc = arm.malloc

        def run(nbytes, pairs):
            t0 = time.perf_counter_ns()
            for _ in range(pairs):
                m = malloc(nbytes)
                del m
            return time.perf_counter_ns() - t0
        return run
    from cupy.cuda.memory import CFunctionAllocatorMemory, MemoryPointer
    param, malloc_fn, free_fn = arm

    def run(nbytes, pairs):
        t0 = time.perf_counter_ns()
        for _ in range(pairs):
            m = MemoryPointer(CFunctionAllocatorMemory(nbytes, param, malloc_fn, free_fn, 0), 0)
            del m
        return time.perf_counter_ns() - t0
    return run


def make_arms(gpu: bool) -> dict:
    """{arm: run(nbytes, calls) -> ns} of what this machine can time; under "_keep" what they keep alive."""
    from xlab import _probes
    from xpool_twin import testing
    backend = xpool.backends.CupyBackend() if gpu else xpool_twin.HostBackend()
    core = testing.pool_with_stream_lookup(backend, 0)
    noop = _probes.noop_cfunctions(1 << 20)        # hands out a made-up pointer: nothing touches it
    arms, keep = {}, [core]
    if gpu:
        from cupy.cuda import MemoryPool, stream
        from cupy.cuda.memory import CFunctionAllocator
        # CuPy's get_current_stream_ptr takes no argument; called as fn(device), the device lands in a register
        # the callee never reads (x86-64 and AArch64 pass it in one), so the old lookup runs unchanged
        old_fn = testing.capsule_function(stream, "get_current_stream_ptr", b"intptr_t (void)")
        old = testing.pool_with_stream_lookup(backend, old_fn)
        shipped = xpool.MemoryPool(backend=backend)
        cfa = {name: CFunctionAllocator(*cf, owner) for name, cf, owner in
               (("c_noop", noop, None), ("xpool_core", testing.cfunctions(core), core),
                ("xpool_old_lookup", testing.cfunctions(old), old))}
        keep += [old, shipped, cfa]
        arms = {"c_noop": pair_runner(cfa["c_noop"], True), "xpool_core": pair_runner(cfa["xpool_core"], True),
                "xpool": pair_runner(shipped, True), "xpool_old_lookup": pair_runner(cfa["xpool_old_lookup"], True),
                "cupy_pool": pair_runner(MemoryPool(), True)}
        new_fn = testing.cupy_stream_lookup()
        arms["lookup_c"] = lambda nbytes, calls: _probes.time_calls(new_fn, calls, 0)
        arms["old_lookup_c"] = lambda nbytes, calls: _probes.time_calls(old_fn, calls)
    else:
        arms = {"c_noop": pair_runner(noop, False), "xpool_core": pair_runner(testing.cfunctions(core), False)}
    cf = testing.cfunctions(core)
    arms["core_c"] = lambda nbytes, calls: _probes.time_pairs(*cf, nbytes, calls)
    arms["_keep"] = keep
    return arms


def calibrated(run, nbytes: int, window_s: float) -> int:
    """Calls per window: about window_s seconds at the rate of a 2000-call pass (at least 100)."""
    run(nbytes, 200)
    return max(100, int(window_s * 1e9 * 2000 / max(run(nbytes, 2000), 1)))


def measure(sizes=SIZES, trials=TRIALS, windows=WINDOWS, window_s=WINDOW_S, gpu=None, progress=True):
    """Per (trial, arm, size): ns for `calls` calls at the median window's rate, arms taking turns (COLUMNS)."""
    gpu = has_gpu() if gpu is None else gpu
    arms = make_arms(gpu)
    keep = arms.pop("_keep")
    names = list(arms)
    calls = {(a, n): calibrated(arms[a], n, window_s) for a in names for n in sizes}
    rows = []
    order = [(t, n) for t in range(trials) for n in sizes]
    with gc_paused():
        for trial, n in tqdm(order, desc="hit trials", disable=not progress):
            rates = {a: [] for a in names}
            for w in range(windows):                     # the arms take turns window by window (alloc.py)
                for a in rotated(names, trial + w):
                    run, k = arms[a], calls[a, n]
                    run(n, 20)                           # this arm's block cached again, its code warm
                    rates[a].append(run(n, k) / k)
            for a in names:
                k = calls[a, n]
                rows.append(dict(arm=a, size_bytes=n, trial=trial, ns=statistics.median(rates[a]) * k, calls=k,
                                 windows=windows, trials=trials))
    for obj in keep:
        if hasattr(obj, "empty_cache"):
            obj.empty_cache()
    return pd.DataFrame(rows, columns=COLUMNS)


def breakdown(rows):
    """(per arm, differences): medians with 95% intervals of ns per call, DIFFERENCES paired by trial."""
    df = rows.assign(ns_per_call=rows.ns / rows.calls)
    arms = intervals.summarize(df, ["size_bytes", "arm"], "ns_per_call")
    diffs = []
    for n, g in df.groupby("size_bytes", sort=False):
        per = g.pivot_table(index="trial", columns="arm", values="ns_per_call")
        for label, a, b in DIFFERENCES:
            if a in per and b in per:
                med, lo, hi, k = intervals.median_ci((per[a] - per[b]).to_numpy())
                diffs.append(dict(size_bytes=n, difference=label, ns=med, lo=lo, hi=hi, n_trials=k))
    return arms, pd.DataFrame(diffs, columns=["size_bytes", "difference", "ns", "lo", "hi", "n_trials"])


def table(rows) -> str:
    """The breakdown of measure()'s rows as text."""
    arms, diffs = breakdown(rows)
    lines = ["ns per pair (arms in place, *_c alone in C; lookups: ns per call), median [95% interval]"]
    for n, g in arms.groupby("size_bytes", sort=False):
        lines.append(f"  {fmt_bytes(n)}: " + "; ".join(
            f"{r.arm} {fmt_ci(r.ns_per_call, r.ns_per_call_lo, r.ns_per_call_hi, '{:.0f}')}"
            for r in g.itertuples()))
    lines.append("differences paired by trial, ns per pair")
    for r in diffs.itertuples():
        lines.append(f"  {fmt_bytes(r.size_bytes)} {r.difference:<22} {fmt_ci(r.ns, r.lo, r.hi, '{:.0f}')}")
    return "\n".join(lines)


def run(out=None, trials=TRIALS, sizes=SIZES, window_s=WINDOW_S, progress=True):
    """Measure, print the breakdown, write the CSV (None: data/hit_breakdown[_host].csv; "": none)."""
    gpu = has_gpu()
    df = measure(tuple(sizes), trials, WINDOWS, window_s, gpu=gpu, progress=progress)
    df = df.assign(**provenance(bench="hit", path="gpu" if gpu else "host", window_s=window_s))
    return publish(df, f"data/hit_breakdown{'' if gpu else '_host'}.csv" if out is None else out, table(df))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m xlab.bench.hit", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="the CSV (default data/hit_breakdown.csv, or data/hit_breakdown_host.csv "
                    "without a GPU; '' for none)")
    ap.add_argument("--trials", type=at_least(1), default=TRIALS, help=f"trials, arms interleaved (default {TRIALS})")
    ap.add_argument("--sizes", nargs="+", type=at_least(1), default=list(SIZES), help="request sizes in bytes")
    ap.add_argument("--window-s", type=at_least(0.0, float), default=WINDOW_S, help=f"seconds per window (default {WINDOW_S}), "
                    f"{WINDOWS} windows per (trial, arm, size)")
    args = ap.parse_args(argv)
    run(args.out, args.trials, args.sizes, args.window_s)
    return 0


if __name__ == "__main__":
    sys.exit(main())
