"""The expandable scheme's choices, replayed on every recorded trace (Note [Expandable segments]): its release rule
(release_on_miss "never", the default / "bounded" at release_bound 1.02, 1.05 and 1.10 / "growth" / "until_churn" /
"peak", the default of the pool xpool.enable_torch() makes / "high_water" with release_idle 64 or 0 / "always") and small blocks (up to 1 MiB) in a range of their own per
stream, as PyTorch keeps a small and a large pool, against scheme segments.  Pages of 2 MiB (an H200's) over the
host twin; the small-block range is modelled by giving small requests a stream key of their own.  Besides the lab's
traces, the keep-previous-step traces (KEEP_TRACES: the loop rebinds x, y, loss and grads; Note [Release on miss:
expandable]), and the H200's traces of the dynamic-shape benchmark's workloads and of the GPU test's loop
(DYN_TRACES, scripts/record_dynamic_traces.py), whose warm-up is each trace's own (its `warmup` column) and whose
device calls are also given per timed step, as the benchmark counts them.

    python scripts/expandable_variants.py          (CPU, ~1 min: data/expandable_variants.csv, a table)
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import pandas as pd

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xlab import memory_study as m  # noqa: E402
from xlab.provenance import provenance  # noqa: E402
from xpool import Pool  # noqa: E402

VARIANTS = {   # name -> (pool settings, small blocks on a range of their own)
    "segments": (dict(scheme="segments"), False),
    "expandable": (dict(scheme="expandable"), False),                                  # its defaults: never
    "expandable_bounded": (dict(scheme="expandable", release_on_miss="bounded"), False),   # release_bound 1.05
    "expandable_growth": (dict(scheme="expandable", release_on_miss="growth"), False),   # release_bound 1.05
    "expandable_until_churn": (dict(scheme="expandable", release_on_miss="until_churn"), False),
    "expandable_peak": (dict(scheme="expandable", release_on_miss="peak"), False),      # enable_torch()'s pool
    "expandable_bound_1.02": (dict(scheme="expandable", release_on_miss="bounded", release_bound=1.02), False),
    "expandable_bound_1.10": (dict(scheme="expandable", release_on_miss="bounded", release_bound=1.10), False),
    "expandable_high_water": (dict(scheme="expandable", release_on_miss="high_water"), False),   # the old default
    "expandable_idle0": (dict(scheme="expandable", release_on_miss="high_water", release_idle=0), False),
    "expandable_always": (dict(scheme="expandable", release_on_miss="always"), False),
    "expandable_never": (dict(scheme="expandable", release_on_miss="never"), False),
    "expandable_small_range": (dict(scheme="expandable"), True),
    "expandable_small_range_idle0": (dict(scheme="expandable", release_on_miss="high_water", release_idle=0), True),
}
# traces of the GPU test's loop (x, y, loss, grads of a step alive through the next; batch 32, CuPy path), recorded
# by scripts/record_numpy_traces.py: record_numpy_timeline(batch=32, block_sizes=(256,) * 10, cupy_path=True,
# keep_previous=True)
KEEP_TRACES = {"gpt_b32_keep_cupy_path_numpy": "memory_trace_cupy_path_b32_keep.csv.gz",
               "gpt_b32_perparam_keep_cupy_path_numpy": "memory_trace_cupy_path_b32_perparam_keep.csv.gz"}
DYN_TRACES = {f"dyn_{w}_h200": f"memory_trace_dyn_{w}.csv.gz" for w in (
    "cupy_mix", "torch_varlen", "gpt_varlen", "gpt_b4", "test_b4", "test_b32_perparam", "torch_fixed", "gpt_b32",
    "resnet_varres", "resnet_fixed")}
DYN_TRACES |= {f"dyn_{w}_s{s}_h200": f"memory_trace_dyn_{w}_s{s}.csv.gz"     # other realizations (seed s: Note
               for w in ("cupy_mix", "torch_varlen", "resnet_varres") for s in (1, 2, 3, 4)}   # [Trials are realizations])
SMALL = 1 << 20


def replay(tl: pd.DataFrame, settings: dict, small_range: bool) -> dict:
    pool = Pool(m.AddressSpaceBackend(), limit=0, debug=False, timeline=0, **settings)
    ev = m._replay_events(tl)
    if small_range:
        ev = ev.assign(stream=ev["stream"] * 2 + (ev["requested"] <= SMALL))
    calls = {}
    live, _ = m._drive(pool, ev, lambda step: calls.__setitem__(step, m._device_calls(pool)))
    c = m._counters(pool)
    steps = [s for s in calls if s is not None]
    dyn = "workload" in tl                  # a DYN_TRACES trace: its own warm-up and timed steps
    warmup = int(tl["warmup"].iloc[0]) if dyn else m.WARMUP_STEPS
    before = [s for s in steps if s < warmup]
    warm = steps[-1] >= warmup and before
    timed = int(tl["steps"].iloc[0]) if dyn else None
    live.clear()
    return dict(peak_bytes_requested=c["peak_bytes_requested"], peak_bytes_reserved=c["peak_bytes_reserved"],
                reserved_over_requested=c["peak_bytes_reserved"] / max(c["peak_bytes_requested"], 1),
                device_calls=c["device_mallocs"] + c["device_frees"],
                device_allocs_warm=calls[steps[-1]][0] - calls[before[-1]][0] if warm else float("nan"),
                device_frees_warm=calls[steps[-1]][1] - calls[before[-1]][1] if warm else float("nan"),
                warmup_steps=warmup, device_calls_per_timed_step=(
                    sum(calls[steps[-1]]) - sum(calls[before[-1]])) / timed if warm and timed else float("nan"))


def touched_pages(tl: pd.DataFrame, settings: dict) -> float:
    """The most 2 MiB pages that blocks in use touch at once, over the peak requested, with the blocks where
    `settings` puts them: what that placement holds if every other page were unmapped at once (no release rule
    of that placement can hold less)."""
    pool = Pool(m.AddressSpaceBackend(), limit=0, debug=False, timeline=4_000_000, **settings)
    live, _ = m._drive(pool, m._replay_events(tl))
    ev, page = pool.timeline(), 2 << 20
    refs, blocks, touched, most, req, most_req = {}, {}, 0, 0, 0, 0
    for kind, ptr, size, requested in ev[["event", "ptr", "size", "requested"]].itertuples(index=False):
        if kind in ("alloc_hit", "alloc_miss"):
            pages = range(ptr // page, (ptr + size - 1) // page + 1)
            for p in pages:
                refs[p] = refs.get(p, 0) + 1
                touched += refs[p] == 1
            blocks[ptr], req = (pages, requested), req + requested
            most, most_req = max(most, touched), max(most_req, req)
        elif kind == "free" and ptr in blocks:
            pages, requested = blocks.pop(ptr)
            req -= requested
            for p in pages:
                refs[p] -= 1
                touched -= refs[p] == 0
    live.clear()
    return most * page / max(most_req, 1)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "data" / "expandable_variants.csv"))
    a = p.parse_args(argv)
    traces = {**m.load_traces(), **{n: pd.read_csv(ROOT / "data" / f) for n, f in {**KEEP_TRACES, **DYN_TRACES}.items()}}
    rows = [dict(trace=name, variant=v, small_range=VARIANTS[v][1], **replay(tl, *VARIANTS[v]))
            for name, tl in traces.items() for v in VARIANTS]
    df = pd.DataFrame(rows).assign(page_bytes=2 << 20, **provenance())
    floor = {name: touched_pages(tl, VARIANTS["expandable_never"][0]) for name, tl in traces.items()}
    df["touched_pages_over_requested"] = df["trace"].map(floor)   # the "never" placement's floor, per trace
    df.to_csv(a.out, index=False)
    table = df.pivot(index="trace", columns="variant", values="reserved_over_requested")[list(VARIANTS)]
    with pd.option_context("display.width", 250):
        print(table.round(3).to_string())
    return 0


if __name__ == "__main__":
    sys.exit(main())
