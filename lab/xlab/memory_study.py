"""How much memory each scheme and size-class setting holds on the training run: measured on a GPU, replayed on a CPU.

A program's requests do not depend on the allocator, so replaying a recorded timeline's allocs and frees, in
order, through a pool over a backend that touches no memory (`AddressSpaceBackend`) reproduces that pool's
decisions exactly. GPU: `measure_waste` (the seed scheme at each k, its counters and timeline), `measure_varlen`
(sequence lengths changing every step). CPU: `scheme_study` replays every recorded trace through each scheme (the
NumPy ones recorded by `python -m xlab.numpy_traces`).

    python -m xlab.memory_study --out-dir data     # GPU: memory_timeline.csv, memory_waste.csv, memory_varlen.csv
    python -m xlab.memory_study --schemes          # CPU: data/memory_schemes.csv (then `make report`: its figure)
"""
from __future__ import annotations

import argparse
import bisect
import gc
import itertools
import math
import pathlib
from collections import defaultdict

import numpy as np
import pandas as pd

from tapegpt import GPT, AdamW, GPTConfig, get_batch, load_corpus
from xlab import allocators as registry
from xlab.paths import publish, write_csv
from xlab.provenance import provenance
from xlab.reserve import reserve as xlab_reserve
from xpool.pool import Pool
from xpool.sizeclass import ALIGN, size_class
from xpool_twin.testing import allocate_function
from xpool_twin import TwinBackend

KS = (1, 2, 4, 8)
SETUP_STEP = -1                  # `step` of the events recorded while the model and optimizer are built
ALLOC_EVENTS = ("alloc_hit", "alloc_miss")
TIMELINE_COLUMNS = ["step", "t_s", "device", "event", "stream", "ptr", "requested", "size",
                    "bytes_in_use", "bytes_cached", "bytes_reserved"]
_CARRIED = ("gpu", "n_gpus", "driver", "cuda", "cupy", "commit", "date", "batch", "n_layer", "n_embd",
            "block_size", "warmup")
WASTE_COLUMNS = ["k", "source", "requests", "requested_bytes", "class_bytes", "class_over_requested",
                 "peak_bytes_requested", "peak_bytes_reserved", "reserved_over_requested",
                 "device_mallocs", "unmatched_frees"]


class AddressSpace:
    """A host backend's devices and streams, but malloc hands out aligned address ranges that never overlap and
    touches no memory: a replay of a GPU's many GiB costs nothing on the host.  Mixed into a host backend with a
    twin (AddressSpaceBackend), whose expandable pages are of the H200's granularity: mapped, never touched."""

    def __init__(self, n_devices: int = 64, granularity: int = 2 << 20):
        super().__init__(capacity=None, n_devices=n_devices, granularity=granularity)
        self._next = 1 << 12

    def malloc(self, device: int, nbytes: int) -> int:
        self._check_device(device)
        self.mallocs += 1
        # a segment's ranges are addresses inside it: the next allocation starts past its end
        ptr, self._next = self._next, self._next + (-(-max(nbytes, 1) // 4096) + 1) * 4096
        return ptr                                # nothing is ever stored there

    def free(self, device: int, ptr: int, nbytes: int) -> None:
        self.frees += 1

    def fill(self, device: int, ptr: int, nbytes: int, byte: int) -> None:
        raise RuntimeError("AddressSpaceBackend holds no memory: replay with debug mode off")

    read = fill


class AddressSpaceBackend(AddressSpace, TwinBackend):
    """AddressSpace over the host twin (xpool_twin.TwinBackend): the product's replays."""


# --- CPU (or GPU): replay
def replay(timeline: pd.DataFrame, k: int) -> dict:
    """Replay the allocs and frees of `timeline` through a fresh Pool of the seed scheme with k classes per
    doubling: its counters summed over devices (peak_bytes_requested, peak_bytes_reserved, device_mallocs,
    requests) and unmatched_frees (frees of blocks allocated before the recording began: skipped)."""
    pool = Pool(AddressSpaceBackend(), scheme="seed", classes_per_doubling=k, limit=0, debug=False, timeline=0)
    counters, _, unmatched = _replay_through(pool, timeline)
    return dict(counters, unmatched_frees=unmatched)


class CupyPoolModel:
    """CuPy's `MemoryPool` (cupy/cuda/memory.pyx, SingleDeviceMemoryPool), modelled for replays: requests
    rounded to 512 B; per (device, stream) arena, the free chunk of the least size >= the request (best
    fit; the newest among equals), split, the rest kept free; a freed chunk merges with free neighbours
    of its allocation; a miss allocates exactly the rounded size.  Counts bytes like xpool's pools:
    reserved = what the device holds.  Only what the replay needs: no limits, no OOM."""

    def __init__(self):
        self.free = {}          # (device, stream) -> sorted [(size, -serial, ptr)]
        self.chunks = {}        # (device, ptr) -> [size, stream, prev ptr|None, next ptr|None, in use]
        (self.reserved, self.requested, self.peak_reserved, self.peak_requested, self.device_mallocs,
         self.requests) = (defaultdict(int) for _ in range(6))     # per device
        self._serial = itertools.count()
        self._next = itertools.count(1)
        self._free_key = {}     # (device, ptr) -> its entry in the free list

    def _file(self, device, ptr):
        size, stream = self.chunks[(device, ptr)][:2]
        entry = (size, -next(self._serial), ptr)
        bisect.insort(self.free.setdefault((device, stream), []), entry)
        self._free_key[(device, ptr)] = entry

    def _unfile(self, device, ptr):
        entry = self._free_key.pop((device, ptr))
        lst = self.free[(device, self.chunks[(device, ptr)][1])]
        del lst[bisect.bisect_left(lst, entry)]

    def allocate(self, nbytes: int, device: int = 0, stream: int = 0) -> tuple[int, int, int]:
        """A chunk for nbytes; returns its handle (device, ptr, nbytes) for `free`."""
        size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        self.requests[device] += 1
        lst = self.free.get((device, stream), [])
        i = bisect.bisect_left(lst, (size, -math.inf, 0))
        if i < len(lst):
            ptr = lst[i][2]
            self._unfile(device, ptr)
            c = self.chunks[(device, ptr)]
            if c[0] > size:                   # split: the rest stays free
                rest = ptr + size
                self.chunks[(device, rest)] = [c[0] - size, stream, ptr, c[3], False]
                if c[3] is not None:
                    self.chunks[(device, c[3])][2] = rest
                c[0], c[3] = size, rest
                self._file(device, rest)
        else:
            ptr = next(self._next) << 40      # apart from every other allocation
            self.chunks[(device, ptr)] = [size, stream, None, None, False]
            self.reserved[device] += size
            self.device_mallocs[device] += 1
        self.chunks[(device, ptr)][4] = True
        self.requested[device] += nbytes
        self.peak_reserved[device] = max(self.peak_reserved[device], self.reserved[device])
        self.peak_requested[device] = max(self.peak_requested[device], self.requested[device])
        return device, ptr, nbytes

    def free_chunk(self, handle) -> None:
        device, ptr, nbytes = handle
        self.requested[device] -= nbytes
        c = self.chunks[(device, ptr)]
        c[4] = False
        nxt = c[3]
        if nxt is not None and not self.chunks[(device, nxt)][4]:
            self._unfile(device, nxt)
            n = self.chunks.pop((device, nxt))
            c[0] += n[0]; c[3] = n[3]
            if n[3] is not None:
                self.chunks[(device, n[3])][2] = ptr
        prv = c[2]
        if prv is not None and not self.chunks[(device, prv)][4]:
            self._unfile(device, prv)
            p = self.chunks[(device, prv)]
            p[0] += c[0]; p[3] = c[3]
            if c[3] is not None:
                self.chunks[(device, c[3])][2] = prv
            del self.chunks[(device, ptr)]
            ptr = prv
        self._file(device, ptr)


def class_bytes(requested, k: int) -> int:
    """Total bytes the size classes of setting k (classes per doubling) give to these request sizes."""
    return int(sum(size_class(int(n), k) for n in requested))


def _waste_row(k: int, source: str, requested: pd.Series, counters: dict) -> dict:
    """One row of WASTE_COLUMNS: the classes' bytes over the last step's `requested`, and the run's `counters`
    (unmatched_frees 0 where they have none)."""
    cb = class_bytes(requested, k)
    reserved, peak_requested = counters["peak_bytes_reserved"], counters["peak_bytes_requested"]
    return dict(k=k, source=source, requests=len(requested), requested_bytes=int(requested.sum()), class_bytes=cb,
                class_over_requested=cb / max(int(requested.sum()), 1), peak_bytes_requested=peak_requested,
                peak_bytes_reserved=reserved, reserved_over_requested=reserved / max(peak_requested, 1),
                device_mallocs=counters["device_mallocs"], unmatched_frees=counters.get("unmatched_frees", 0))


def _step_requests(timeline: pd.DataFrame) -> pd.Series:
    """Request sizes of the last recorded training step (of every event when there is no `step` column)."""
    allocs = timeline[timeline["event"].isin(ALLOC_EVENTS)]
    if "step" in allocs and (allocs["step"] > SETUP_STEP).any():
        allocs = allocs[allocs["step"] == allocs["step"].max()]
    return allocs["requested"]


def replay_waste(timeline: pd.DataFrame, ks=KS) -> pd.DataFrame:
    """Waste of each size-class setting replayed from one recorded timeline (memory_timeline.csv): one row per k of
    WASTE_COLUMNS (source "replay": class_over_requested over the last step's requests, reserved_over_requested
    over the whole recording), with the recording's provenance."""
    requested = _step_requests(timeline)
    rows = [_waste_row(int(k), "replay", requested, replay(timeline, int(k))) for k in ks]
    out = pd.DataFrame(rows, columns=WASTE_COLUMNS)
    for col in _CARRIED:                  # the replay describes the recorded run: keep its provenance
        if col in timeline and len(timeline):
            out[col] = timeline[col].iloc[0]
    return out


def waste_table(measured: pd.DataFrame | None = None, replayed: pd.DataFrame | None = None) -> pd.DataFrame | None:
    """One row per k: waste in percent, the measured and replayed peaks side by side where both exist (`replay_exact`:
    the CPU replay reproduced the GPU's peak reserved bytes and device mallocs); None without either."""
    frames = [f for f in (measured, replayed) if f is not None and len(f)]
    if not frames:
        print("Nothing to tabulate: no measured waste and no timeline to replay.")
        return None
    main = frames[0]
    out = pd.DataFrame({
        "k": main["k"].astype(int),
        "source": main["source"],
        "class waste %": 100 * (main["class_over_requested"] - 1),
        "peak reserved / requested": main["reserved_over_requested"],
        "peak reserved GiB": main["peak_bytes_reserved"] / 2**30,
        "peak requested GiB": main["peak_bytes_requested"] / 2**30,
        "device mallocs": main["device_mallocs"].astype(int),
    })
    if len(frames) == 2:
        rep = replayed.set_index("k")
        ks = out["k"]
        out["replayed peak reserved GiB"] = ks.map(rep["peak_bytes_reserved"]).to_numpy() / 2**30
        out["replay_exact"] = ((ks.map(rep["peak_bytes_reserved"]).to_numpy() == main["peak_bytes_reserved"].to_numpy())
                               & (ks.map(rep["device_mallocs"]).to_numpy() == main["device_mallocs"].to_numpy()))
    return out.reset_index(drop=True)


# --- CPU: the allocation schemes on every recorded trace
# name -> its file under data/: the GPU's recording (CuPy, batch 32, setup + 2 steps; before the fused model), and
# the CPU's (xlab.numpy_traces.NUMPY_TRACES: their settings; every row of a file also carries them)
TRACES = {
    "gpt_b32_gpu": "memory_timeline.csv",
    "gpt_b4_numpy": "memory_trace_numpy_b4.csv.gz",
    "gpt_b32_numpy": "memory_trace_numpy_b32.csv.gz",
    "gpt_varlen_numpy": "memory_trace_numpy_varlen.csv.gz",
    "gpt_b32_perparam_numpy": "memory_trace_numpy_b32_perparam.csv.gz",
    "gpt_b4_cupy_path_numpy": "memory_trace_cupy_path_b4.csv.gz",
    "gpt_b32_cupy_path_numpy": "memory_trace_cupy_path_b32.csv.gz",
    "gpt_b32_perparam_cupy_path_numpy": "memory_trace_cupy_path_b32_perparam.csv.gz",
    "gpt_varlen_cupy_path_numpy": "memory_trace_cupy_path_varlen.csv.gz",
}
VARLEN = (256, 64, 192, 128, 224, 96, 160, 32, 256, 128, 200, 80)     # sequence length per step
VARLEN_BATCH = 8                 # the varying-length traces' batch
# the replayed allocators: xpool's schemes, xpool giving segments back on a miss never or always (the default:
# above the high-water mark only), CuPy's pool
SCHEME_ALLOCATORS = registry.SETS["schemes"]
SCHEME_COLUMNS = ["trace", "allocator", "source", "requests", "peak_bytes_requested", "peak_bytes_reserved",
                  "reserved_over_requested", "device_mallocs", "device_mallocs_last_step", "device_mallocs_warm",
                  "device_frees_warm", "unmatched_frees",
                  "ns_per_pair", "ns_per_pair_min", "ns_per_pair_max", "floor_ns_per_pair", "timed_pairs",
                  "repeats", "timed_device_mallocs", "trace_recorded_on", "trace_commit", "trace_date", "trace_batch"]


def replay_pool(allocator: str):
    """A fresh pool of one of SCHEME_ALLOCATORS over a backend that touches no memory (or CuPy's model)."""
    if allocator == "cupy_pool_model":
        return CupyPoolModel()
    kw = {"xpool": dict(scheme="segments"),
          "xpool_seed": dict(scheme="seed", classes_per_doubling=1),
          "xpool_expandable": dict(scheme="expandable")}
    if allocator not in kw:
        raise ValueError(f"allocator must be one of {SCHEME_ALLOCATORS}, got {allocator!r}")
    return Pool(AddressSpaceBackend(), limit=0, debug=False, timeline=0, **kw[allocator])


def stats_row(pool, device: int = 0) -> dict:
    """One device's counters of a pool (its stats Snapshot's row), as a dict."""
    return dict(pool.stats(device)[device])


def _replay_events(timeline: pd.DataFrame) -> pd.DataFrame:
    ev = timeline[timeline["event"].isin(ALLOC_EVENTS + ("free",))]
    step = ev["step"] if "step" in ev else pd.Series(0, index=ev.index)
    return pd.DataFrame({"alloc": ev["event"].isin(ALLOC_EVENTS).to_numpy(), "device": ev["device"].to_numpy(),
                         "stream": ev["stream"].to_numpy(), "ptr": ev["ptr"].to_numpy(),
                         "requested": ev["requested"].to_numpy(), "step": step.to_numpy()})


def _rows(ev: pd.DataFrame) -> list:
    """The events as plain tuples of Python ints (a timed loop must not pay for pandas or NumPy scalars)."""
    return [(bool(a), int(d), int(s), int(p), int(n), int(t))
            for a, d, s, p, n, t in ev.itertuples(index=False, name=None)]


def _drive(pool, ev, on_step=None, live=None):
    """Replays the events (a frame from _replay_events, or its _rows) through pool (an xpool Pool or
    CupyPoolModel), the blocks of earlier events in `live` (a dict _drive returned); returns (live blocks, unmatched
    frees)."""
    model = isinstance(pool, CupyPoolModel)
    alloc = pool.allocate if model else getattr(pool, "raw_allocate", None) or allocate_function(pool)  # C alone
    live, unmatched, last = {} if live is None else live, 0, None
    rows = _rows(ev) if isinstance(ev, pd.DataFrame) else ev
    for is_alloc, device, stream, ptr, requested, step in rows:
        if on_step is not None and step != last:
            on_step(last)
            last = step
        key = (device, ptr)
        # no local name may hold a block: a block is given back when its last reference goes
        if is_alloc:
            if model and key in live:
                pool.free_chunk(live[key])
            live[key] = alloc(requested, device, stream)
        elif key not in live:
            unmatched += 1
        elif model:
            pool.free_chunk(live.pop(key))
        else:
            del live[key]
    if on_step is not None:
        on_step(last)
    return live, unmatched


def _counters(pool) -> dict:
    """A replayed pool's counters over every device; the expandable scheme's maps and unmaps count as its device
    mallocs and frees (CuPy's model never frees)."""
    if isinstance(pool, CupyPoolModel):
        return dict(requests=sum(pool.requests.values()), device_mallocs=sum(pool.device_mallocs.values()),
                    device_frees=0, peak_bytes_requested=sum(pool.peak_requested.values()),
                    peak_bytes_reserved=sum(pool.peak_reserved.values()))
    st = pool.stats()
    names = ("requests", "device_mallocs", "device_maps", "device_frees", "device_unmaps", "peak_bytes_requested",
             "peak_bytes_reserved")
    total = {c: int(st[c]) for c in names}
    return dict(requests=total["requests"], device_mallocs=total["device_mallocs"] + total["device_maps"],
                device_frees=total["device_frees"] + total["device_unmaps"],
                peak_bytes_requested=total["peak_bytes_requested"], peak_bytes_reserved=total["peak_bytes_reserved"])


WARMUP_STEPS = 5   # the experiments' warm-up: from this step on, a warm pool makes no device malloc or free


def _device_calls(pool) -> tuple:
    """(device mallocs, device frees) of a replayed pool so far (maps and unmaps counted as those)."""
    c = _counters(pool)
    return c["device_mallocs"], c["device_frees"]


def _replay_through(pool, timeline: pd.DataFrame):
    """(counters, {step: (device mallocs, device frees) so far at its end}, unmatched frees) of `timeline` replayed
    through `pool`, its blocks given back after the counters are read."""
    calls = {}
    live, unmatched = _drive(pool, _replay_events(timeline), lambda step: calls.__setitem__(step, _device_calls(pool)))
    counters = _counters(pool)
    live.clear()
    return counters, {s: c for s, c in calls.items() if s is not None}, unmatched


def replay_steps(timeline: pd.DataFrame, allocator: str) -> pd.DataFrame:
    """Device mallocs and frees per recorded step (-1: setup) of `timeline` replayed through `allocator`."""
    _, calls, _ = _replay_through(replay_pool(allocator), timeline)
    before = [(0, 0), *calls.values()]
    return pd.DataFrame([(s, m - m0, f - f0) for (s, (m, f)), (m0, f0) in zip(calls.items(), before)],
                        columns=["step", "device_mallocs", "device_frees"])


def replay_allocator(timeline: pd.DataFrame, allocator: str) -> dict:
    """Replays `timeline` through a fresh `allocator` (one of SCHEME_ALLOCATORS): its peaks, device mallocs
    (in all, in the last recorded step, and in the steps from WARMUP_STEPS on, which should make none:
    NaN when the trace has no such step), device frees from WARMUP_STEPS on, and unmatched frees."""
    out, calls, unmatched = _replay_through(replay_pool(allocator), timeline)
    steps = list(calls)
    out["device_mallocs_last_step"] = calls[steps[-1]][0] - (calls[steps[-2]][0] if len(steps) > 1 else 0)
    before = [s for s in steps if s < WARMUP_STEPS]
    if steps[-1] >= WARMUP_STEPS and before:
        out["device_mallocs_warm"] = calls[steps[-1]][0] - calls[before[-1]][0]
        out["device_frees_warm"] = calls[steps[-1]][1] - calls[before[-1]][1]
    else:
        out["device_mallocs_warm"] = out["device_frees_warm"] = float("nan")
    out["unmatched_frees"] = unmatched
    out["reserved_over_requested"] = out["peak_bytes_reserved"] / max(out["peak_bytes_requested"], 1)
    return out


def replay_cost(timeline: pd.DataFrame, allocators=("xpool", "xpool_seed"), repeats: int = 7,
                min_pairs: int = 20_000) -> pd.DataFrame:
    """Benchmark: ns per alloc+free pair of each xpool scheme over the host backend, on the last step of a
    recorded trace once the whole trace has warmed the pool.  The step is replayed on its own, so blocks
    it frees that earlier steps made are skipped and blocks it leaves live are freed at its end: a scheme
    can miss there where the real program would not (`timed_device_mallocs` counts those misses, whose
    backend calls are timed too).

    The pairs go through the C core from a Python loop; `floor_ns_per_pair` is the same loop around a
    function that allocates nothing, and is subtracted.  Repeats interleave the allocators.  CuPy's pool
    cannot run without a GPU: its cost is measured by xlab.bench.alloc on one."""
    import time
    ev = _replay_events(timeline)
    last = ev[ev["step"] == ev["step"].max()]
    n_pairs = max(int(last["alloc"].sum()), 1)
    step = _rows(last)
    passes = max(1, -(-min_pairs // n_pairs))
    pools = {}
    for a in allocators:
        pools[a] = replay_pool(a)
        pools[a]._keep = _drive(pools[a], ev)[0]       # warm, holding what the recording left live
        _drive(pools[a], step)[0].clear()             # the last step once more: its misses are not timed

    class Floor:
        raw_allocate = staticmethod(lambda n, d, s: n)     # allocates nothing: the replay loop's own cost

    def timed(pool):
        t0 = time.perf_counter_ns()
        for _ in range(passes):
            live, _ = _drive(pool, step)
            live.clear()
        return (time.perf_counter_ns() - t0) / (passes * n_pairs)

    runs = {a: [] for a in (*allocators, "floor")}
    before = {a: _counters(p)["device_mallocs"] for a, p in pools.items()}
    for r in range(repeats):
        order = [*allocators, "floor"]
        for a in order[r % len(order):] + order[:r % len(order)]:
            runs[a].append(timed(Floor() if a == "floor" else pools[a]))
    floor = float(np.median(runs["floor"]))
    rows = [dict(allocator=a, ns_per_pair=float(np.median(runs[a])) - floor,
                 ns_per_pair_min=min(runs[a]) - floor, ns_per_pair_max=max(runs[a]) - floor,
                 floor_ns_per_pair=floor, timed_pairs=passes * n_pairs, repeats=repeats,
                 timed_device_mallocs=_counters(pools[a])["device_mallocs"] - before[a])
            for a in allocators]
    for p in pools.values():
        p._keep.clear()
    return pd.DataFrame(rows)


def load_traces(data_dir=None, names=None) -> dict:
    """The recorded traces of TRACES present under data_dir (default: the repository's data/): name ->
    timeline."""
    from .paths import data_dir as repo_data
    folder = pathlib.Path(data_dir if data_dir is not None else repo_data())
    files = {name: folder / TRACES[name] for name in names or TRACES}
    return {name: pd.read_csv(path) for name, path in files.items() if path.is_file()}


# The H200's traces of the dynamic-shape benchmark's workloads (python -m xlab.bench.dynamic_traces,
# data/memory_trace_dyn_<name>.csv.gz; _s<k>: the realization of seed k), and of its held-out ones with gpt_varlen's
# other realizations.  The release rules' trace tests and replays (docs/decisions/0001-one-release-rule-per-scheme.md)
# run over these.
DYN_TRACES = ("cupy_mix", "torch_varlen", "gpt_varlen", "gpt_b4", "test_b4", "test_b32_perparam", "torch_fixed",
              "gpt_b32", "resnet_varres", "resnet_fixed",
              *(f"{w}_s{s}" for w in ("cupy_mix", "torch_varlen", "resnet_varres") for s in (1, 2, 3, 4)))
HELD_OUT_TRACES = ("torch_varlen_b32", *(f"torch_varlen_b32_s{s}" for s in (1, 2, 3, 4)), "torch_fixed_b32",
                   "resnet_varres_b64", *(f"resnet_varres_b64_s{s}" for s in (1, 2, 3, 4)),
                   *(f"gpt_varlen_s{s}" for s in (1, 2, 3, 4)))
DYN_PAGE = 2 << 20       # the H200's granularity: AddressSpaceBackend's page


def dyn_trace(name: str, data_dir=None) -> pd.DataFrame:
    """One trace of DYN_TRACES or HELD_OUT_TRACES (default folder: the repository's data/)."""
    from .paths import data_dir as repo_data
    return pd.read_csv(pathlib.Path(data_dir if data_dir is not None else repo_data()) /
                       f"memory_trace_dyn_{name}.csv.gz")


def build_events(tl: pd.DataFrame) -> int:
    """How many of a dynamic trace's events build the program (the model, its parameters), by their blocks: step 0's
    leading events up to the last block that outlives step 2, before the first 20 events in a row that make none
    (the first step's own work). The traces do not mark the build; the PyTorch workloads' runs with a reserve made
    after it (`python -m xlab.bench.reserve --when build`) check this boundary against the GPU's."""
    ev = _replay_events(tl)
    alloc, ptr, step = ev["alloc"].to_numpy(), ev["ptr"].to_numpy(), ev["step"].to_numpy()
    made, freed_at = {}, {}
    for k in range(len(ev)):
        if alloc[k]:
            made[ptr[k]] = k
        elif ptr[k] in made:
            freed_at[made.pop(ptr[k])] = k
    kept = [k for k in range(len(ev)) if alloc[k] and step[k] == 0 and (k not in freed_at or step[freed_at[k]] > 2)]
    for a, b in zip(kept, kept[1:]):
        if b - a > 20:
            return a + 1
    return kept[-1] + 1 if kept else 0


def _rule_pool(events: bool):
    """A fresh pool of scheme expandable over the host twin, the product's one rule; its timeline kept with `events`."""
    return Pool(AddressSpaceBackend(), scheme="expandable", limit=0, timeline=10_000_000 if events else 0)


def replay_rule(tl: pd.DataFrame, rule: str | None = None, reserve=0, after: int = 0, events: bool = False) -> dict:
    """A dynamic trace under scheme expandable, 2 MiB pages over the host twin (the replays equal the GPU's runs to
    the byte and the call): the product's one rule (`rule` None or "never"; the replays of the rules it no longer
    has are committed in data/release_rules.csv, xlab.rule_study); with `reserve` bytes, a reserve up front
    (xlab.reserve) on the trace's first stream
    before its event `after` (0: before anything; `build_events(tl)`: after the program's build): the bytes in use and
    a free block of the rest, allocated and freed, then the peaks reset: its pages stay mapped as one free run.
    `reserve` may be a function of the pool's stats row at that moment (a reserve from the peak seen so far, made
    mid-run); the peaks reported are then the most of the run's, before the reset and after:
    - ratio: peak reserved / peak requested;
    - reserve_bytes: the bytes asked of pool.reserve (0: none);
    - steady_calls, steady_unmaps: maps + unmaps, and unmaps alone, in the benchmark's steady state
      (xlab.bench.dynamic.steady_state over the workload's steps, probed after each as the benchmark probes them;
      the trace's teardown after the last step is not counted);
    - calls_after_warmup: maps + unmaps from the end of the last warm-up step to the end of the trace, teardown
      included;
    and the counts they come from; with `events`, also the pool's timeline (`timeline`: every request, free, map
    and unmap, for a study of the replay's maps) and `probes` ({step: (maps, unmaps, peak requested) at its end})."""
    from xlab.bench.dynamic import steady_state
    if rule not in (None, "never"):
        raise ValueError(f"rule must be None or 'never' (the product's one rule), got {rule!r}: the replays of the "
                         "other rules are committed in data/release_rules.csv (xlab.rule_study)")
    pool = _rule_pool(events)
    trace = _replay_events(tl)
    device, stream = int(trace["device"].iloc[0]), int(trace["stream"].iloc[0])
    probes = {}                                           # step -> (maps, unmaps, peak requested) at its end
    reset = {"peak_bytes_requested": 0, "peak_bytes_reserved": 0}   # the peaks the reserve's reset forgot
    asked, rows = 0, _rows(trace)

    def probe(step):                                      # _drive calls it with None before the first event
        s = stats_row(pool)
        probes[step] = (s["device_maps"], s["device_unmaps"],
                        max(s["peak_bytes_requested"], reset["peak_bytes_requested"]))
    live, unmatched = _drive(pool, rows[:after], probe) if reserve else ({}, 0)
    if reserve:
        s = stats_row(pool)
        reset.update({k: int(s[k]) for k in reset})
        asked = reserve(s) if callable(reserve) else reserve
        xlab_reserve(pool, asked, device, stream)
        if after:
            probe(rows[after - 1][-1])                    # its step's counts include the reserve's, as in a program
    live, more = _drive(pool, rows[after if reserve else 0:], probe, live)
    unmatched += more
    s = stats_row(pool)
    for k in reset:
        s[k] = max(s[k], reset[k])
    extra = {}
    if events:
        extra = dict(timeline=pool.timeline(), probes=probes)
        assert extra["timeline"].attrs["dropped"] == 0
    live.clear()
    warmup, steps = int(tl["warmup"].iloc[0]), int(tl["steps"].iloc[0])
    per_step = [probes[k] for k in range(warmup + steps)]   # the workload's steps: the benchmark's probes
    calls = steady_state([(mp + un, p) for mp, un, p in per_step], warmup)
    unmaps = steady_state([(un, p) for _, un, p in per_step], warmup)
    last = probes[max(k for k in probes if k is not None)]
    return dict(ratio=s["peak_bytes_reserved"] / s["peak_bytes_requested"], reserve_bytes=asked,
                steady_calls=calls["device_calls_steady"], steady_unmaps=unmaps["device_calls_steady"],
                calls_after_warmup=sum(last[:2]) - sum(probes[warmup - 1][:2]),
                steady_steps=calls["steady_steps"], demand_peak_step=calls["demand_peak_step"],
                device_calls=s["device_maps"] + s["device_unmaps"],
                peak_bytes_reserved=s["peak_bytes_reserved"], peak_bytes_requested=s["peak_bytes_requested"],
                unmatched_frees=unmatched, **extra)


def scheme_study(traces: dict, allocators=SCHEME_ALLOCATORS, repeats: int = 7) -> pd.DataFrame:
    """One row per (trace, allocator): peak reserved / peak requested and device mallocs by replay, and ns
    per alloc+free pair over the host backend (xpool's schemes; NaN for CuPy's model), with provenance."""
    rows = []
    for name, tl in traces.items():
        cost = replay_cost(tl, [a for a in allocators if a != "cupy_pool_model"], repeats=repeats)
        cost = cost.set_index("allocator")
        first = tl.iloc[0] if len(tl) else {}
        trace = dict(trace_recorded_on=first.get("gpu", "unknown"), trace_commit=first.get("commit", "unknown"),
                     trace_date=first.get("date", "unknown"), trace_batch=first.get("batch", np.nan))
        for a in allocators:
            r = dict(trace=name, allocator=a, source="replay", **replay_allocator(tl, a))
            if a in cost.index:
                r.update(cost.loc[a].to_dict())
            rows.append({**r, **trace})
    return pd.DataFrame(rows, columns=SCHEME_COLUMNS).assign(**provenance())


# --- GPU: measure
def _train(cfg, data, lengths, xp, seed: int = 0, foreach: bool = True, after=lambda: None,
           keep_previous: bool = False):
    """The GPT (seed) and AdamW trained on xp a step per length, after() after setup and each step: (model, opt).
    keep_previous: a step's x, y, loss and grads are rebound by the next step, not deleted after it."""
    model = GPT(cfg, xp=xp, seed=seed)
    opt = AdamW(model.params, lr=1e-3, foreach=foreach)
    after()
    for step, T in enumerate(lengths):
        x, y = get_batch(data, cfg.batch_size, int(T), step, seed=seed, xp=xp)
        loss, grads = model.loss_and_grads(x, y)
        opt.step(grads)
        if not keep_previous:
            del x, y, loss, grads
        after()
    return model, opt


def _config(config=None, batch=None, block_sizes=()):
    """A GPTConfig (None: the reference; a dict of fields; itself), at `batch` sequences when given; ValueError if a
    sequence length of `block_sizes` is not in [1, block_size]."""
    cfg = GPTConfig(**config) if isinstance(config, dict) else config or GPTConfig()
    if block_sizes and (max(block_sizes) > cfg.block_size or min(block_sizes) < 1):
        raise ValueError(f"block_sizes must be in [1, {cfg.block_size}], got {block_sizes}")
    return cfg if batch is None else GPTConfig(**dict(cfg.to_dict(), batch_size=int(batch)))


def record_step_timeline(k: int = 1, config=None, batch: int | None = None, warmup: int = 1, seed: int = 0,
                         capacity: int = 2_000_000, pool=None) -> pd.DataFrame:
    """GPU: the allocation timeline of setup (step -1), `warmup` steps and one recorded step under `pool` (default:
    a seed-scheme MemoryPool with k classes per doubling); RuntimeError if its ring of `capacity` events overflowed."""
    import cupy

    from xpool.cupy_adapter import MemoryPool, use
    cfg = _config(config, batch)
    pool = pool if pool is not None else MemoryPool(scheme="seed", classes_per_doubling=k, timeline=capacity)
    data = load_corpus()
    marks = []                               # events recorded when each phase ended

    def mark():
        cupy.cuda.Device().synchronize()
        marks.append(len(pool.timeline()))

    with use(pool):
        model, opt = _train(cfg, data, [cfg.block_size] * (warmup + 1), cupy, seed, after=mark)
        tl = pool.timeline()
        del model, opt
    if tl.attrs.get("dropped"):
        raise RuntimeError(f"timeline ring overflowed ({tl.attrs['dropped']} events lost): raise capacity")
    tl["step"] = np.searchsorted(np.asarray(marks), np.arange(len(tl)), side="right") - 1
    tl = tl[TIMELINE_COLUMNS].copy()
    stats = pool.stats()
    tl.attrs.update(k=k, peak_bytes_reserved=stats.peak_bytes_reserved, peak_bytes_requested=stats.peak_bytes_requested,
                    device_mallocs=stats.device_mallocs, requests=stats.requests)
    return tl


def measure_waste(ks=KS, config=None, batch: int | None = None, warmup: int = 1, seed: int = 0):
    """GPU: each k trained under xpool: (waste rows, the timeline recorded at ks[0])."""
    cfg = _config(config, batch)
    from tqdm.auto import tqdm
    rows, first = [], None
    for k in tqdm(ks, desc="size-class settings"):
        tl = record_step_timeline(int(k), cfg, warmup=warmup, seed=seed)
        first = tl if first is None else first
        rows.append(_waste_row(int(k), "measured", _step_requests(tl), tl.attrs))
    prov = provenance(batch=cfg.batch_size, n_layer=cfg.n_layer, n_embd=cfg.n_embd, block_size=cfg.block_size,
                      warmup=warmup)
    return pd.DataFrame(rows, columns=WASTE_COLUMNS).assign(**prov), first.assign(k=int(ks[0]), **prov)


def run(out="data/memory_waste.csv", ks=KS, config=None, batch: int | None = None, warmup: int = 1):
    """GPU: measure_waste, the waste rows to `out`, the timeline beside it; the waste rows."""
    waste, timeline = measure_waste(tuple(int(k) for k in ks), config, batch, warmup)
    write_csv(timeline, pathlib.Path(out).parent / "memory_timeline.csv")
    return publish(waste, out)


VARLEN_ALLOCATORS = registry.SETS["varlen"]
VARLEN_COLUMNS = ["trace", "allocator", "source", "steps", "peak_bytes_requested", "peak_bytes_reserved",
                  "reserved_over_requested", "device_mallocs", "device_mallocs_warm", "batch", "block_sizes",
                  "adamw"]


def train_varlen(alloc, cfg, block_sizes, seed: int = 0, foreach: bool = True) -> list:
    """GPU: the device mallocs counted after setup and each step of the GPT trained under `alloc`."""
    import cupy
    data = load_corpus()
    alloc.install(counting=True)
    mallocs = []

    def counted():
        cupy.cuda.Device().synchronize()
        alloc.sample(0)
        mallocs.append(alloc.device_mallocs(0))

    try:
        with alloc.tracking():
            model, opt = _train(cfg, data, block_sizes, cupy, seed, foreach, counted)
            del model, opt
    finally:
        alloc.uninstall()
        gc.collect()
    return mallocs


def measure_varlen(allocators=VARLEN_ALLOCATORS, batch: int | None = None, block_sizes=None, seed: int = 0,
                   foreach: bool = True) -> pd.DataFrame:
    """GPU: each allocator's peak reserved / peak requested (its own exact counters: one run each) over a run whose
    sequence length changes every step (default: the varying-length trace's); device_mallocs_warm from WARMUP_STEPS."""
    batch = int(batch or VARLEN_BATCH)
    block_sizes = tuple(int(t) for t in (block_sizes or VARLEN))
    cfg = _config(None, batch, block_sizes)
    rows = []
    for name in allocators:
        alloc = registry.make(name)
        mallocs = train_varlen(alloc, cfg, block_sizes, seed, foreach)
        reserved, requested = alloc.peak_reserved(0), alloc.peak_requested(0)
        warm = mallocs[-1] - mallocs[WARMUP_STEPS] if len(mallocs) > WARMUP_STEPS + 1 else math.nan
        rows.append(dict(trace="gpt_varlen_gpu", allocator=name, source="measured", steps=len(block_sizes),
                         peak_bytes_requested=requested, peak_bytes_reserved=reserved,
                         reserved_over_requested=reserved / max(requested or 0, 1) if reserved and requested else
                         math.nan,
                         device_mallocs=mallocs[-1], device_mallocs_warm=warm, batch=batch,
                         block_sizes=" ".join(map(str, block_sizes)), adamw="foreach" if foreach else "per_param"))
        alloc.release([0])
    prov = provenance(n_layer=cfg.n_layer, n_embd=cfg.n_embd, block_size=cfg.block_size, seed=seed)
    return pd.DataFrame(rows, columns=VARLEN_COLUMNS).assign(**prov)


def schemes(data_dir="data", repeats: int = 7) -> pd.DataFrame:
    """CPU: replays every recorded trace through each scheme into data/memory_schemes.csv (its figure is redrawn
    from the CSV by `make report`, xlab.plots.build being the one writer of figures/)."""
    df = scheme_study(load_traces(data_dir), repeats=repeats)
    df.to_csv(pathlib.Path(data_dir) / "memory_schemes.csv", index=False)
    return df


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", "--out", default="data", help="folder the two CSVs go to (default: data)")
    p.add_argument("--ks", default="1,2,4,8", help="size classes per doubling to compare (default: 1,2,4,8)")
    p.add_argument("--batch", type=int, default=None, help="batch size (default: GPTConfig's)")
    p.add_argument("--warmup", type=int, default=1, help="steps before the recorded one (default: 1)")
    p.add_argument("--no-varlen", action="store_true",
                   help="GPU: skip the varying-length training run (data/memory_varlen.csv)")
    p.add_argument("--schemes", action="store_true",
                   help="CPU: replay every recorded trace through each scheme: memory_schemes.csv")
    a = p.parse_args(argv)
    if a.schemes:
        df = schemes(a.out_dir)
        cols = ["trace", "allocator", "reserved_over_requested", "device_mallocs", "device_mallocs_last_step",
                "device_mallocs_warm", "device_frees_warm", "ns_per_pair"]
        print(df[cols].to_string(index=False))
        return
    ks = tuple(int(k) for k in a.ks.split(","))
    waste = run(pathlib.Path(a.out_dir) / "memory_waste.csv", ks, batch=a.batch, warmup=a.warmup)
    replayed = replay_waste(pd.read_csv(pathlib.Path(a.out_dir) / "memory_timeline.csv"), ks)
    print(waste_table(waste, replayed).to_string(index=False))
    if not a.no_varlen:
        varlen = measure_varlen()
        publish(varlen, pathlib.Path(a.out_dir) / "memory_varlen.csv",
                varlen[["allocator", "reserved_over_requested", "device_mallocs", "device_mallocs_warm"]].to_string(
                    index=False))


if __name__ == "__main__":
    main()
