"""How much memory each size-class setting wastes on the training run, measured on a GPU and replayed on a CPU.

On a GPU, `record_step_timeline` trains the small GPT with xpool installed and keeps the allocation
timeline of the whole run (model setup, warm-up steps, one recorded step); `measure_waste` does that for
every size-class setting and reads the pool's own counters.  The request sequence of a program does not
depend on the allocator, so replaying the recorded requests and frees, in order, through an
`xpool.Pool` of any setting reproduces that setting's decisions exactly: `replay_waste` does this on a
CPU over a backend that hands out addresses and touches no memory.

    python -m xlab.memory_study --out-dir data     # on a GPU: data/memory_timeline.csv, data/memory_waste.csv
"""
from __future__ import annotations

import argparse
import itertools
import pathlib

import numpy as np
import pandas as pd

from xpool.backends import HostBackend
from xpool.pool import Pool
from xpool.sizeclass import size_class

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


class AddressSpaceBackend(HostBackend):
    """HostBackend's devices and streams, but malloc hands out distinct aligned addresses and touches no
    memory: a replay of a GPU's many GiB costs nothing on the host."""

    def __init__(self, n_devices: int = 64):
        super().__init__(capacity=None, n_devices=n_devices)
        self._next = itertools.count(1)

    def malloc(self, device: int, nbytes: int) -> int:
        self._check_device(device)
        self.mallocs += 1
        return next(self._next) << 12             # distinct and aligned; nothing is ever stored there

    def free(self, device: int, ptr: int, nbytes: int) -> None:
        self.frees += 1

    def fill(self, device: int, ptr: int, nbytes: int, byte: int) -> None:
        raise RuntimeError("AddressSpaceBackend holds no memory: replay with debug mode off")

    read = fill


# ---------------------------------------------------------------------------------------------------------
# CPU (or GPU): replay


def replay(timeline: pd.DataFrame, k: int) -> dict:
    """Replay the allocs and frees of `timeline` through a fresh Pool with k classes per doubling.

    Returns the pool's counters summed over devices: peak_bytes_requested, peak_bytes_reserved,
    device_mallocs, requests, plus unmatched_frees (frees of blocks allocated before the recording began;
    they are skipped).
    """
    pool = Pool(AddressSpaceBackend(), classes_per_doubling=k, limit=0, debug=False, timeline=0)
    live = {}                                # (device, recorded ptr) -> the replayed block
    unmatched = 0
    ev = timeline[timeline["event"].isin(ALLOC_EVENTS + ("free",))]
    for event, device, stream, ptr, requested in zip(ev["event"], ev["device"], ev["stream"], ev["ptr"],
                                                      ev["requested"]):
        key = (int(device), int(ptr))
        if event == "free":
            if live.pop(key, None) is None:
                unmatched += 1
        else:
            live[key] = pool.allocate(int(requested), device=int(device), stream=int(stream))
    stats = pool.stats()
    out = {name: int(stats[name].sum()) for name in
           ("requests", "device_mallocs", "peak_bytes_requested", "peak_bytes_reserved")}
    out["unmatched_frees"] = unmatched
    live.clear()
    return out


def class_bytes(requested, k: int) -> int:
    """Total bytes the size classes of setting k give to these requests."""
    return int(sum(size_class(int(n), k) for n in requested))


def _step_requests(timeline: pd.DataFrame) -> pd.Series:
    """Request sizes of the last recorded training step (of every event when there is no `step` column)."""
    allocs = timeline[timeline["event"].isin(ALLOC_EVENTS)]
    if "step" in allocs and (allocs["step"] > SETUP_STEP).any():
        allocs = allocs[allocs["step"] == allocs["step"].max()]
    return allocs["requested"]


def replay_waste(timeline: pd.DataFrame, ks=KS) -> pd.DataFrame:
    """Waste of each size-class setting, replayed from one recorded timeline (one row per k).

    class_over_requested: bytes the classes hand out / bytes requested, over the last step's requests;
    reserved_over_requested: peak bytes reserved / peak bytes requested over the whole recording.
    """
    requested = _step_requests(timeline)
    rows = []
    for k in ks:
        r = replay(timeline, int(k))
        cb = class_bytes(requested, int(k))
        rows.append(dict(k=int(k), source="replay", requests=len(requested), requested_bytes=int(requested.sum()),
                         class_bytes=cb, class_over_requested=cb / max(int(requested.sum()), 1),
                         peak_bytes_requested=r["peak_bytes_requested"],
                         peak_bytes_reserved=r["peak_bytes_reserved"],
                         reserved_over_requested=r["peak_bytes_reserved"] / max(r["peak_bytes_requested"], 1),
                         device_mallocs=r["device_mallocs"], unmatched_frees=r["unmatched_frees"]))
    out = pd.DataFrame(rows, columns=WASTE_COLUMNS)
    for col in _CARRIED:                  # the replay describes the recorded run: keep its provenance
        if col in timeline and len(timeline):
            out[col] = timeline[col].iloc[0]
    return out


def waste_table(measured: pd.DataFrame | None = None, replayed: pd.DataFrame | None = None) -> pd.DataFrame | None:
    """One row per k: waste in percent, with the measured and replayed peaks side by side where both exist.

    `replay_exact` says whether the CPU replay reproduced the GPU's peak reserved bytes and device mallocs.
    """
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
    if measured is not None and replayed is not None and len(measured) and len(replayed):
        rep = replayed.set_index("k")
        ks = out["k"]
        out["replayed peak reserved GiB"] = ks.map(rep["peak_bytes_reserved"]).to_numpy() / 2**30
        out["replay_exact"] = ((ks.map(rep["peak_bytes_reserved"]).to_numpy() == main["peak_bytes_reserved"].to_numpy())
                               & (ks.map(rep["device_mallocs"]).to_numpy() == main["device_mallocs"].to_numpy()))
    return out.reset_index(drop=True)


# ---------------------------------------------------------------------------------------------------------
# GPU: measure


def _config(config=None, batch=None):
    from tapegpt import GPTConfig
    if config is None:
        cfg = GPTConfig()
    elif isinstance(config, dict):
        cfg = GPTConfig(**config)
    else:
        cfg = config
    if batch is not None:
        cfg = GPTConfig(**dict(cfg.to_dict(), batch_size=int(batch)))
    return cfg


def record_step_timeline(k: int = 1, config=None, batch: int | None = None, warmup: int = 1, seed: int = 0,
                         capacity: int = 2_000_000, pool=None) -> pd.DataFrame:
    """GPU: the allocation timeline of setup + `warmup` steps + one recorded step of the GPT on CuPy.

    Each event carries `step` (-1: building the model and optimizer; the last step is the recorded one).
    Raises if the ring of `capacity` events overflowed (the replay needs every event).
    """
    import cupy

    from xpool.cupy_adapter import MemoryPool, use
    from tapegpt import GPT, AdamW, get_batch, load_corpus
    cfg = _config(config, batch)
    pool = pool if pool is not None else MemoryPool(classes_per_doubling=k, timeline=capacity)
    data = load_corpus()
    marks = []                               # events recorded when each phase ended

    def mark():
        cupy.cuda.Device().synchronize()
        marks.append(len(pool.timeline()))

    with use(pool):
        model = GPT(cfg, xp=cupy, seed=seed)
        opt = AdamW(model.params, lr=1e-3)
        mark()
        for step in range(warmup + 1):
            x, y = get_batch(data, cfg.batch_size, cfg.block_size, step, seed=seed, xp=cupy)
            loss, grads = model.loss_and_grads(x, y)
            opt.step(grads)
            del x, y, loss, grads
            mark()
        tl = pool.timeline()
        del model, opt
    if tl.attrs.get("dropped"):
        raise RuntimeError(f"timeline ring overflowed ({tl.attrs['dropped']} events lost): raise capacity")
    bounds = np.asarray(marks)
    tl["step"] = np.searchsorted(bounds, np.arange(len(tl)), side="right") - 1
    tl = tl[TIMELINE_COLUMNS].copy()
    stats = pool.stats()
    tl.attrs.update(k=k, peak_bytes_reserved=int(stats["peak_bytes_reserved"].sum()),
                    peak_bytes_requested=int(stats["peak_bytes_requested"].sum()),
                    device_mallocs=int(stats["device_mallocs"].sum()), requests=int(stats["requests"].sum()))
    return tl


def measure_waste(ks=KS, config=None, batch: int | None = None, warmup: int = 1, seed: int = 0):
    """GPU: for each k, train with xpool(k) installed; returns (waste rows, the timeline recorded at ks[0])."""
    from .provenance import provenance
    cfg = _config(config, batch)
    rows, first = [], None
    for k in ks:
        tl = record_step_timeline(int(k), cfg, warmup=warmup, seed=seed)
        first = tl if first is None else first
        requested = _step_requests(tl)
        cb = class_bytes(requested, int(k))
        a = tl.attrs
        rows.append(dict(k=int(k), source="measured", requests=len(requested),
                         requested_bytes=int(requested.sum()), class_bytes=cb,
                         class_over_requested=cb / max(int(requested.sum()), 1),
                         peak_bytes_requested=a["peak_bytes_requested"], peak_bytes_reserved=a["peak_bytes_reserved"],
                         reserved_over_requested=a["peak_bytes_reserved"] / max(a["peak_bytes_requested"], 1),
                         device_mallocs=a["device_mallocs"], unmatched_frees=0))
    prov = provenance(batch=cfg.batch_size, n_layer=cfg.n_layer, n_embd=cfg.n_embd, block_size=cfg.block_size,
                      warmup=warmup)
    waste = pd.DataFrame(rows, columns=WASTE_COLUMNS).assign(**prov)
    timeline = first.assign(k=int(ks[0]), **prov)
    return waste, timeline


def run(out="data/memory_waste.csv", ks=KS, config=None, batch: int | None = None, warmup: int = 1):
    """GPU: measure; write the waste rows to `out` and the timeline to memory_timeline.csv beside it.

    Returns the waste rows (what a notebook's load_or_measure expects).
    """
    waste, timeline = measure_waste(tuple(int(k) for k in ks), config, batch, warmup)
    out = pathlib.Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    waste.to_csv(out, index=False)
    timeline.to_csv(out.parent / "memory_timeline.csv", index=False)
    return waste


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", "--out", default="data", help="folder the two CSVs go to (default: data)")
    p.add_argument("--ks", default="1,2,4,8", help="size classes per doubling to compare (default: 1,2,4,8)")
    p.add_argument("--batch", type=int, default=None, help="batch size (default: GPTConfig's)")
    p.add_argument("--warmup", type=int, default=1, help="steps before the recorded one (default: 1)")
    a = p.parse_args(argv)
    ks = tuple(int(k) for k in a.ks.split(","))
    waste = run(pathlib.Path(a.out_dir) / "memory_waste.csv", ks, batch=a.batch, warmup=a.warmup)
    replayed = replay_waste(pd.read_csv(pathlib.Path(a.out_dir) / "memory_timeline.csv"), ks)
    print(waste_table(waste, replayed).to_string(index=False))


if __name__ == "__main__":
    main()
