"""The hit path of two builds, over host memory: malloc+free pairs through each build's CuPy hooks and PyTorch's
entry points, timed in C (xlab._probes), both builds loaded in one process and interleaved.

    git worktree add build/before 5bcaad4 && (cd build/before && python setup.py build_ext --inplace -q)
    python scripts/hit_builds.py --before build/before --out data/hit_builds_host.csv   # 5bcaad4 against this

`--before` is a checkout built in place (the committed rows: 5bcaad4, whose code the tag record-2026-12-05 keeps).
Arms: (build before / after) x (scheme segments / seed) through CuPy's hooks (path `cupy`, with the GIL), and
(before / after) with scheme segments through PyTorch's entry points (path `torch`: xpool_torch_try_malloc and
xpool_torch_free, without the GIL); each a fresh Pool over HostBackend with one block cached, so every pair is a
hit. Within a trial and size the arms take turns window by window (order rotated each round and each trial), an
arm's time is the median of its windows, and the collector is off. Where a build's code and its blocks land in
memory moves a pair's time by a few percent from one process to the next, which no number of trials in one process
averages out: so the measurement runs in `--processes` fresh processes, each interleaving its `--trials`. A
process's median of its paired ratios (before / after, > 1: after is faster) is one sample; the summary is their
median with a 95% bootstrap interval (xlab.intervals).

It sits outside the lab for one reason: binding a pool to PyTorch's entry points without PyTorch is private in both
builds (`pool._core.bind_torch()`), and the lab uses xpool's public API alone.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys

SIZES = (4 << 10, 64 << 10, 12 << 20)
SCHEMES = ("segments", "seed")
PROCESSES = 11
TRIALS = 5
WINDOWS = 7
WINDOW_S = 0.02


def make_arms(before_path: str) -> dict:
    """{(build, scheme, path): run(nbytes, pairs) -> ns} and the pools they need alive, under "_keep"."""
    import ctypes

    import xpool
    import xpool_twin.testing
    from xlab import _probes
    from xlab.builds import load_xpool
    before = load_xpool(before_path)
    import importlib
    before_testing = importlib.import_module(f"{before.__name__}.testing")
    arms, keep = {}, []

    def cupy_path(cf):
        return lambda n, pairs: _probes.time_pairs(*cf, n, pairs)

    def torch_path(package, pool):
        pool._core.bind_torch()                                    # this build's entry points serve this pool
        lib = ctypes.CDLL(package._core.__spec__.origin)
        m, f = (ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
                for name in ("xpool_torch_try_malloc", "xpool_torch_free"))
        return lambda n, pairs: _probes.time_torch_pairs(m, f, n, pairs)

    for scheme in SCHEMES:
        old = before.Pool(before.HostBackend(), scheme=scheme)
        new = xpool.Pool(xpool_twin.HostBackend(), scheme=scheme)
        arms["before", scheme, "cupy"] = cupy_path(before_testing.cfunctions(old))
        arms["after", scheme, "cupy"] = cupy_path(xpool_twin.testing.cfunctions(new))
        keep += [old, new]
    old = before.Pool(before.HostBackend(), scheme="segments")
    new = xpool.Pool(xpool_twin.HostBackend(), scheme="segments")
    arms["before", "segments", "torch"] = torch_path(before, old)
    arms["after", "segments", "torch"] = torch_path(xpool, new)
    arms["_keep"] = keep + [old, new]
    return arms


def measure(before_path: str, sizes=SIZES, trials=TRIALS, windows=WINDOWS, window_s=WINDOW_S, progress=True):
    """One row per (trial, build, scheme, size): ns per pair (median window), pairs per window."""
    import pandas as pd
    from tqdm.auto import tqdm

    from xlab.bench.alloc import rotated
    arms = make_arms(before_path)
    keep = arms.pop("_keep")
    names = list(arms)

    def run(arm, n, pairs):
        ns = arms[arm](n, pairs)
        if not ns:
            raise RuntimeError(f"arm {arm}: an allocation failed")
        return ns

    calls = {}
    for arm in names:
        for n in sizes:
            run(arm, n, 1000)                                   # the block is cached: every pair hits
            ns = max(run(arm, n, 20_000), 1)
            calls[arm, n] = max(1000, int(window_s * 1e9 * 20_000 / ns))
    rows = []
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        for trial, n in tqdm([(t, n) for t in range(trials) for n in sizes], desc="trials", disable=not progress):
            rates = {a: [] for a in names}
            for w in range(windows):
                for arm in rotated(names, trial + w):
                    run(arm, n, 100)                            # its code and block warm again
                    rates[arm].append(run(arm, n, calls[arm, n]) / calls[arm, n])
            for (build, scheme, path) in names:
                arm = build, scheme, path
                rows.append(dict(build=build, scheme=scheme, path=path, size_bytes=n, trial=trial,
                                 ns_per_pair=statistics.median(rates[arm]), pairs=calls[arm, n],
                                 windows=windows, trials=trials))
    finally:
        if gc_was_on:
            gc.enable()
    del keep
    return pd.DataFrame(rows)


def ratios(rows):
    """Per (path, scheme, size): each process's median of before / after per trial (> 1: after is faster), then
    their median and 95% interval over processes; and each build's median ns per pair."""
    import pandas as pd

    from xlab import intervals
    out = []
    for (path, scheme, n), g in rows.groupby(["path", "scheme", "size_bytes"], sort=False):
        per = g.pivot_table(index=["process", "trial"], columns="build", values="ns_per_pair")
        by_process = (per["before"] / per["after"]).groupby(level="process").median()
        med, lo, hi, k = intervals.median_ci(by_process.to_numpy())
        out.append(dict(path=path, scheme=scheme, size_bytes=n, before_ns=per["before"].median(),
                        after_ns=per["after"].median(), ratio=med, lo=lo, hi=hi, n_processes=k))
    return pd.DataFrame(out)


def table(summary) -> str:
    from xlab.intervals import fmt_ci
    from xlab.plots import fmt_bytes
    lines = ["ns per malloc+free pair over host memory (median of all trials); before / after: the median over "
             "processes of each one's median paired ratio [95% interval] (> 1: after is faster)"]
    for r in summary.itertuples():
        lines.append(f"  {r.path:<5} {r.scheme:<9} {fmt_bytes(r.size_bytes):>8}  before {r.before_ns:6.1f}  after "
                     f"{r.after_ns:6.1f}  ratio {fmt_ci(r.ratio, r.lo, r.hi, '{:.3f}')}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python scripts/hit_builds.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", required=True, help="a checkout built in place")
    ap.add_argument("--before-commit", default="5bcaad4", help="its commit, for the CSV (default 5bcaad4)")
    ap.add_argument("--processes", type=int, default=PROCESSES, help=f"fresh processes, one after the other "
                    f"(default {PROCESSES})")
    ap.add_argument("--trials", type=int, default=TRIALS, help=f"trials in each process (default {TRIALS})")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)   # this process's number
    ap.add_argument("--windows", type=int, default=WINDOWS)
    ap.add_argument("--window-s", type=float, default=WINDOW_S)
    ap.add_argument("--sizes", nargs="+", type=int, default=list(SIZES))
    ap.add_argument("--out", default="data/hit_builds_host.csv", help="the CSV ('' for none)")
    args = ap.parse_args(argv)
    if (args.processes < 2 or args.trials < 1 or args.windows < 1 or args.window_s <= 0
            or any(n <= 0 for n in args.sizes)):
        ap.error("--processes >= 2, --trials >= 1, --windows >= 1, --window-s > 0 and positive --sizes")
    import pandas as pd

    from xlab.paths import write_csv
    from xlab.provenance import provenance
    if args.child is not None:                  # one process's trials, as CSV on stdout
        rows = measure(args.before, tuple(args.sizes), args.trials, args.windows, args.window_s, progress=False)
        rows.assign(process=args.child).to_csv(sys.stdout, index=False)
        return 0
    import io
    import subprocess
    parts = []
    for p in range(args.processes):
        cmd = [sys.executable, __file__, "--child", str(p), "--before", args.before, "--trials", str(args.trials),
               "--windows", str(args.windows), "--window-s", str(args.window_s), "--sizes", *map(str, args.sizes)]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        parts.append(pd.read_csv(io.StringIO(out)))
        print(f"process {p + 1}/{args.processes} done", flush=True)
    rows = pd.concat(parts, ignore_index=True)
    rows = rows.assign(processes=args.processes, **provenance(
        bench="hit_builds_host", before_commit=args.before_commit, window_s=args.window_s,
        control="arms interleaved window by window in each of `processes` fresh processes; the CPU shared "
                "with other work"))
    print(table(ratios(rows)))
    if args.out:
        write_csv(rows, args.out)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
