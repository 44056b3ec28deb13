"""Replay study, not landed: would a hidden buffer of mapped pages stop the steady-state maps? (#22; NOTES.md, Note
[Expandable segments], "A hidden buffer").

Map slack (`scripts/map_slack_replay.py`) moved the layout of every later miss, because its pages became free space
that best fit placed blocks in. This asks what a buffer that changes no placement would do: on a miss that maps, the
pool would also map the next `K` pages past the run it mapped (as far as the pages there are unmapped, and only while
its committed bytes stay within `release_bound` (1.05) times the most bytes requested so far), but keep them out of
the free tree: placement plans as if they were unmapped, so every block lands where it lands today. A later plan
whose pages all lie in the buffer takes them without a device call; one reaching outside it maps (a call) and
refills the buffer past its own run. Since placement is unchanged, the plain replay's map and unmap events (the
pool over the host twin, 2 MiB pages, release rule "peak" (enable_torch()'s) or "never") say everything: this
script walks them with the buffer beside them and counts the calls left and the pages held (mapped + buffer).
Unmaps are the rule's own, taken as they come (the rules would judge committed bytes without the buffer). K = 0 is
the plain replay (checked against `replay_rule` on every row).

    python scripts/hidden_buffer_replay.py --out data/hidden_buffer_replay.csv
"""
from __future__ import annotations

from xlab import memory_study as ms
from xlab.bench.dynamic import steady_state

AHEAD = (0, 2, 4, 8, 16)     # pages of buffer
RULES = ("peak", "never")
BOUND = 1.05                 # the default release_bound: the buffer never takes committed bytes past it


def with_buffer(tl, plain: dict, ahead: int, page: int = ms.DYN_PAGE) -> dict:
    """The plain replay's maps and unmaps (`replay_rule(..., events=True)`) walked with a buffer of `ahead` pages:
    steady calls, calls in all and peak pages held (mapped + buffer)."""
    events = plain["timeline"]
    probes = {s: (mp + un, p) for s, (mp, un, p) in plain["probes"].items()}   # maps + unmaps so far, peak requested
    mapped, buffer = set(), set()
    most = calls = held = seen = 0
    ends = sorted((c, s) for s, (c, _) in probes.items() if s is not None)   # calls so far at each step's end
    at_step, i = {}, 0
    for ev in events.itertuples(index=False):
        if ev.event in ("alloc_hit", "alloc_miss"):
            most = max(most, int(ev.bytes_in_use))
            continue
        if ev.event not in ("map", "unmap"):
            continue
        seen += 1
        while i < len(ends) and ends[i][0] < seen:        # the steps that ended before this call
            at_step[ends[i][1]] = calls
            i += 1
        pages = set(range(int(ev.ptr) // page, (int(ev.ptr) + int(ev.size)) // page))
        if ev.event == "unmap":
            calls += 1
            mapped -= pages
            continue
        missed = not pages <= buffer
        buffer -= pages
        mapped |= pages
        if missed:
            calls += 1
            room = int(BOUND * max(most, int(ev.bytes_in_use))) // page - len(mapped) - len(buffer)
            nxt = max(pages) + 1
            while ahead and room > 0 and nxt not in mapped and nxt not in buffer and len(buffer) < ahead:
                buffer.add(nxt)
                nxt, room = nxt + 1, room - 1
        held = max(held, len(mapped) + len(buffer))
    for _, s in ends[i:]:
        at_step[s] = calls
    warmup, steps = int(tl["warmup"].iloc[0]), int(tl["steps"].iloc[0])
    st = steady_state([(at_step[k], probes[k][1]) for k in range(warmup + steps)], warmup)
    return dict(steady_calls=st["device_calls_steady"], device_calls=calls, peak_bytes_held=held * page)


def rows(name: str) -> list[dict]:
    tl, out = ms.dyn_trace(name), []
    for rule in RULES:
        plain = ms.replay_rule(tl, rule, events=True)
        for ahead in AHEAD:
            r = with_buffer(tl, plain, ahead)
            requested = plain["peak_bytes_requested"]
            if ahead == 0:      # the walk without a buffer is the plain replay
                assert r["steady_calls"] == plain["steady_calls"]
                assert r["peak_bytes_held"] == plain["peak_bytes_reserved"]
            out.append(dict(trace=name, rule=rule, buffer_pages=ahead, peak_bytes_requested=requested,
                            peak_bytes_held=r["peak_bytes_held"], held_over_requested=r["peak_bytes_held"] / requested,
                            steady_calls=r["steady_calls"], device_calls=r["device_calls"], page_bytes=ms.DYN_PAGE,
                            release_bound=BOUND))
        print(name, rule, [(x["buffer_pages"], x["steady_calls"], round(x["held_over_requested"], 4))
                           for x in out if x["rule"] == rule], flush=True)
    return out


def main(argv=None) -> int:
    return ms.trace_study(__doc__, rows, "hidden_buffer_replay", "build/hidden_buffer_replay.csv", argv)


if __name__ == "__main__":
    raise SystemExit(main())
