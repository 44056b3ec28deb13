"""What a growing miss costs against the number of free ranges: `python scripts/miss_scan.py` (over host memory).

A miss that would take a pool above its high-water mark first looks for whole free segments of its stream to
give back (scheme xpool's release on miss).  Free ranges inside partly used segments can never go back, so
that search must not cost more as they pile up (issue 21, defect 6: it walked every free range, 28 µs at 1e3
ranges and 20 ms at 3e5).  Over host memory, each configuration is a pool whose stream has `n` free 512 B
ranges between blocks in use; a timed miss asks for a block larger than any before (above the mark), then
`empty_cache()` gives it back untimed.  The control (`never`) never releases on a miss (`release_on_miss="never"`): what a
miss costs without the search (the backend's malloc and the core's bookkeeping).  Trials are interleaved
across every (n, arm); one row per trial: the median µs over its misses.
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from xlab.bench import at_least  # noqa: E402

N_RANGES = (100, 1_000, 10_000, 100_000, 300_000)
ARMS = {"high_water": {}, "never": {"release_on_miss": "never"}}   # by release_on_miss
BIG = 8 << 20          # the first timed miss; each one 512 B larger than the last


def pool_with_free_ranges(n_ranges: int, segments: dict):
    """(pool, the blocks kept in use): a pool of settings `segments` (the arm) whose stream 0 has `n_ranges` free
    512 B ranges, none of which can merge with another; the caller keeps the blocks alive."""
    from xpool import HostBackend, Pool
    pool = Pool(HostBackend(), **segments)
    blocks = [pool.allocate(512) for _ in range(2 * n_ranges)]
    keep = blocks[1::2]
    del blocks                 # every other block goes back: a free range between two in use
    return pool, keep


def growing_misses_us(pool, state: dict, misses: int) -> float:
    """Median µs of `misses` misses above the high-water mark, each 512 B more than state["size"], the last."""
    times = []
    for _ in range(misses):
        state["size"] += 512
        t0 = time.perf_counter_ns()
        a = pool.allocate(state["size"])
        times.append(time.perf_counter_ns() - t0)
        a.release()
        pool.empty_cache()     # the whole segment goes back, so the next, larger miss is above the mark again
    return statistics.median(times) / 1e3


def run(n_ranges=N_RANGES, trials: int = 7, misses: int = 15, out: str | None = "data/miss_scan_host.csv"):
    """One row per (n, arm, trial), `misses` timed misses each, trials interleaved across every configuration;
    the summary printed, the rows written to `out` (None: not written)."""
    import pandas as pd

    from xlab.bench.alloc import rotated
    from xlab.intervals import summarize
    from xlab.paths import write_csv
    from xlab.provenance import provenance
    configs = [(n, arm) for n in n_ranges for arm in ARMS]
    pools = {c: pool_with_free_ranges(c[0], ARMS[c[1]]) for c in configs}
    states = {c: {"size": BIG} for c in configs}
    for c in configs:                            # one untimed miss each: every pool has its mark above BIG
        growing_misses_us(pools[c][0], states[c], 1)
    rows = []
    for t in range(trials):
        for c in rotated(configs, t):            # a different arm first each trial
            us = growing_misses_us(pools[c][0], states[c], misses)
            rows.append(dict(backend="host", n_free_ranges=c[0], release_on_miss=c[1], trial=t, us_per_miss=us,
                             misses=misses))
    df = pd.DataFrame(rows).assign(**provenance(bench="miss_scan", trials=trials))
    summary = summarize(df.sort_values(["n_free_ranges", "release_on_miss"], kind="stable"),
                        ["n_free_ranges", "release_on_miss"], "us_per_miss")
    summary = summary.rename(columns={"us_per_miss_lo": "lo", "us_per_miss_hi": "hi", "n_trials": "trials"})
    print(summary.to_string(index=False, float_format=lambda x: f"{x:.1f}"))
    write_csv(df, out)
    return df


def main(argv=None) -> int:
    """`python scripts/miss_scan.py [--out CSV] [--trials N] [--misses N] [--n-ranges N ...]`; returns 0."""
    ap = argparse.ArgumentParser(prog="python scripts/miss_scan.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="data/miss_scan_host.csv")
    ap.add_argument("--trials", type=at_least(5), default=7, help="at least 5: a median with an interval")
    ap.add_argument("--misses", type=int, default=15)
    ap.add_argument("--n-ranges", type=int, nargs="+", default=list(N_RANGES))
    args = ap.parse_args(argv)
    run(n_ranges=args.n_ranges, trials=args.trials, misses=args.misses, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
