"""The expandable scheme's choices, replayed on every recorded trace (Note [Expandable segments]): its release rule
(release_on_miss "never", the default, / "high_water" with release_idle 64 or 0 / "always") and small blocks (up to 1 MiB) in a range of their own per
stream, as PyTorch keeps a small and a large pool, against scheme segments.  Pages of 2 MiB (an H200's) over the
host twin; the small-block range is modelled by giving small requests a stream key of their own.  Besides the lab's
traces, the keep-previous-step traces (KEEP_TRACES: the loop rebinds x, y, loss and grads; Note [Release on miss:
expandable]).

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
    "expandable": (dict(scheme="expandable"), False),
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
    before = [s for s in steps if s < m.WARMUP_STEPS]
    warm = steps[-1] >= m.WARMUP_STEPS and before
    live.clear()
    return dict(peak_bytes_requested=c["peak_bytes_requested"], peak_bytes_reserved=c["peak_bytes_reserved"],
                reserved_over_requested=c["peak_bytes_reserved"] / max(c["peak_bytes_requested"], 1),
                device_calls=c["device_mallocs"],
                device_allocs_warm=calls[steps[-1]][0] - calls[before[-1]][0] if warm else float("nan"),
                device_frees_warm=calls[steps[-1]][1] - calls[before[-1]][1] if warm else float("nan"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "data" / "expandable_variants.csv"))
    a = p.parse_args(argv)
    traces = {**m.load_traces(), **{n: pd.read_csv(ROOT / "data" / f) for n, f in KEEP_TRACES.items()}}
    rows = [dict(trace=name, variant=v, small_range=VARIANTS[v][1], **replay(tl, *VARIANTS[v]))
            for name, tl in traces.items() for v in VARIANTS]
    df = pd.DataFrame(rows).assign(page_bytes=2 << 20, warmup_steps=m.WARMUP_STEPS, **provenance())
    df.to_csv(a.out, index=False)
    table = df.pivot(index="trace", columns="variant", values="reserved_over_requested")[list(VARIANTS)]
    with pd.option_context("display.width", 250):
        print(table.round(3).to_string())
    return 0


if __name__ == "__main__":
    sys.exit(main())
