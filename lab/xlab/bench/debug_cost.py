"""What debug mode (poison in every freed block, a canary in every block's tail: each a pass over memory) costs per
alloc/free pair of the pool core over host memory: `python -m xlab.bench.debug_cost`. The GPU figure comes from
`xlab.bench.alloc --allocators cupy_pool xpool_k1 xpool_k1_debug`.
"""
from __future__ import annotations

import argparse
import statistics
import time

import pandas as pd

from xpool import Pool
from xpool_twin import HostBackend
from xlab.paths import publish
from xlab.provenance import provenance

SIZES = (4 << 10, 64 << 10, 1 << 20)


def pair_us(pool, nbytes: int, pairs: int) -> float:
    """µs per allocate/release pair of an xpool.Pool (warm: the block is cached after the first pair)."""
    pool.allocate(nbytes).release()
    t0 = time.perf_counter_ns()
    for _ in range(pairs):
        pool.allocate(nbytes).release()
    return (time.perf_counter_ns() - t0) / pairs / 1e3


def run(sizes=SIZES, pairs: int = 2000, repeats: int = 5, out: str | None = "data/debug_cost_host.csv"):
    """Median µs per pair over `repeats` windows per (size, debug), and the ratio to debug off."""
    pools = {mode: Pool(HostBackend(), debug=mode) for mode in (False, "raise")}
    rows = []
    for n in sizes:
        times = {mode: statistics.median(pair_us(p, n, pairs) for _ in range(repeats)) for mode, p in pools.items()}
        for mode, us in times.items():
            rows.append(dict(backend="host", size_bytes=n, debug=mode or "off", us_per_pair=us,
                             ratio_vs_off=us / times[False], pairs=pairs, repeats=repeats))
    df = pd.DataFrame(rows).assign(**provenance(bench="debug_cost"))
    return publish(df, out, df[["size_bytes", "debug", "us_per_pair", "ratio_vs_off"]].to_string(index=False))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m xlab.bench.debug_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="data/debug_cost_host.csv")
    ap.add_argument("--pairs", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    run(pairs=args.pairs, repeats=args.repeats, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
