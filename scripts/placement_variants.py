"""Where in a free range a block goes, and which free range: placements the expandable scheme could use under its
default release rule ("never"), replayed on every recorded trace (Note [Release on miss: expandable], "Placement").

A model of one stream's range, in Python: free ranges by address, the request rounded up to 512 B, a hit served from
a free range as the placement chooses, a miss grown at the top of the mapped part (under "never" nothing is unmapped,
so the mapped part has no holes and a miss maps from the last free range on), pages of 2 MiB. Its "best" placement
is xpool's (the least (size, address) that fits, cut from its low end); the script checks that it gives the real
pool's peaks on every trace before it believes the others. Per trace and placement: peak mapped / peak requested,
maps after the trace's warm-up, and the most pages blocks in use touch at once over the peak requested (what that
placement would hold if every other page were given back: no release rule can do better with it).

Placements: "best" (xpool's), "best_high" (cut from the high end), "first" (address-ordered first fit), "split_1mib"
(blocks of 1 MiB and more from the high end), "youngest_neighbour", "lifetime" (a guess per size), "small_range_1mib"
(blocks of at most 1 MiB in a range of their own, as PyTorch's small pool; best fit in each), "page_aligned" (blocks
of a page or more start on a page, the gap below left free, so a freed one leaves whole pages), and the two together.

    python scripts/placement_variants.py          (CPU, ~2 min: data/placement_variants.csv, a table)
"""
from __future__ import annotations

import argparse
import bisect
import pathlib
import sys

import pandas as pd

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xlab import memory_study as m  # noqa: E402
from xlab.provenance import provenance  # noqa: E402
from xpool import Pool  # noqa: E402

PAGE, ALIGN = 2 << 20, 512
LIFETIME_SHORT = 32       # "lifetime": a size whose blocks lived fewer requests than this (moving average) is short
SMALL = 1 << 20           # "small_range_1mib": blocks of at most this many bytes get a range of their own (PyTorch's
                          # small pool: kSmallSize); its addresses start at SMALL_BASE, far from the other range's
SMALL_BASE = 1 << 46


def _round(n: int) -> int:
    return max(ALIGN, -(-n // ALIGN) * ALIGN)


def _up(n: int, align: int) -> int:
    return -(-n // align) * align if align else n


class Range:
    """Free ranges [start, end) by address, merged; mapped bytes [0, top), pages grown at the top."""

    def __init__(self):
        self.starts, self.end, self.top, self.maps = [], {}, 0, 0

    def take(self, start):
        del self.starts[bisect.bisect_left(self.starts, start)]
        return self.end.pop(start)

    def put(self, start, end):
        i = bisect.bisect_left(self.starts, start)
        if i and self.end[self.starts[i - 1]] == start:
            start = self.starts[i - 1]
            self.take(start)
            i -= 1
        if i < len(self.starts) and self.starts[i] == end:
            end = self.take(end)
        self.starts.insert(i, start)
        self.end[start] = end

    def grow(self, size, align=0):
        """A miss: the block at the last free range when it reaches the top, else at the top (at the next multiple of
        `align` there, what lies below it left free); pages mapped to hold it."""
        self.maps += 1
        last = self.starts[-1] if self.starts and self.end[self.starts[-1]] == self.top else None
        start = self.top if last is None else last
        if last is not None:
            self.take(last)
        if _up(start, align) > start:
            self.put(start, _up(start, align))
            start = _up(start, align)
        top = -(-(start + size) // PAGE) * PAGE
        if start + size < top:
            self.put(start + size, top)
        self.top = top
        return start


class Model:
    """One placement over a Range (two for "small_range_*": small blocks in one, the rest in the other):
    alloc(size, tick) -> address; free(address)."""

    def __init__(self, placement: str):
        self.placement, self.r = placement, Range()
        self.small = Range() if placement.startswith("small_range") else None
        self.born, self.by_end, self.life, self.size = {}, {}, {}, {}

    @property
    def maps(self) -> int:
        return self.r.maps + (self.small.maps if self.small else 0)

    @property
    def top(self) -> int:
        """Mapped bytes: both ranges' pages."""
        return self.r.top + (self.small.top if self.small else 0)

    def alloc(self, size, tick):
        p = self.placement
        if self.small is not None and size <= SMALL:
            start = SMALL_BASE + self._place(self.small, size, "best", 0)
        else:
            align = PAGE if p in ("page_aligned", "small_range_page_aligned") and size >= PAGE else 0
            start = self._place(self.r, size, p, align)
        self.born[start], self.by_end[start + size], self.size[start] = tick, start, size
        return start

    def _place(self, r, size, p, align):
        """The block's address in range r."""
        fits = [(r.end[s] - s, s) for s in r.starts if _up(s, align) + size <= r.end[s]]
        if not fits:
            start = r.grow(size, align)
        else:
            length, start = min(fits, key=lambda c: c[1]) if p == "first" else min(fits)
            end = start + length
            high = {"best": False, "first": False, "best_high": True,
                    "split_1mib": size >= 1 << 20,
                    "youngest_neighbour": self._younger_above(start, end),
                    "lifetime": self.life.get(size, LIFETIME_SHORT) < LIFETIME_SHORT,
                    "page_aligned": False, "small_range_1mib": False, "small_range_page_aligned": False}[p]
            r.take(start)
            if _up(start, align) > start:             # a page-aligned block: what lies below it stays free
                r.put(start, _up(start, align))
                start = _up(start, align)
            if high:
                start = end - size
                if start > end - length:
                    r.put(end - length, start)
            elif start + size < end:
                r.put(start + size, end)
        return start

    def _younger_above(self, start, end):
        """Whether the block just above the free range [start, end) is in use and younger than the one below."""
        above, below = self.born.get(end), self.by_end.get(start)
        return above is not None and (below is None or above > self.born[below])

    def free(self, start, tick):
        size = self.size.pop(start)
        lived = tick - self.born.pop(start)
        del self.by_end[start + size]
        old = self.life.get(size)
        self.life[size] = lived if old is None else 0.75 * old + 0.25 * lived
        if start >= SMALL_BASE:
            self.small.put(start - SMALL_BASE, start - SMALL_BASE + size)
        else:
            self.r.put(start, start + size)


PLACEMENTS = ("best", "best_high", "first", "split_1mib", "youngest_neighbour", "lifetime",
              "small_range_1mib", "page_aligned", "small_range_page_aligned")


def model_replay(tl: pd.DataFrame, placement: str) -> dict:
    ev = tl[tl["event"].isin(m.ALLOC_EVENTS + ("free",))]
    steps = ev["step"] if "step" in ev else pd.Series(0, index=ev.index)
    warmup = int(tl["warmup"].iloc[0]) if "warmup" in tl else m.WARMUP_STEPS
    model, live, refs = Model(placement), {}, {}
    requested = peak = peak_top = touched = most_touched = 0
    maps_before, tick = None, 0                      # tick: requests so far (the lifetimes' clock)
    for kind, ptr, n, step in zip(ev["event"], ev["ptr"], ev["requested"], steps):
        if maps_before is None and step >= warmup:
            maps_before = model.maps
        if kind == "free":
            if ptr not in live:
                continue
            start, size, n = live.pop(ptr)
            requested -= n
            model.free(start, tick)
            delta = -1
        else:
            tick += 1
            size = _round(int(n))
            start = model.alloc(size, tick)
            live[ptr] = (start, size, n)
            requested += n
            peak, peak_top = max(peak, requested), max(peak_top, model.top)
            delta = 1
        for page in range(start // PAGE, (start + size - 1) // PAGE + 1):
            refs[page] = refs.get(page, 0) + delta
            touched += (delta > 0 and refs[page] == 1) - (delta < 0 and refs[page] == 0)
        most_touched = max(most_touched, touched)
    return dict(peak_bytes_requested=peak, peak_bytes_mapped=peak_top, reserved_over_requested=peak_top / max(peak, 1),
                maps_after_warmup=model.maps - (model.maps if maps_before is None else maps_before),
                touched_pages_over_requested=most_touched * PAGE / max(peak, 1), warmup_steps=warmup)


def peak_blocks(tl: pd.DataFrame) -> list[int]:
    """The requested sizes of the blocks in use at the trace's peak of bytes requested (its first moment there)."""
    ev = tl[tl["event"].isin(m.ALLOC_EVENTS + ("free",))]
    live, requested, peak, at_peak = {}, 0, -1, []
    for kind, ptr, n in zip(ev["event"], ev["ptr"], ev["requested"]):
        if kind == "free":
            requested -= live.pop(ptr, 0)
            continue
        live[ptr] = int(n)
        requested += int(n)
        if requested > peak:
            peak, at_peak = requested, list(live.values())
    return at_peak


def pool_peak(tl: pd.DataFrame) -> int:
    """The real pool's peak reserved on the trace (scheme expandable, "never", 2 MiB pages, the host twin)."""
    pool = Pool(m.AddressSpaceBackend(), limit=0, debug=False, timeline=0, scheme="expandable",
                release_on_miss="never")
    live, _ = m._drive(pool, m._replay_events(tl))
    live.clear()
    return m._counters(pool)["peak_bytes_reserved"]


def traces() -> dict:
    names = sorted(p.name for p in (ROOT / "data").glob("memory_trace_*.csv.gz"))
    return {n.removeprefix("memory_trace_").removesuffix(".csv.gz"): pd.read_csv(ROOT / "data" / n) for n in names}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "data" / "placement_variants.csv"))
    a = p.parse_args(argv)
    rows = []
    for name, tl in traces().items():
        real = pool_peak(tl)
        for placement in PLACEMENTS:
            r = model_replay(tl, placement)
            if placement == "best" and r["peak_bytes_mapped"] != real:
                raise SystemExit(f"{name}: the model's best fit maps {r['peak_bytes_mapped']} B at its peak, the pool "
                                 f"{real} B: the model is not the pool, so its other placements prove nothing")
            rows.append(dict(trace=name, placement=placement, pool_peak_bytes_reserved=real, **r))
    df = pd.DataFrame(rows).assign(page_bytes=PAGE, release_on_miss="never", **provenance())
    df.to_csv(a.out, index=False)
    with pd.option_context("display.width", 250):
        for col in ("reserved_over_requested", "maps_after_warmup", "touched_pages_over_requested"):
            print(col)
            print(df.pivot(index="trace", columns="placement", values=col)[list(PLACEMENTS)].round(3).to_string())
    return 0


if __name__ == "__main__":
    sys.exit(main())
