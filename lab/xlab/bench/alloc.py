"""Allocator microbenchmark: µs per `a = cupy.empty(n, cupy.uint8); del a` pair, one thread at five sizes, and
thousands of pairs per second from 1, 4 and 8 threads on one device at 64 KiB; `--host`: xpool's C core alone over
host memory on a CPU; `--xpool-path`: another build of xpool timed beside this one (#20).

    python -m xlab.bench.alloc [--quick] [--trials 7] [--sweep size] [--out data/alloc_microbench.csv]

Each (arm, case) is calibrated to about `target_s` seconds per trial, timed as `windows` windows; the arms that
keep a cached block take turns window by window, those that call the device on every pair run alone (Note [The
microbenchmark's interleaving], below). ratio_vs_cupy_pool: CuPy's pool's time over the arm's in the same trial.
"""
from __future__ import annotations

import argparse
import contextlib
import random
import statistics
import sys
import threading
import time

import pandas as pd
from tqdm.auto import tqdm

import xpool
import xpool_twin
from xlab import allocators as registry, intervals
from xlab.allocators import KIB, MIB, NoGPU
from xlab.bench import at_least, gc_paused
from xlab.intervals import fmt_bytes
from xlab.paths import publish
from xlab.provenance import provenance

# Note [The microbenchmark's interleaving]
# A pair costs a few hundred nanoseconds, and the lent machines have slow spells of seconds in which every arm, the
# floors too, runs up to 2x slower. Two samples of a ratio taken seconds apart measure the spell, not the arms: an
# arm timed through all cases before the next arm, or an arm's windows of a case timed in one go before the next
# arm's, put one arm in a spell and not the other (on the H200 a ratio moved by up to 1.8x that way). So the cached
# arms of a size case (the pools, the floors) take turns window by window: WINDOWS windows of about
# TARGET_S / WINDOWS seconds per arm, the order rotated each round and each trial, an arm's trial time the median of
# its windows. A spell then lands on every arm alike; one that starts or ends inside a case can still put one arm's
# median window in it and not the other's, and the median over trials takes such a trial as an outlier. Each arm
# warms its own cache (untimed) for each case, and again for SWITCH_WARM pairs whenever it is installed for a
# window. Ratios are taken per trial (docs/decisions/0008-how-the-lab-measures.md).
# Arms that call the device on every pair (raw, raw_held, cupy_async) run alone, each after the others have
# trimmed their caches: what a raw cudaMalloc + cudaFree costs depends on the device's state. Timed beside other
# arms' cached blocks, or in a process whose pool holds blocks, a raw pair is a few microseconds; alone on an empty
# device it is about a hundred (the driver's bookkeeping for a first or last allocation is the plausible cause).
# So `raw` is timed alone, and `raw_held` keeps one 512-byte block alive while timed, to show whether one live
# block is what makes a pair cheap.

SIZES = (4 * KIB, 64 * KIB, MIB, 12 * MIB, 96 * MIB)
THREADS = (1, 4, 8)
THREAD_SIZE = 64 * KIB
TRIALS = 7
TARGET_S = 0.12     # seconds per (trial, arm, case), split into WINDOWS windows
WINDOWS = 9         # per (trial, arm, case) of the size sweep: the cached arms take turns window by window
SWITCH_WARM = 20    # untimed pairs after an arm is installed for a window: its code and block warm again
# Debug mode syncs and copies whole blocks to the host on every pair: measure it on its own, small sizes, e.g.
#   python -m xlab.bench.alloc --allocators cupy_pool xpool_k1 xpool_k1_debug --sizes 4096 1048576 --target-s 0.2
COLUMNS = ["allocator", "sweep", "size_bytes", "threads", "trial", "us_per_pair", "kpairs_per_s",
           "ratio_vs_cupy_pool", "device_mallocs_per_pair", "pairs", "trials", "windows"]


def default_allocators() -> tuple:
    """allocators.SETS["bench"], less PyTorch's (cupy_torch) where PyTorch has no CUDA device."""
    return tuple(a for a in registry.SETS["bench"] if a != "cupy_torch" or torch_available())


def torch_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


# --- timing (GPU)
def time_pairs(nbytes: int, pairs: int) -> tuple[int, int]:
    """(ns, pairs) for `pairs` alloc/free pairs of `nbytes` on this thread."""
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
    """timer(pairs) -> (ns, pairs) of one case, (sweep, nbytes, threads)."""
    sweep, nbytes, threads = case
    return lambda pairs: time_pairs(nbytes, pairs) if sweep == "size" else time_threads(nbytes, pairs, threads)


def calibrated_pairs(ns: int, pairs: int, target_s: float, lo: int = 200, hi: int = 400_000) -> int:
    """Pairs that take about target_s at the rate of a trial (ns for pairs), within [lo, hi]."""
    return int(min(hi, max(lo, target_s * 1e9 * pairs / max(ns, 1))))


def rotated(arms, trial: int) -> list:
    """The arms rotated by `trial`: across trials each arm runs in each position, after each other."""
    arms = list(arms)
    k = trial % len(arms) if arms else 0
    return arms[k:] + arms[:k]


def _median_rate(windows) -> tuple[int, int]:
    """(ns, pairs) of windows [(ns, pairs), ...]: all their pairs at the median window's ns per pair."""
    done = sum(n for _, n in windows)
    return int(statistics.median(ns / n for ns, n in windows) * done), done


def median_window(run, pairs: int, windows: int) -> tuple[int, int]:
    """(ns, pairs) of `windows` windows of run(pairs // windows), at the median window's rate."""
    return _median_rate([run(max(1, pairs // windows)) for _ in range(windows)])


@contextlib.contextmanager
def _installed(alloc, counting=False):
    alloc.install(counting)
    try:
        yield alloc
    finally:
        alloc.uninstall()


def measure(allocators=None, sizes=SIZES, threads=THREADS, trials=TRIALS, target_s=TARGET_S, count_pairs=200,
            progress=True, windows=WINDOWS):
    """(samples, mallocs): ns and pairs per (trial, allocator, case), the size sweep's the median of `windows`
    windows; and device mallocs per pair by (allocator, size) from a counting pass of the arms that can count."""
    allocators = tuple(allocators or default_allocators())
    cases = [("size", n, 1) for n in sizes] + [("threads", THREAD_SIZE, t) for t in threads]
    capacity = max((*sizes, THREAD_SIZE))                  # the floors hand out one block: big enough for all
    allocs = {a: OTHER_BUILD[a]() if a in OTHER_BUILD else
              registry.make(a, **({"capacity": capacity} if a.endswith("noop") else {})) for a in allocators}

    def trim_all_but(names):
        for other, a in allocs.items():
            if other not in names:
                a.trim([0])

    def alone(name, counting=False):
        """Every other arm gives its cache back: nothing but this arm's blocks lives on the device."""
        trim_all_but((name,))
        return _installed(allocs[name], counting)

    pairs, samples = {}, []
    for name in tqdm(allocators, desc="calibrate", disable=not progress):
        with alone(name):
            for case in cases:
                run = timer(case)
                run(50)                                     # fill the cache
                pairs[name, case] = calibrated_pairs(*run(200), target_s)
    for trial, case in tqdm([(t, c) for t in range(trials) for c in cases], desc="trials", disable=not progress):
        arms, run = rotated(allocators, trial), timer(case)
        n_windows = windows if case[0] == "size" else 1
        # Arms that keep a cached block (pools, the floors) take turns window by window, so every arm's windows
        # spread over the same stretch of time and a slow spell of the machine (the H200 rerun's: every arm
        # 2x slower for seconds) lands on all of them; arms that call the device on every pair run alone,
        # nothing else's blocks on the device. The thread sweep times one window per arm, each alone.
        together = [a for a in arms if case[0] == "size" and not allocs[a].device_calls_when_warm]
        timed = {}
        for name in arms:
            if name not in together:
                with alone(name):
                    run(50)                                 # this arm's cache, warm again after the others ran
                    with gc_paused():
                        timed[name] = median_window(run, pairs[name, case], n_windows)
        if together:
            trim_all_but(together)
            for name in together:
                with _installed(allocs[name]):
                    run(50)                                 # each arm's own block cached
            rates = {name: [] for name in together}
            with gc_paused():
                for w in range(n_windows):
                    for name in rotated(together, w):       # no arm always right after the same other
                        with _installed(allocs[name]):
                            run(SWITCH_WARM)                # its code and block warm again
                            rates[name].append(run(max(1, pairs[name, case] // n_windows)))
            timed.update({name: _median_rate(rates[name]) for name in together})
        samples += [dict(allocator=name, sweep=case[0], size_bytes=case[1], threads=case[2], trial=trial, ns=ns,
                         pairs=n, windows=n_windows) for name, (ns, n) in timed.items()]
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


# --- another build of xpool beside this one (--xpool-path)
OTHER_BUILD = {}    # arm name -> a factory of its registry.XPool, filled by other_build_arms()


class OtherBuildPool(registry.XPool):
    """An xpool arm whose pools come from another build's MemoryPool (its public API: scheme=, debug=)."""

    free_counting = can_capture = True     # as the table's xpool rows say of this build's

    def __init__(self, package, scheme: str, name: str):
        registry.Allocator.__init__(self)
        self.package, self.name = package, name
        self._settings = dict(scheme=scheme, debug=False)
        self.pool = self._make_private()

    def _make_private(self):
        return self.package.MemoryPool(**self._settings)


def other_build_arms(path) -> tuple:
    """Make the build at `path` (built in place) known to measure() as xpool_before, xpool_seed_before."""
    from xlab.builds import load_xpool
    package = load_xpool(path, "xpool_before")
    # the default scheme: "segments", or "xpool", its name in a build before the segments scheme had that name
    default = "segments" if "segments" in getattr(package.settings, "SCHEMES", ()) else "xpool"
    arms = {"xpool_before": default, "xpool_seed_before": "seed"}
    for name, scheme in arms.items():
        OTHER_BUILD[name] = lambda scheme=scheme, name=name: OtherBuildPool(package, scheme, name)
    return tuple(arms)


def other_build_table(rows) -> str:
    """The other build's µs per pair over this build's, per size, paired by trial ("" without it)."""
    lines = []
    for theirs, mine in (("xpool_before", "xpool"), ("xpool_seed_before", "xpool_seed")):
        part = rows[(rows.sweep == "size") & rows.allocator.isin([theirs, mine])]
        if part.allocator.nunique() < 2:
            continue
        ratios = intervals.paired(part, "us_per_pair", "allocator", mine, by=["size_bytes"])
        cells = [f"{fmt_bytes(r.size_bytes)} {intervals.fmt_ci(r.ratio, r.ratio_lo, r.ratio_hi, '{:.3f}')}"
                 for r in ratios.itertuples() if r.allocator == theirs]
        lines.append(f"{theirs} / {mine}, µs per pair paired by trial (> 1: this build is faster): "
                     + "; ".join(cells))
    return "\n".join(lines)


# --- the C core alone, on a CPU (--host)
HOST_ARMS = registry.SETS["host"]
HOST_SCENARIOS = ("alone", "busy")
HOST_COLUMNS = ["allocator", "scenario", "size_bytes", "trial", "ns_per_pair", "ratio_vs_xpool_seed", "pairs",
                "windows", "trials"]


def host_pool(scheme: str, busy: bool, seed: int = 0):
    """An xpool.Pool of `scheme` over host memory: alone, or busy (300 blocks of 512 B - 16 MiB made, every other one
    freed, as a training step leaves ranges free and in use; the population kept in `_population`)."""
    pool = xpool.Pool(xpool_twin.HostBackend(), scheme=scheme)
    pool._population = []
    if busy:
        rng = random.Random(seed)
        blocks = [pool.allocate(rng.choice([rng.randrange(512, MIB), rng.randrange(MIB, 16 * MIB)]))
                  for _ in range(300)]
        for b in blocks[::2]:
            b.release()
        pool._population = blocks[1::2]
    return pool


def measure_host(sizes=SIZES, trials=TRIALS, target_s=TARGET_S / 3, windows=WINDOWS, progress=True):
    """Samples of the C core's pairs over host memory, arms interleaved and rotated as on the GPU."""
    from xlab import _probes
    from xpool_twin import testing
    pools = {(a, sc): host_pool("seed" if a == "xpool_seed" else "segments", sc == "busy")
             for a in HOST_ARMS if a != "c_noop" for sc in HOST_SCENARIOS}
    noop = _probes.noop_cfunctions(1 << 20)

    def runner(arm, scenario, nbytes):
        cf = noop if arm == "c_noop" else testing.cfunctions(pools[arm, scenario])
        return lambda pairs: (_probes.time_pairs(*cf, nbytes, pairs), pairs)

    cases = [(sc, n) for sc in HOST_SCENARIOS for n in sizes]
    pairs = {}
    for arm in HOST_ARMS:
        for sc, n in cases:
            run = runner(arm, sc, n)
            run(1000)                                       # the cache holds the block
            pairs[arm, sc, n] = calibrated_pairs(*run(20_000), target_s, lo=1000, hi=10_000_000)
    rows = []
    order = [(t, case, arm) for t in range(trials) for case in cases for arm in rotated(HOST_ARMS, t)]
    for trial, (sc, n), arm in tqdm(order, desc="host trials", disable=not progress):
        run = runner(arm, sc, n)
        run(100)
        ns, done = median_window(run, pairs[arm, sc, n], windows)
        rows.append(dict(allocator=arm, scenario=sc, size_bytes=n, trial=trial, ns=ns, pairs=done, windows=windows))
    for pool in pools.values():
        pool._population = []
        pool.empty_cache()
    return pd.DataFrame(rows)


def _vs(df, value, reference, keys):
    """`reference`'s value over each row's in the same trial and case (> 1: faster than it); NaN without it."""
    base = df[df.allocator == reference].set_index(keys)[value]
    return [base.get(k, float("nan")) / v for k, v in zip(df[keys].itertuples(index=False, name=None), df[value])]


def host_rows(samples):
    """The --host CSV's rows (HOST_COLUMNS): ns per pair and the ratio to xpool_seed in the same trial."""
    df = samples.assign(ns_per_pair=samples.ns / samples.pairs)
    df["ratio_vs_xpool_seed"] = _vs(df, "ns_per_pair", "xpool_seed", ["scenario", "size_bytes", "trial"])
    df["trials"] = df["trial"].nunique() if len(df) else 0
    return df[HOST_COLUMNS].reset_index(drop=True)


def host_table(rows) -> str:
    """Medians over trials with 95% intervals, ns per pair, one line per (scenario, allocator)."""
    s = intervals.summarize(rows, ["scenario", "allocator", "size_bytes"], "ns_per_pair")
    lines = ["ns per malloc+free pair through the C core over host memory (median [95% interval])",
             f"{'':<20}" + "".join(f"{fmt_bytes(n):>22}" for n in dict.fromkeys(s.size_bytes))]
    for (sc, arm), part in s.groupby(["scenario", "allocator"], sort=False):
        cells = [intervals.fmt_ci(r.ns_per_pair, r.ns_per_pair_lo, r.ns_per_pair_hi, "{:.1f}")
                 for r in part.itertuples()]
        lines.append(f"{sc + ' ' + arm:<20}" + "".join(f"{c:>22}" for c in cells))
    return "\n".join(lines)


def run_host(out="data/alloc_core_host.csv", trials=None, target_s=None, sizes=SIZES, progress=True):
    """Measure the C core on this CPU, print the table, write the CSV (None: none): the rows."""
    target_s = target_s or TARGET_S / 3
    df = host_rows(measure_host(tuple(sizes), trials or TRIALS, target_s, progress=progress))
    return publish(with_provenance(df, bench="alloc_host", target_s=target_s), out, host_table(df))


# --- the CSV's rows and their summary (pure logic, tested on a CPU with fake timings)
def trial_rows(samples, mallocs=None):
    """The CSV's rows (COLUMNS), ratios to CuPy's pool in the same trial (NaN without it)."""
    mallocs = mallocs or {}
    df = samples.assign(us_per_pair=samples.ns / samples.pairs / 1e3, kpairs_per_s=samples.pairs * 1e6 / samples.ns)
    df["ratio_vs_cupy_pool"] = _vs(df, "us_per_pair", "cupy_pool", ["sweep", "size_bytes", "threads", "trial"])
    df["device_mallocs_per_pair"] = [mallocs.get((r.allocator, r.size_bytes), float("nan")) if r.sweep == "size"
                                     else float("nan") for r in df.itertuples()]
    df["trials"] = df["trial"].nunique() if len(df) else 0
    if "windows" not in df:
        df["windows"] = 1
    return df[COLUMNS].reset_index(drop=True)


def summary(rows):
    """Medians over trials with 95% intervals per (allocator, sweep, size, threads); old CSVs: single runs."""
    keys = ["allocator", "sweep", "size_bytes", "threads"]
    out = None
    for col in ("us_per_pair", "kpairs_per_s", "ratio_vs_cupy_pool"):
        s = intervals.summarize(rows, keys, col)
        out = s if out is None else out.merge(s.drop(columns="n_trials"), on=keys)
    counts = rows.groupby(keys, sort=False)["device_mallocs_per_pair"].median().reset_index()   # exact: no interval
    return out.merge(counts, on=keys)


def table(summary) -> str:
    """Medians as text: µs per pair by size, kpairs/s by threads; (x): speed vs CuPy's pool, same trial."""
    lines = []
    for sweep, col, value, unit in (("size", "size_bytes", "us_per_pair", "µs per pair (median)"),
                                    ("threads", "threads", "kpairs_per_s", "thousand pairs/s, 64 KiB")):
        part = summary[summary.sweep == sweep]
        if part.empty:
            continue
        heads = list(dict.fromkeys(part[col]))
        label = fmt_bytes if sweep == "size" else (lambda h: f"{h} thr")
        lines += [f"{unit}; (x) = speed vs cupy_pool", f"{'allocator':<12}" + "".join(f"{label(h):>18}" for h in heads)]
        for name in dict.fromkeys(part.allocator):
            cells = []
            for h in heads:
                r = part[(part.allocator == name) & (part[col] == h)]
                cells.append(f"{r[value].iloc[0]:9.2f} ({r.ratio_vs_cupy_pool.iloc[0]:5.2f}x)" if len(r) else "")
            lines.append(f"{name:<12}" + "".join(f"{c:>18}" for c in cells))
        lines.append("")
    return "\n".join(lines)


def with_provenance(rows, bench="alloc", **params):
    """Every row with the provenance columns (GPU, driver, CUDA, CuPy, commit, date) and the run's params."""
    return rows.assign(**provenance(bench=bench, **params))


def run(out="data/alloc_microbench.csv", quick=False, trials=None, target_s=None, allocators=None,
        progress=True, sizes=SIZES, threads=THREADS, xpool_path=None):
    """Measure, print the medians, write the CSV (None: none): the rows. quick: 2 trials of 5 ms windows; threads:
    empty for no thread sweep; xpool_path: another build's checkout, timed beside this one."""
    registry.require_gpus(1, "xlab.bench.alloc")
    trials = trials or (2 if quick else TRIALS)
    target_s = target_s or (0.005 if quick else TARGET_S)
    allocators = tuple(allocators or default_allocators())
    if xpool_path:
        allocators += tuple(a for a in other_build_arms(xpool_path) if a not in allocators)
    samples, mallocs = measure(allocators, sizes=tuple(sizes), threads=tuple(threads), trials=trials,
                               target_s=target_s, progress=progress)
    df = with_provenance(trial_rows(samples, mallocs), target_s=target_s, quick=quick, xpool_path=xpool_path or "")
    return publish(df, out, table(summary(df)) + ("\n" + other_build_table(df) if xpool_path else ""))


def main(argv=None) -> int:
    """The command line (see --help); the exit status, 2 without a GPU."""
    ap = argparse.ArgumentParser(prog="python -m xlab.bench.alloc", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="the CSV (default data/alloc_microbench.csv; with --host, data/alloc_core_host.csv)")
    ap.add_argument("--host", action="store_true", help="the C core alone over host memory, on a CPU")
    ap.add_argument("--quick", action="store_true", help="fewer pairs and trials: a smoke run")
    ap.add_argument("--trials", type=at_least(1), help=f"trials per arm, interleaved (default {TRIALS}; 2 with --quick)")
    ap.add_argument("--allocators", nargs="+", type=registry.arg,
                    help="arm names (xlab.allocators.ARMS; default: every arm of SETS['bench'] this machine can run)")
    ap.add_argument("--sizes", nargs="+", type=at_least(1), default=list(SIZES), help="request sizes in bytes")
    ap.add_argument("--sweep", choices=("size", "threads", "both"), default="both",
                    help="the size sweep (1 thread), the thread sweep (64 KiB), or both (default)")
    ap.add_argument("--target-s", type=float, help=f"seconds per (trial, arm, case), in {WINDOWS} windows "
                    f"(default {TARGET_S}; 0.005 with --quick)")
    ap.add_argument("--xpool-path", help="also time the xpool build of the checkout at this path (built in "
                    "place), beside this one: arms xpool_before, xpool_seed_before")
    args = ap.parse_args(argv)
    if args.allocators and "cupy_pool" not in args.allocators:
        ap.error("the ratios need cupy_pool among --allocators")
    if args.host and args.xpool_path:
        ap.error("--xpool-path times CuPy's path on a GPU")
    if args.host:
        run_host(args.out or "data/alloc_core_host.csv", args.trials, args.target_s, sizes=args.sizes)
        return 0
    try:
        run(args.out or "data/alloc_microbench.csv", args.quick, args.trials, args.target_s,
            allocators=args.allocators, sizes=args.sizes if args.sweep != "threads" else (),
            threads=THREADS if args.sweep != "size" else (), xpool_path=args.xpool_path)
    except NoGPU as e:
        print(f"xlab.bench.alloc: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
