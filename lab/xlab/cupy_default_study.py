"""Which scheme CuPy's pool should default to (issue #49): every recorded trace of a CuPy program replayed through each
candidate, beside the best CuPy peer the GPU measured on the same realization.

A program's requests do not depend on the allocator, so a trace's allocs and frees, in order, through a pool over a
backend that touches no memory (memory_study.AddressSpaceBackend over the host twin, 2 MiB pages for scheme
expandable) give the pool's peaks and device calls exactly (the replays equal the GPU's runs to the byte and the
call: tests/lab/test_replays.py). The candidates:

- segments: today's CuPy default (xpool.settings.DEFAULTS), its one release rule;
- expandable: scheme expandable, its one rule: the default where the driver has virtual memory management, as
  xpool.enable_torch() already makes it;
- cupy_pool_model: CuPy's MemoryPool, modelled (memory_study.CupyPoolModel): a peer the replays can check.

The other peers (MemoryAsyncPool, RMM's pool, PyTorch's expandable segments serving CuPy) have no model here: their
ratios come from the GPU's run of the same workload and seed (`data/dynamic_shapes.csv`, one row per trial, trial t on
seed t), as measured_best_peer and measured_best_peer_ratio, and the GPU's own ratio for the candidate's arm beside
it (measured_arm_ratio: the replay's check). `scale` > 1 replays a benchmark trace with every request that many times
larger: cupy_mix at scale s requests s times scale 1's from the same draws (Note [cupy_mix at scale] in
xlab.bench.dynamic_workloads), to within the rounding of sizes and cuFFT's work areas, so those rows are a model of
the scaled run (`exact` False), checked against `data/dynamic_scale.csv` (measured_* at that scale).

One row per (trace, scale, candidate): peak reserved / peak requested, device calls (mallocs + frees, or maps +
unmaps) in all and after the warm-up, steady-state calls (xlab.bench.dynamic.steady_state), with the trace's and
the run's provenance.

    python -m xlab.cupy_default_study                  # CPU, ~2 min: data/cupy_default_replays.csv and its summary
    python -m xlab.cupy_default_study --summary        # the summary of the CSV, replaying nothing
"""
from __future__ import annotations

import argparse
import math
import pathlib

import pandas as pd

from xlab import memory_study as ms
from xlab import rule_study
from xlab.bench.dynamic import steady_state
from xlab.paths import data_dir, publish
from xlab.provenance import provenance
from xpool.pool import Pool

CANDIDATES = ("segments", "expandable", "cupy_pool_model")
ARM = {"segments": "xpool_segments", "expandable": "xpool_expandable", "cupy_pool_model": "cupy_pool"}
PEERS = ("cupy_pool", "cupy_async", "rmm_pool", "cupy_torch_expandable")   # the CuPy peers of issue #49
# The recorded traces of CuPy programs (the PyTorch front end's default is decision 0003's): the dynamic benchmark's
# CuPy workloads with their realizations, the GPU test's loops, and the CPU's recordings of the GPT's requests.
DYN = ("cupy_mix", *(f"cupy_mix_s{s}" for s in range(1, 5)), "gpt_varlen", *(f"gpt_varlen_s{s}" for s in range(1, 5)),
       "gpt_b4", "gpt_b32", "test_b4", "test_b32_perparam")
TRACES = (*DYN, *(n for n in rule_study.FILE_TRACES if n != "gpt_b32_gpu"))
SCALES = {"cupy_mix": 216}       # trace workload -> the scale dynamic_scale runs it at (its SCALED specs)
DEFAULT_OUT = "data/cupy_default_replays.csv"
COLUMNS = ["trace", "workload", "realization", "fixed_shape", "scale", "exact", "candidate", "peak_bytes_requested",
           "peak_bytes_reserved", "reserved_over_requested", "device_calls", "device_calls_after_warmup",
           "steady_calls", "steady_steps", "demand_peak_step", "unmatched_frees", "events", "warmup", "steps",
           "measured_best_peer", "measured_best_peer_ratio", "measured_arm_ratio", "measured_commit",
           "trace_recorded_on", "trace_commit", "trace_date"]


def make_pool(candidate: str):
    """A fresh pool of a candidate over a backend that touches no memory (or CuPy's model)."""
    if candidate == "cupy_pool_model":
        return ms.CupyPoolModel()
    if candidate not in CANDIDATES:
        raise ValueError(f"candidate must be one of {', '.join(CANDIDATES)}, got {candidate!r}")
    return Pool(ms.AddressSpaceBackend(), scheme=candidate, limit=0, debug=False, timeline=0)


def replay(tl: pd.DataFrame, candidate: str, warmup: int, steps: int, scale: int = 1) -> dict:
    """One trace (requests times `scale`) through a fresh `candidate`, probed after every step: its peaks, device calls
    in all, from the end of the last warm-up step on (device_calls_after_warmup) and in the steady state (steady_calls
    over steady_steps: after the demand's last new high, xlab.bench.dynamic.steady_state)."""
    if isinstance(scale, bool) or not isinstance(scale, int) or scale < 1:
        raise ValueError(f"scale must be a whole number >= 1, got {scale!r}")
    events = ms._replay_events(tl)
    if scale > 1:
        events = events.assign(requested=events["requested"] * scale)
    pool, probes = make_pool(candidate), {}

    def probe(step):
        c = ms._counters(pool)
        probes[step] = (c["device_mallocs"] + c["device_frees"], c["peak_bytes_requested"])

    live, unmatched = ms._drive(pool, ms._rows(events), probe)
    c = ms._counters(pool)
    live.clear()
    per_step = [probes[k] for k in range(warmup + steps) if k in probes]
    steady = steady_state(per_step, warmup) if len(per_step) == warmup + steps else steady_state([], warmup)
    last = probes[max(k for k in probes if k is not None)][0]
    return dict(peak_bytes_requested=c["peak_bytes_requested"], peak_bytes_reserved=c["peak_bytes_reserved"],
                reserved_over_requested=c["peak_bytes_reserved"] / max(c["peak_bytes_requested"], 1),
                device_calls=c["device_mallocs"] + c["device_frees"],
                device_calls_after_warmup=last - probes[warmup - 1][0] if warmup - 1 in probes else math.nan,
                steady_calls=steady["device_calls_steady"], steady_steps=steady["steady_steps"],
                demand_peak_step=steady["demand_peak_step"], unmatched_frees=unmatched, events=len(events))


def measured(workload: str, seed: int, scale: int, data=None) -> dict:
    """The GPU's run of `workload` on `seed` at `scale` (dynamic_shapes.csv at 1, dynamic_scale.csv above): {arm:
    reserved / requested} of the newest commit that ran it ({} where none did)."""
    folder = pathlib.Path(data or data_dir())
    path = folder / ("dynamic_shapes.csv" if scale == 1 else "dynamic_scale.csv")
    if not path.is_file():
        return {}
    df = _read(path)
    df = df[(df["workload"] == workload) & (df["seed"] == seed)]
    if scale > 1 and "scale" in df:
        df = df[df["scale"] == scale]
    if df.empty:
        return {}
    newest = df.sort_values("date")["commit"].iloc[-1]
    df = df[df["commit"] == newest]
    return {"commit": newest, **df.groupby("allocator")["reserved_over_requested"].median().to_dict()}


_CSV = {}


def _read(path) -> pd.DataFrame:
    if path not in _CSV:
        _CSV[path] = pd.read_csv(path)
    return _CSV[path]


def trace_rows(name: str, candidates=CANDIDATES, data=None) -> list:
    """The rows of one trace: each candidate at scale 1, and at the scale dynamic_scale runs its workload at."""
    tl = rule_study.load_trace(name, data)
    info = rule_study.trace_info(name, tl)
    first = tl.iloc[0]
    trace = dict(trace_recorded_on=first.get("gpu", "unknown"), trace_commit=first.get("commit", "unknown"),
                 trace_date=first.get("date", "unknown"))
    rows = []
    for scale in (1, *([SCALES[info["workload"]]] if info["workload"] in SCALES else ())):
        gpu = measured(info["workload"], info["seed"], scale, data) if name in DYN else {}
        peers = {p: gpu[p] for p in PEERS if p in gpu and not math.isnan(gpu[p])}
        best = min(peers, key=peers.get) if peers else None
        for cand in candidates:
            r = replay(tl, cand, info["warmup"], info["steps"], scale)
            rows.append(dict(trace=name, workload=info["workload"], realization=info["seed"],
                             fixed_shape=info["fixed_shape"], scale=scale, exact=scale == 1, candidate=cand,
                             warmup=info["warmup"], steps=info["steps"], **r, measured_best_peer=best,
                             measured_best_peer_ratio=peers.get(best, math.nan),
                             measured_arm_ratio=gpu.get(ARM[cand], math.nan), measured_commit=gpu.get("commit"),
                             **trace))
    return rows


def study(names=TRACES, candidates=CANDIDATES, data=None) -> pd.DataFrame:
    """Every trace of `names` through every candidate: COLUMNS with the run's provenance."""
    rows = [r for name in names for r in trace_rows(name, candidates, data)]
    return pd.DataFrame(rows, columns=COLUMNS).assign(**provenance(experiment="cupy_default_replays"))


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per (workload, scale, candidate): the realizations replayed, the median and max of reserved / requested, and,
    where the GPU measured the peers on the same realizations, in how many the candidate held no more than the best
    peer (`at_most_best_peer` of `with_peer`), and its steady-state calls in all."""
    out = []
    for (w, scale, cand), g in df.groupby(["workload", "scale", "candidate"], sort=False):
        peer = g.dropna(subset=["measured_best_peer_ratio"])
        out.append(dict(workload=w, scale=scale, candidate=cand, realizations=len(g),
                        median=g["reserved_over_requested"].median(), max=g["reserved_over_requested"].max(),
                        with_peer=len(peer),
                        at_most_best_peer=int((peer["reserved_over_requested"]
                                               <= peer["measured_best_peer_ratio"]).sum()),
                        best_peer_median=peer["measured_best_peer_ratio"].median() if len(peer) else math.nan,
                        steady_calls=g["steady_calls"].sum(min_count=1),
                        calls_after_warmup=g["device_calls_after_warmup"].sum(min_count=1)))
    return pd.DataFrame(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=DEFAULT_OUT, help=f"CSV to write (default: {DEFAULT_OUT})")
    p.add_argument("--traces", help=f"comma-separated trace names (default: all {len(TRACES)})")
    p.add_argument("--summary", action="store_true", help="summarise the CSV at --out; replay nothing")
    a = p.parse_args(argv)
    if a.summary:
        df = pd.read_csv(a.out)
    else:
        names = a.traces.split(",") if a.traces else TRACES
        bad = [n for n in names if n not in TRACES]
        if bad:
            p.error(f"unknown trace(s) {', '.join(bad)}; known: {', '.join(TRACES)}")
        df = publish(study(names), a.out)
    with pd.option_context("display.width", 200, "display.max_columns", 30, "display.float_format", "{:.4g}".format):
        print(summary(df).to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
