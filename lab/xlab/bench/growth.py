"""Growth: what a miss that maps new memory costs, xpool against the peers, growing to ~28 GB (issue 49, item 2).

One fixed sequence of 1,500 requests, drawn log-uniform over 1 MiB - 1 GiB and scaled to sum to 28 GB (seeded: 0.12 MB
to 125 MB, 18.7 MB on average), each kept, so every byte is new memory: the growth a job makes when it fills most of
a GPU. Arms (a process per trial
and arm, trials interleaved, arm order rotated trial by trial):

    xpool_expandable   xpool.pool.Pool(CupyBackend(), scheme="expandable"): pages mapped into reserved ranges
    torch_expandable   PyTorch with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, torch.empty(n, uint8)
    cupy_async         cupy.cuda.MemoryAsyncPool (cudaMallocAsync's pool): .malloc(n)
    cupy_pool          cupy.cuda.MemoryPool (CuPy's default): .malloc(n)
    xpool_segments     xpool.pool.Pool(CupyBackend(), scheme="segments"): a cudaMalloc per miss

Each request is timed on the host (perf_counter_ns around the allocation call); the device is synchronised once
after the last. A row is one trial of one arm: the total seconds and the median and 90th percentile µs per request,
the allocator's own count of device calls where it has one (xpool: device_maps + device_mallocs, ops calls;
PyTorch: num_device_alloc), and `driver_calls_model`, the driver calls the arm's rules make for the sequence
(xpool expandable: `xpool_driver_calls`, checked against the host twin's counts by tests/xpool/test_expandable.py
and a fake driver's by tests/xpool/test_vmm.py; PyTorch: `pytorch_driver_calls`, from its rules; NaN where no rule
is written here). The GPU runs no kernel: growth is bound by the host, in driver calls (cuMemCreate, cuMemMap,
cuMemSetAccess for the VMM arms; cudaMalloc for the others), so total_s over driver_calls_model is each VMM arm's
cost per call.

    python -m xlab.bench.growth                   # data/growth.csv, 5 trials (~1-2 min on an H100)
    python -m xlab.bench.growth --trials 7 --arms xpool_expandable,torch_expandable
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

import numpy as np
import pandas as pd

from xlab.intervals import median_ci, ratio_ci
from xlab.paths import publish
from xlab.provenance import provenance

ARMS = ("xpool_expandable", "torch_expandable", "cupy_async", "cupy_pool", "xpool_segments")
N_REQUESTS = 1500
TARGET = 28_000_000_000
LO, HI = 1 << 20, 1 << 30
SEED = 0
TRIALS = 5
OUT = "data/growth.csv"
COLUMNS = ["arm", "trial", "order", "requests", "bytes", "total_s", "us_median", "us_p90", "device_calls",
           "driver_calls_model", "peak_reserved", "error"]
MIB = 1 << 20


def sequence(n: int = N_REQUESTS, target: int = TARGET, seed: int = SEED, lo: int = LO, hi: int = HI) -> list[int]:
    """The request sizes in order: n draws log-uniform over [lo, hi], scaled so they sum to about `target` bytes,
    each a whole number of 512 B (at least 512)."""
    if n < 1 or target < 512 * n or not 0 < lo <= hi:
        raise ValueError(f"sequence: need n >= 1, target >= 512 n and 0 < lo <= hi; got n={n}, target={target}, "
                         f"lo={lo}, hi={hi}")
    raw = np.exp(np.random.default_rng(seed).uniform(math.log(lo), math.log(hi), n))
    sizes = np.maximum(512, np.round(raw * (target / raw.sum()) / 512) * 512).astype(np.int64)
    return [int(s) for s in sizes]


def _up(n: int, m: int) -> int:
    return -(-n // m) * m


def pytorch_driver_calls(sizes, peers: int = 0, granularity: int = 2 * MIB) -> dict:
    """The driver calls PyTorch's expandable segments make to grow through `sizes` (each kept), from its rules in
    c10/cuda/CUDACachingAllocator.cpp (pytorch/pytorch at 001074d2, ExpandableSegment and DeviceCachingAllocator):
      - a request is rounded up to 512 B (round_size) and served from the small pool up to kSmallSize (1 MiB), else
        the large pool; each pool's expandable segment maps segment_size_ pages: kSmallBuffer (2 MiB) or
        kLargeBuffer (20 MiB);
      - a request the free mapped tail of its pool's segment holds is a hit (best fit; with expandable segments a
        block is split whenever 512 B or more remain: should_split), no driver call;
      - else try_allocate_expandable_block maps the segments past the tail that the request reaches
        (ExpandableSegment::map): a cuMemCreate and a cuMemMap per segment, then setAccess once for the device and
        once per peer (cuMemSetAccess over the whole run), so 2 k + 1 + peers calls for k segments.
    `granularity` is only checked (the segments are whole pages of it). Returns handles, maps (runs), calls."""
    seg = {True: 2 * MIB, False: 20 * MIB}
    if any(s % granularity for s in seg.values()):
        raise ValueError(f"granularity {granularity} does not divide PyTorch's 2 MiB and 20 MiB segments")
    used, mapped = {True: 0, False: 0}, {True: 0, False: 0}
    handles = maps = 0
    for s in sizes:
        n = max(512, _up(int(s), 512))
        small = n <= 1 << 20
        if used[small] + n > mapped[small]:
            k = -(-(used[small] + n - mapped[small]) // seg[small])
            mapped[small] += k * seg[small]
            handles += k
            maps += 1
        used[small] += n
    return {"handles": handles, "maps": maps, "calls": 2 * handles + maps * (1 + peers)}


def xpool_driver_calls(sizes, granularity: int = 2 * MIB, ahead: bool = False, page_handles: bool = False) -> dict:
    """The driver calls xpool's expandable scheme makes to grow through `sizes` (each kept) on one stream, from its
    rule (Note [Handles] in xpool/_expandable.c; the CUDA ops in xpool/_vmm_cuda.c): a request is rounded up to
    512 B; the free mapped tail holds it (a hit) or the miss maps the pages it reaches past the tail in handles of
    xe_handle_bytes(size) (the page up to 1 MiB, else 20 MiB rounded up to whole pages, PyTorch's kLargeBuffer), the last
    one the rest: a cuMemCreate and a cuMemMap per handle, one cuMemSetAccess per run, every peer in its list. The
    range is taken to hold it all. `ahead`: a what-if xpool does not do (docs/decisions/0013), each run mapped up to
    a whole handle as PyTorch maps whole segments. `page_handles`: the rule before (a handle a page, released at once:
    three calls a page). Returns handles, maps (runs), calls."""
    used = mapped = handles = maps = 0
    for s in sizes:
        n = max(512, _up(int(s), 512))
        if used + n > mapped:
            h = granularity if n <= 1 << 20 or page_handles else _up(20 * MIB, granularity)
            run = _up(used + n - mapped, h if ahead else granularity)
            mapped += run
            handles += -(-run // h)
            maps += 1
        used += n
    return {"handles": handles, "maps": maps, "calls": (3 if page_handles else 2) * handles + maps}


# --- one trial of one arm, in its own process

def _xpool_pool(scheme: str, backend=None):
    from xpool.backends import CupyBackend
    from xpool.pool import Pool
    pool = Pool(backend if backend is not None else CupyBackend(), scheme=scheme)
    keep = []

    def alloc(n):
        keep.append(pool.allocate(n, 0, 0))

    def finish():
        row = pool.stats(0)
        row = dict(row[0]) if hasattr(row, "per_device") else row.iloc[0].to_dict()
        return int(row["device_maps"] + row["device_mallocs"]), int(row["peak_bytes_reserved"])
    return alloc, finish, keep


def _arm(arm: str, backend=None):
    """(alloc(n), finish() -> (device calls or None, peak reserved bytes), what keeps the blocks alive); `backend`:
    the xpool arms' (None: CupyBackend(); a test's host twin)."""
    if arm in ("xpool_expandable", "xpool_segments"):
        return _xpool_pool(arm.split("_")[1], backend)
    if arm == "torch_expandable":
        import torch
        assert "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        torch.empty(1, device="cuda")   # the context first, as the other arms' pools have theirs
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        keep = []
        base = torch.cuda.memory_stats().get("num_device_alloc", 0)

        def alloc(n):
            keep.append(torch.empty(n, dtype=torch.uint8, device="cuda"))

        def finish():
            st = torch.cuda.memory_stats()
            return int(st.get("num_device_alloc", 0) - base), int(torch.cuda.max_memory_reserved())
        return alloc, finish, keep
    if arm in ("cupy_async", "cupy_pool"):
        import cupy
        cupy.cuda.runtime.setDevice(0)
        pool = cupy.cuda.MemoryAsyncPool() if arm == "cupy_async" else cupy.cuda.MemoryPool()
        keep = []

        def alloc(n):
            keep.append(pool.malloc(n))

        def finish():
            try:
                return None, int(pool.total_bytes())
            except Exception:   # a pool that cannot say
                return None, -1
        return alloc, finish, keep
    raise ValueError(f"arm must be one of {', '.join(ARMS)}; got {arm!r}")


def _sync(arm: str, backend=None) -> None:
    if backend is not None:
        return
    if arm == "torch_expandable":
        import torch
        torch.cuda.synchronize()
    else:
        import cupy
        cupy.cuda.runtime.deviceSynchronize()


def child(arm: str, sizes, backend=None) -> dict:
    """Grows through `sizes` under `arm` in this process: the row's measured fields (`backend`: see _arm)."""
    alloc, finish, keep = _arm(arm, backend)
    _sync(arm, backend)
    times = np.empty(len(sizes), dtype=np.int64)
    t_all = time.perf_counter_ns()
    for i, n in enumerate(sizes):
        t0 = time.perf_counter_ns()
        alloc(n)
        times[i] = time.perf_counter_ns() - t0
    _sync(arm, backend)
    total = (time.perf_counter_ns() - t_all) / 1e9
    calls, peak = finish()
    del keep[:]
    return dict(requests=len(sizes), bytes=int(sum(sizes)), total_s=total, us_median=float(np.median(times)) / 1e3,
                us_p90=float(np.percentile(times, 90)) / 1e3, device_calls=calls, peak_reserved=peak)


def _env(arm: str) -> dict:
    env = dict(os.environ)
    if arm == "torch_expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    return env


def _spawn(arm: str, n: int, target: int, seed: int, timeout: float, python: str) -> dict:
    """One trial of `arm` in a fresh process: its measured fields, or error set."""
    cmd = [python, "-m", "xlab.bench.growth", "--child", arm, "--n", str(n), "--target", str(target),
           "--seed", str(seed)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(arm))
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("{")]
    if r.returncode or not lines:
        return {"error": (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1][:300]}
    return json.loads(lines[-1])


def model_calls(arm: str, sizes) -> float:
    if arm == "xpool_expandable":
        return xpool_driver_calls(sizes)["calls"]
    if arm == "torch_expandable":
        return pytorch_driver_calls(sizes)["calls"]
    return float("nan")


def run(out: str | None = OUT, arms=ARMS, trials: int = TRIALS, n: int = N_REQUESTS, target: int = TARGET,
        seed: int = SEED, timeout: float = 120.0, python: str = sys.executable, spawn=None) -> pd.DataFrame:
    """Every arm `trials` times, a process per trial and arm, the arms' order rotated each trial; the rows (COLUMNS
    and provenance) to `out`, rewritten after every trial. `spawn(arm, n, target, seed, timeout, python)`: the
    process runner (a test's stand-in)."""
    bad = [a for a in arms if a not in ARMS]
    if bad or not arms:
        raise ValueError(f"arms must be some of {', '.join(ARMS)}; got {', '.join(bad) or 'none'}")
    if trials < 1:
        raise ValueError(f"trials must be at least 1, got {trials}")
    spawn = spawn or _spawn
    sizes = sequence(n, target, seed)
    models = {a: model_calls(a, sizes) for a in arms}
    prov = provenance(experiment="growth", n_requests=n, target_bytes=target, seed=seed, lo=LO, hi=HI)
    rows = []
    df = pd.DataFrame(columns=COLUMNS)
    for trial in range(trials):
        k = trial % len(arms)
        for order, arm in enumerate(list(arms[k:]) + list(arms[:k])):
            got = spawn(arm, n, target, seed, timeout, python)
            rows.append({c: np.nan for c in COLUMNS} | dict(arm=arm, trial=trial, order=order, error="")
                        | got | dict(driver_calls_model=models[arm]))
        df = pd.DataFrame(rows, columns=COLUMNS).assign(**prov)
        if out:
            publish(df, out)
    return publish(df, None, summary(df).to_string(index=False))


def summary(df: pd.DataFrame, base: str = "torch_expandable") -> pd.DataFrame:
    """Per arm: median total seconds and µs per request [95% interval], and total seconds over `base`'s, paired by
    trial (> 1: slower than base)."""
    ok = df[df["error"].isna() | (df["error"].astype(str) == "")]
    ref = ok[ok["arm"] == base].set_index("trial")["total_s"]
    out = []
    for arm, g in ok.groupby("arm", sort=False):
        g = g.set_index("trial")
        med, lo, hi, k = median_ci(g["total_s"].to_numpy(dtype=float))
        us, us_lo, us_hi, _ = median_ci(g["us_median"].to_numpy(dtype=float))
        both = g.index.intersection(ref.index)
        ratio = ratio_ci(g.loc[both, "total_s"].to_numpy(dtype=float), ref.loc[both].to_numpy(dtype=float)) \
            if len(both) else (np.nan, np.nan, np.nan, 0)
        out.append(dict(arm=arm, trials=k, total_s=med, lo=lo, hi=hi, us_per_request=us, us_lo=us_lo, us_hi=us_hi,
                        **{f"over_{base}": ratio[0], "ratio_lo": ratio[1], "ratio_hi": ratio[2]},
                        device_calls=g["device_calls"].median(), driver_calls_model=g["driver_calls_model"].iloc[0]))
    return pd.DataFrame(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=OUT, help="the CSV ('' for none)")
    ap.add_argument("--trials", type=int, default=TRIALS)
    ap.add_argument("--arms", default=",".join(ARMS), help="comma-separated, of: " + ", ".join(ARMS))
    ap.add_argument("--n", type=int, default=N_REQUESTS, help="requests")
    ap.add_argument("--target", type=int, default=TARGET, help="bytes they sum to")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds per trial and arm")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child, sequence(a.n, a.target, a.seed))))
        return 0
    arms = tuple(x for x in a.arms.split(",") if x)
    try:
        run(a.out or None, arms, a.trials, a.n, a.target, a.seed, a.timeout)
    except ValueError as e:
        ap.error(str(e))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
