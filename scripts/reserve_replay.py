"""Replay: does mapping a reserve up front stop the steady-state maps of fragmentation? (#22; NOTES.md, Note
[Expandable segments], "A reserve up front").

The recipe, `pool.reserve(R)` before the program's first step: the pool allocates one block of R bytes less those in
use on the program's stream and frees it (scheme expandable maps it as one run of pages, which stays mapped as a
free block), then resets the peaks and the release rules' history (`reset_peak_stats(history=True)`), so neither
the gauges nor the release rules remember that request. R is a multiple `frac` of the program's peak requested
bytes, as a dry run of the program reports it (`pool.stats()["peak_bytes_requested"]`). Every trace of
`xlab.memory_study.DYN_TRACES` and `HELD_OUT_TRACES` is replayed over the host twin (2 MiB pages) under release
rules "peak" (enable_torch()'s) and "never" (the scheme's CuPy default), frac 0 (no reserve: the plain replay, equal
to the GPU's runs) and 1.02-1.05, the reserve made before anything (`when` "start") or after the program's build
(`when` "build": `xlab.memory_study.build_events`, the model's parameters in use). Or with no dry run: after the
first step (`when` "step1"; the largest shape comes first) or after the warm-up (`when` "warmup"), `frac` times the
peak requested so far (`reserve_bytes` is then that run's). One row per (trace, rule, frac, when): peak reserved over
peak requested (the program's, over the whole run: the reserve's request is forgotten), device calls in the
benchmark's steady state, maps and unmaps in all.

    python scripts/reserve_replay.py --out data/reserve_replay.csv
"""
from __future__ import annotations

from xlab import memory_study as ms

FRACS = (0.0, 1.02, 1.03, 1.04, 1.05)
RULES = ("peak", "never")


def rows(name: str) -> list[dict]:
    """The trace's rows: each rule, each frac (0: the plain replay)."""
    tl, out = ms.dyn_trace(name), []
    places = dict(start=0, build=ms.build_events(tl), step1=ms.events_before_step(tl, 1),
                  warmup=ms.events_before_step(tl, int(tl["warmup"].iloc[0])))
    pages = lambda n: int(n) // ms.DYN_PAGE * ms.DYN_PAGE    # noqa: E731
    for rule in RULES:
        plain = ms.replay_rule(tl, rule)
        peak = plain["peak_bytes_requested"]
        for frac in FRACS:
            for when, after in places.items() if frac else (("", 0),):
                # with no dry run (step1, warmup): the peak requested so far
                reserve = pages(frac * peak) if when in ("start", "build") else \
                    (lambda s, frac=frac: pages(frac * s["peak_bytes_requested"]))
                r = ms.replay_rule(tl, rule, reserve, after) if frac else plain
                assert r["peak_bytes_requested"] == peak          # the reserve's request is forgotten
                out.append(dict(trace=name, rule=rule, frac=frac, when=when, reserve_bytes=r["reserve_bytes"],
                                after_events=after, peak_bytes_requested=peak,
                                peak_bytes_reserved=r["peak_bytes_reserved"], reserved_over_requested=r["ratio"],
                                steady_calls=r["steady_calls"], steady_steps=r["steady_steps"],
                                device_calls=r["device_calls"], page_bytes=ms.DYN_PAGE))
                print(f"{name:24s} {rule:6s} {frac:4.2f} {when:5s} {r['ratio']:.4f} {r['steady_calls']}", flush=True)
    return out


def main(argv=None) -> int:
    return ms.trace_study(__doc__, rows, "reserve_replay", "build/reserve_replay.csv", argv)


if __name__ == "__main__":
    raise SystemExit(main())
