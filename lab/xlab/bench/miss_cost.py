"""What a miss costs as a pool fragments, on the host: the frozen core, and another build beside it when asked.

A miss searches what the cache holds: its free ranges (a treap: O(log n)) and, under scheme expandable, to place the
pages it maps, the unmapped runs (holes) that trim() and the ladder leave (before the freeze a walk of every run,
O(n); since, an index of them, O(log n): Note [Unmapped runs] in xpool/_expandable.c). Each arm builds a pool
holding `n` fragments, `layout` "free" (n free ranges between blocks in use: 512 B under segments, a page under
expandable) or "holes" (expandable: n one-page unmapped runs between blocks in use, left by a trim), then times misses
that fit no free range or hole (a new segment, or pages mapped past the last block). The backend touches no memory:
addresses from a counter, and the lab's null virtual-memory ops (xlab._probes.null_vmm), so what is timed is the
core's own work. Each miss goes through the C core's allocate, the collector off. The trials of every (build,
scheme, layout, n) take turns, so drift falls on all alike; a trial's value is the median over its misses, the
summary the median over trials with a 95% bootstrap interval, and the ratio of the largest n to the smallest,
paired by trial.

    python -m xlab.bench.miss_cost                  # the product alone (a few minutes on 2 cores)
    python -m xlab.bench.miss_cost --before build/before    # and a checkout built in place (xlab.builds.load_xpool)

data/miss_cost_host.csv holds the product against 5bcaad4, the build before the freeze (its code: the tag
record-2026-12-05, checked out and built in place as `--before`).
"""
from __future__ import annotations

import argparse
import gc
import pathlib
import time

import pandas as pd

from xlab.intervals import median_ci, ratio_ci
from xlab.paths import publish
from xlab.provenance import provenance

SIZES_N = (1_000, 10_000, 100_000)
KINDS = (("segments", "free"), ("expandable", "free"), ("expandable", "holes"))   # (scheme, layout)
PAGE = 1 << 16              # the page of the null ops: holes of one page
MISSES = 64                 # timed misses per trial
TRIALS = 5
OUT = "data/miss_cost_host.csv"
COLUMNS = ["build", "scheme", "layout", "n", "trial", "us_per_miss", "misses", "device_calls"]


class NullBackend:
    """A backend of one device that touches no memory: malloc hands out addresses from a counter, free does nothing,
    vmm() gives the lab's null ops (xlab._probes.null_vmm). Enough for a pool in debug mode off."""

    def __init__(self):
        from xlab import _probes
        self._probes, self._next = _probes, 1 << 20

    def malloc(self, device: int, nbytes: int) -> int:
        ptr, self._next = self._next, self._next + (nbytes + 4095) // 4096 * 4096 + 4096
        return ptr

    def free(self, device: int, ptr: int, nbytes: int) -> None:
        pass

    def vmm(self):
        return self._probes.null_vmm(PAGE)

    def fill(self, device, ptr, nbytes, byte):
        raise RuntimeError("NullBackend holds no memory: debug mode off")

    read = fill

    def current_device(self) -> int:
        return 0

    def current_stream(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def total_memory(self, device: int) -> int:
        return 1 << 44


def _builds(before: str | None) -> dict:
    """{build name: its xpool package}: the product, and the checkout at path `before` (built in place) when asked,
    named by its folder."""
    import xpool
    builds = {"product": xpool}
    if before:
        from xlab.builds import load_xpool
        builds[pathlib.Path(before).name] = load_xpool(before)
    return builds


def _fragmented(pkg, scheme: str, layout: str, n: int):
    """A pool holding n free ranges or n unmapped one-page runs, and the blocks in use that keep them apart."""
    pool = pkg.pool.Pool(NullBackend(), scheme=scheme, limit=0, timeline=0, debug=False)
    unit = 512 if scheme == "segments" else PAGE
    blocks = [pool.allocate(unit, 0, 0) for _ in range(2 * n)]
    keep = blocks[1::2]
    del blocks[:]
    if layout == "holes":
        pool.trim(0)                        # every free page unmapped: n holes between the blocks kept
    return pool, keep


def _calls(pool) -> int:
    st = pool.stats(0)
    row = dict(st[0]) if hasattr(st, "per_device") else st.iloc[0].to_dict()
    return int(row["device_mallocs"] + row["device_maps"] + row["device_frees"] + row["device_unmaps"])


def one_trial(pkg, scheme: str, layout: str, n: int, misses: int = MISSES) -> tuple[float, int]:
    """Median µs per miss over `misses` misses that fit no free range or hole, and the device calls they made."""
    pool, keep = _fragmented(pkg, scheme, layout, n)
    big = 3 * PAGE if scheme == "expandable" else 4 << 20    # past every hole (expandable), a segment of its own
    calls, held, times = _calls(pool), [], []
    gc.disable()
    try:
        for _ in range(misses):
            t0 = time.perf_counter_ns()
            held.append(pool.allocate(big, 0, 0))
            times.append(time.perf_counter_ns() - t0)
    finally:
        gc.enable()
    made = _calls(pool) - calls
    del held, keep
    times.sort()
    return times[len(times) // 2] / 1e3, made


def run(out: str | None = OUT, sizes=SIZES_N, kinds=KINDS, trials: int = TRIALS, before: str | None = None,
        misses: int = MISSES) -> pd.DataFrame:
    """Every (build, scheme, layout, n), trial by trial in turns; the rows (COLUMNS and provenance) to `out`."""
    builds = _builds(before)
    rows = []
    for trial in range(trials):
        for build, pkg in builds.items():
            for scheme, layout in kinds:
                for n in sizes:
                    us, calls = one_trial(pkg, scheme, layout, n, misses)
                    rows.append(dict(build=build, scheme=scheme, layout=layout, n=n, trial=trial, us_per_miss=us,
                                     misses=misses, device_calls=calls))
    df = pd.DataFrame(rows, columns=COLUMNS).assign(**provenance(experiment="miss_cost", page=PAGE))
    return publish(df, out, summary(df).to_string(index=False))


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per (build, scheme, layout, n): median µs per miss [95% interval]; per (build, scheme, layout): the largest n
    over the smallest, paired by trial (the growth of a miss's cost with the fragments it searches)."""
    rows = []
    for (build, scheme, layout), g in df.groupby(["build", "scheme", "layout"], sort=False):
        by_n = {n: x.sort_values("trial")["us_per_miss"].to_numpy() for n, x in g.groupby("n")}
        lo_n, hi_n = min(by_n), max(by_n)
        for n, v in by_n.items():
            med, lo, hi, _ = median_ci(v)
            rows.append(dict(build=build, scheme=scheme, layout=layout, n=n, us_per_miss=med, lo=lo, hi=hi))
        ratio, lo, hi, _ = ratio_ci(by_n[hi_n], by_n[lo_n])
        rows.append(dict(build=build, scheme=scheme, layout=layout, n=f"{hi_n} / {lo_n}", us_per_miss=ratio, lo=lo,
                         hi=hi))
    return pd.DataFrame(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=OUT, help="the CSV ('' for none)")
    ap.add_argument("--trials", type=int, default=TRIALS)
    ap.add_argument("--misses", type=int, default=MISSES)
    ap.add_argument("--sizes", type=int, nargs="+", default=list(SIZES_N))
    ap.add_argument("--before", default="", help="a checkout built in place to compare with (default: none)")
    a = ap.parse_args(argv)
    for name, v in (("--trials", a.trials), ("--misses", a.misses), *(("--sizes", s) for s in a.sizes)):
        if v < 1:
            ap.error(f"{name} must be at least 1, got {v}")
    run(a.out or None, tuple(a.sizes), trials=a.trials, before=a.before or None, misses=a.misses)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
