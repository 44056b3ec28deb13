"""Which scheme CuPy's pool should default to (issue #49): every recorded trace of a CuPy program replayed through each
candidate, beside the best CuPy peer the GPU measured on the same realization.

A program's requests do not depend on the allocator, so a trace's allocs and frees, in order, through a pool over a
backend that touches no memory (memory_study.AddressSpaceBackend over the host twin, 2 MiB pages for scheme
expandable) give the pool's peaks and device calls exactly (the replays equal the GPU's runs to the byte and the
call: tests/lab/test_replays.py). The candidates:

- segments: today's CuPy default (xpool.settings.DEFAULTS), its one release rule;
- expandable: scheme expandable, its one rule: the default where the driver has virtual memory management, as
  xpool.enable_torch() already makes it;
- cupy_pool_model: CuPy's MemoryPool, modelled (memory_study.CupyPoolModel): a peer the replays can check;
- expandable_split_1mib: what the product does not have, a model (RangeModel, the placement study's at 1382086):
  scheme expandable's one range and rule, but a block of 1 MiB or more cut from the high end of its best-fit free
  range (`placement_variants.csv`'s split_1mib), so long-lived small blocks and short-lived large ones part. The same
  model with the product's placement (cut from the low end) gives the product's peaks and calls
  (tests/lab/test_cupy_default_study.py);
- torch_expandable_model: PyTorch's expandable segments, modelled (xlab.torch_expandable_model: its small pool of
  2 MiB pages for requests of 1 MiB or less, 20 MiB pages for the rest, the free block at the top of the mapped part
  taken last): a peer, its replays equal to the byte to the GPU's peaks of that arm (cupy_torch_expandable) on
  every trace where both exist (tests/lab/test_torch_expandable_model.py), so it stands in for the peer where the
  GPU has not measured it.

`--variants` replays scheme expandable's variants (xlab.torch_expandable_model.VARIANTS: the product with one of
PyTorch's rules added at a time) into their own CSV (`data/cupy_default_variants.csv`, VARIANTS_OUT), beside the
product and the PyTorch model, so the default CSV keeps the candidates alone.

The other peers (MemoryAsyncPool, RMM's pool, PyTorch's expandable segments serving CuPy) are measured: their
ratios come from the GPU's run of the same workload and seed (`data/dynamic_shapes.csv`, one row per trial, trial t on
seed t; `data/dynamic_scale.csv` at scale), as measured_best_peer and measured_best_peer_ratio, with the GPU's own
ratio for the candidate's arm beside it (measured_arm_ratio: the replay's check where both are of one rule).

Two columns say how far a row is the run's: `requests` (gpu: recorded on the H200; plan: cupy_fill's, its plan, the
GPU's requests exactly; numpy: NumPy's and SciPy's on the CPU, cupy_image's stand-in; scaled: cupy_mix's trace at
dynamic_scale's factor, every request that many times larger from the same draws, to within the rounding of sizes
and cuFFT's work areas: Note [cupy_mix at scale] in xlab.bench.dynamic_workloads) and `pool` (exact: the product's
expandable over the twin, equal to the GPU's runs to the byte and the call, tests/lab/test_replays.py; model: the
others: segments' best fit breaks ties by host addresses, not cudaMalloc's; CuPy's pool and the placement, models).
A scaled row replays the trace's first warm-up + steps of dynamic_scale's run (SCALED).

One row per (trace, scale, candidate): peak reserved / peak requested, device calls (mallocs + frees, or maps +
unmaps) in all and after the warm-up, steady-state calls (xlab.bench.dynamic.steady_state), with the trace's and
the run's provenance.

    python -m xlab.cupy_default_study                  # CPU, ~15 s: data/cupy_default_replays.csv and its summary
    python -m xlab.cupy_default_study --summary        # the summary of the CSV, replaying nothing
    python -m xlab.cupy_default_study --variants       # CPU, ~30 s: data/cupy_default_variants.csv and its summary
"""
from __future__ import annotations

import argparse
import bisect
import math
import pathlib

import pandas as pd

from xlab import memory_study as ms
from xlab import rule_study
from xlab import torch_expandable_model as tem
from xlab.bench.dynamic import steady_state
from xlab.paths import data_dir, publish
from xlab.provenance import provenance
from xpool.pool import Pool

CANDIDATES = ("segments", "expandable", "cupy_pool_model", "expandable_split_1mib", "torch_expandable_model")
ARM = {"segments": "xpool_segments", "expandable": "xpool_expandable", "cupy_pool_model": "cupy_pool",
       "torch_expandable_model": "cupy_torch_expandable"}
# --variants: scheme expandable's variants (xlab.torch_expandable_model.VARIANTS), beside the product and PyTorch's
VARIANTS = ("expandable", *tem.VARIANTS, "torch_expandable_model", "cupy_pool_model")
MODEL_PEERS = ("cupy_pool_model", "torch_expandable_model")    # the peers the replays model, for workloads without
#                                                                the GPU's (MemoryAsyncPool and RMM have no model)
VARIANTS_OUT = "data/cupy_default_variants.csv"
PAGE, ALIGN = ms.DYN_PAGE, 512
PEERS = ("cupy_pool", "cupy_async", "rmm_pool", "cupy_torch_expandable")   # the CuPy peers of issue #49
# The recorded traces of CuPy programs (the PyTorch front end's default is decision 0003's): the dynamic benchmark's
# CuPy workloads with their realizations, the GPU test's loops, and the CPU's recordings of the GPT's requests.
DYN = ("cupy_mix", *(f"cupy_mix_s{s}" for s in range(1, 5)), "gpt_varlen", *(f"gpt_varlen_s{s}" for s in range(1, 5)),
       "gpt_b4", "gpt_b32", "test_b4", "test_b32_perparam")
# cupy_fill's and cupy_image's traces made without a GPU (python -m xlab.bench.dynamic_traces --host): cupy_fill's
# its plan (the GPU's requests exactly), cupy_image's NumPy's and SciPy's (a stand-in: no cuFFT work area, no
# temporary of CuPy's own)
HOST = {f"host_{w}{f'_s{k}' if k else ''}": f"memory_trace_host_dyn_{w}{f'_s{k}' if k else ''}.csv.gz"
        for w in ("cupy_fill", "cupy_image") for k in range(5)}
TRACES = (*DYN, *HOST, *(n for n in rule_study.FILE_TRACES if n != "gpt_b32_gpu"))
# the GPU's traces of #49's workloads, replayed where `python -m xlab.bench.dynamic_traces --workloads
# cupy_image,cupy_fill --seeds 0,1,2,3,4` has put them in data/ (memory_trace_dyn_<name>.csv.gz), the GPU's peers
# beside them from dynamic_shapes.csv as for DYN
AWAITED = tuple(f"{w}{f'_s{k}' if k else ''}" for w in ("cupy_image", "cupy_fill") for k in range(5))


def traces(data=None) -> tuple:
    """TRACES, and those of AWAITED recorded in `data` (default: the repository's data/), each in place of its host
    stand-in (HOST's `host_<name>`): a realization is replayed once, from the best trace of it there is."""
    folder = pathlib.Path(data or data_dir())
    gpu = tuple(n for n in AWAITED if (folder / f"memory_trace_dyn_{n}.csv.gz").is_file())
    return tuple(t for t in TRACES if t.removeprefix("host_") not in gpu) + gpu
# trace workload -> its scaled run (xlab.bench.dynamic_scale.SCALED: factor, warm-up, steps); cupy_fill's scaled
# requests are its plan's times the factor (exact), cupy_mix's to within rounding and cuFFT's work areas (a model)
SCALES = ("cupy_mix", "cupy_fill")
EXACT_AT_SCALE = ("cupy_fill",)
DEFAULT_OUT = "data/cupy_default_replays.csv"
COLUMNS = ["trace", "workload", "realization", "fixed_shape", "scale", "requests", "pool", "candidate",
           "peak_bytes_requested", "peak_bytes_reserved", "reserved_over_requested", "device_calls",
           "device_calls_after_warmup",
           "steady_calls", "steady_steps", "demand_peak_step", "unmatched_frees", "events", "warmup", "steps",
           "measured_best_peer", "measured_best_peer_ratio", "measured_arm_ratio", "measured_commit",
           "trace_recorded_on", "trace_commit", "trace_date"]


class RangeModel(ms.CupyPoolModel):
    """Scheme expandable's one range per stream under its rule (nothing unmapped), in Python: free ranges by address,
    merged; a request rounded up to 512 B; a hit the least (size, address) free range that fits, the block cut from
    its low end (`high_from` None: the product's placement) or, for blocks of `high_from` bytes or more, from its
    high end; a miss maps 2 MiB pages at the top of the mapped part, from the last free range on where that reaches
    the top (one map a miss). A CupyPoolModel by its interface alone (what memory_study._drive and _counters
    read of a model), none of its behaviour."""

    def __init__(self, high_from: int | None = 1 << 20):
        self.high_from = high_from
        self.starts, self.end, self.top = [], {}, 0
        self.blocks = {}
        self.requests = {0: 0}
        self.device_mallocs, self.peak_requested, self.peak_reserved, self.requested = {0: 0}, {0: 0}, {0: 0}, 0

    def _take(self, start):
        del self.starts[bisect.bisect_left(self.starts, start)]
        return self.end.pop(start)

    def _put(self, start, end):
        i = bisect.bisect_left(self.starts, start)
        if i and self.end[self.starts[i - 1]] == start:
            start = self.starts[i - 1]
            self._take(start)
            i -= 1
        if i < len(self.starts) and self.starts[i] == end:
            end = self._take(end)
        self.starts.insert(i, start)
        self.end[start] = end

    def allocate(self, nbytes: int, device: int = 0, stream: int = 0):
        if device != 0 or stream != 0:
            raise ValueError("RangeModel replays one stream of device 0")
        size = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        fits = [(self.end[s] - s, s) for s in self.starts if s + size <= self.end[s]]
        if fits:
            length, start = min(fits)
            end = self._take(start)
            if self.high_from is not None and size >= self.high_from:
                start = end - size
                if start > end - length:
                    self._put(end - length, start)
            elif start + size < end:
                self._put(start + size, end)
        else:
            self.device_mallocs[0] += 1
            last = self.starts[-1] if self.starts and self.end[self.starts[-1]] == self.top else None
            start = self.top if last is None else last
            if last is not None:
                self._take(last)
            top = -(-(start + size) // PAGE) * PAGE
            if start + size < top:
                self._put(start + size, top)
            self.top = top
        self.requests[0] += 1
        self.requested += nbytes
        self.peak_requested[0] = max(self.peak_requested[0], self.requested)
        self.peak_reserved[0] = max(self.peak_reserved[0], self.top)
        self.blocks[start] = (size, nbytes)
        return start

    def free_chunk(self, start) -> None:
        size, nbytes = self.blocks.pop(start)
        self.requested -= nbytes
        self._put(start, start + size)


def make_pool(candidate: str):
    """A fresh pool of a candidate over a backend that touches no memory (or a model)."""
    if candidate == "cupy_pool_model":
        return ms.CupyPoolModel()
    if candidate == "expandable_split_1mib":
        return RangeModel(1 << 20)
    if candidate == "torch_expandable_model":
        return tem.torch_expandable()
    if candidate in tem.VARIANTS:
        return tem.ExpandableModel(**tem.VARIANTS[candidate])
    if candidate not in CANDIDATES:
        raise ValueError(f"candidate must be one of {', '.join(CANDIDATES + tuple(tem.VARIANTS))}, got {candidate!r}")
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


def load_trace(name: str, data=None) -> pd.DataFrame:
    """One trace of TRACES (default folder: the repository's data/)."""
    if name in HOST:
        return pd.read_csv(pathlib.Path(data or data_dir()) / HOST[name])
    return rule_study.load_trace(name, data)


def scaled_run(workload: str) -> tuple[int, int, int]:
    """(factor, warm-up, steps) of a workload's run in xlab.bench.dynamic_scale."""
    from xlab.bench.dynamic_scale import SCALED
    s = SCALED[workload]
    return s.factor, s.warmup, s.steps


def trace_rows(name: str, candidates=CANDIDATES, data=None) -> list:
    """The rows of one trace: each candidate at scale 1 and, for the workloads of SCALES, at dynamic_scale's factor
    over its steps (the trace cut to them: what a scaled run of that realization requests)."""
    tl = load_trace(name, data)
    info = rule_study.trace_info(name, tl)
    first = tl.iloc[0]
    trace = dict(trace_recorded_on=first.get("gpu", "unknown"), trace_commit=first.get("commit", "unknown"),
                 trace_date=first.get("date", "unknown"))
    runs = [(1, info["warmup"], info["steps"], tl)]
    if info["workload"] in SCALES:
        factor, warmup, steps = scaled_run(info["workload"])
        runs.append((factor, warmup, steps, tl[tl["step"] < warmup + steps]))
    rows = []
    for scale, warmup, steps, events in runs:
        on_gpu = name in DYN or name in AWAITED
        gpu = measured(info["workload"], info["seed"], scale, data) if on_gpu else {}
        peers = {p: gpu[p] for p in PEERS if p in gpu and not math.isnan(gpu[p])}
        best = min(peers, key=peers.get) if peers else None
        requests = first.get("requests_from", "gpu" if on_gpu else "numpy") if scale == 1 else \
            "plan" if info["workload"] in EXACT_AT_SCALE else "scaled"
        for cand in candidates:
            r = replay(events, cand, warmup, steps, scale)
            rows.append(dict(trace=name, workload=info["workload"], realization=info["seed"],
                             fixed_shape=info["fixed_shape"], scale=scale, requests=requests,
                             pool="exact" if cand == "expandable" else "model", candidate=cand,
                             warmup=warmup, steps=steps, **r, measured_best_peer=best,
                             measured_best_peer_ratio=peers.get(best, math.nan),
                             measured_arm_ratio=gpu.get(ARM.get(cand), math.nan), measured_commit=gpu.get("commit"),
                             **trace))
    return rows


def study(names=None, candidates=CANDIDATES, data=None, experiment="cupy_default_replays") -> pd.DataFrame:
    """Every trace of `names` (default: traces(data)) through every candidate: COLUMNS with the run's provenance."""
    rows = [r for name in names or traces(data) for r in trace_rows(name, candidates, data)]
    return pd.DataFrame(rows, columns=COLUMNS).assign(**provenance(experiment=experiment))


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per (workload, scale, candidate): the realizations replayed, the median and max of reserved / requested, in how
    many it held no more than today's default (segments) on the same trace (`at_most_segments`), and, where the GPU
    measured the peers on the same realizations, no more than the best of them (`at_most_best_peer` of `with_peer`),
    and its device calls after the warm-up and in the steady state, in all."""
    seg = df[df["candidate"] == "segments"].set_index(["trace", "scale"])["reserved_over_requested"]
    out = []
    for (w, scale, cand), g in df.groupby(["workload", "scale", "candidate"], sort=False):
        peer = g.dropna(subset=["measured_best_peer_ratio"])
        base = pd.Series([seg.get((t, s), math.nan) for t, s in zip(g["trace"], g["scale"])], index=g.index)
        out.append(dict(workload=w, scale=scale, candidate=cand, realizations=len(g),
                        median=g["reserved_over_requested"].median(), max=g["reserved_over_requested"].max(),
                        at_most_segments=int((g["reserved_over_requested"] <= base).sum()), with_peer=len(peer),
                        at_most_best_peer=int((peer["reserved_over_requested"]
                                               <= peer["measured_best_peer_ratio"]).sum()),
                        best_peer_median=peer["measured_best_peer_ratio"].median() if len(peer) else math.nan,
                        calls_after_warmup=g["device_calls_after_warmup"].sum(min_count=1),
                        steady_calls=g["steady_calls"].sum(min_count=1)))
    return pd.DataFrame(out)


RECORD_WORKLOADS = (("cupy_mix", 1), ("cupy_mix", 216), ("gpt_varlen", 1), ("gpt_b4", 1), ("gpt_b32", 1),
                    ("cupy_fill", 1), ("cupy_fill", 64), ("cupy_image", 1))     # decision 0014's table


def markdown(df: pd.DataFrame) -> str:
    """Decision 0013's table from the CSV's rows: per workload and scale, each candidate's median (max) over the
    realizations, the GPU's best CuPy peer's median, and in how many realizations segments, expandable and the
    split placement held no more than it."""
    t = summary(df).set_index(["workload", "scale", "candidate"])
    head = ("| workload (scale) | requests | segments | expandable | split at 1 MiB (model) | CuPy's pool (model) "
            "| best peer (GPU) | at most the best peer: segments; expandable; split |\n"
            "|---|---|---|---|---|---|---|---|")
    lines = []
    for w, scale in RECORD_WORKLOADS:
        r = {c: t.loc[(w, scale, c)] for c in CANDIDATES}
        cell = lambda c: f"{r[c]['median']:.3f} ({r[c]['max']:.3f})"       # noqa: E731
        req = "/".join(sorted(set(df.loc[(df.workload == w) & (df.scale == scale), "requests"])))
        n = int(r["expandable"]["with_peer"])
        peer = f"{r['expandable']['best_peer_median']:.3f}" if n else "—"
        counts = "; ".join(f"{int(r[c]['at_most_best_peer'])}" for c in ("segments", "expandable",
                                                                          "expandable_split_1mib"))
        lines.append(f"| {w} (x{scale}) | {req}, {int(r['expandable']['realizations'])} | {cell('segments')} "
                     f"| {cell('expandable')} | {cell('expandable_split_1mib')} | {cell('cupy_pool_model')} | {peer} "
                     f"| {counts + f' of {n}' if n else '—'} |")
    return "\n".join([head, *lines])


def variants_summary(df: pd.DataFrame) -> pd.DataFrame:
    """summary() of the variants' CSV, with `at_most_model_peer`: in how many realizations a row held no more than
    the least of the modelled peers (MODEL_PEERS) on the same trace and scale, the bar where the GPU measured none."""
    out = summary(df)
    peer = df[df["candidate"].isin(MODEL_PEERS)].groupby(["trace", "scale"])["reserved_over_requested"].min()
    at = df.assign(model_peer=[peer.get((t, s), math.nan) for t, s in zip(df["trace"], df["scale"])])
    at = at.assign(ok=at["reserved_over_requested"] <= at["model_peer"])
    counts = at.groupby(["workload", "scale", "candidate"], sort=False).agg(
        at_most_model_peer=("ok", "sum"), model_peer_median=("model_peer", "median"))
    return out.join(counts, on=["workload", "scale", "candidate"])


def variants_markdown(df: pd.DataFrame) -> str:
    """The variants' table: per workload and scale, each row's median (max) of reserved / requested and in how many
    realizations it held no more than the best peer (the GPU's where it measured them, else the modelled peers')."""
    t = variants_summary(df).set_index(["workload", "scale", "candidate"])
    cands = [c for c in VARIANTS if c in set(df["candidate"]) and c != "expandable_model"]
    head = ("| workload (scale) | best peer | " + " | ".join(cands) + " |\n|---|---|" + "---|" * len(cands))
    lines = []
    for w, scale in RECORD_WORKLOADS:
        if (w, scale, cands[0]) not in t.index:
            continue
        r = {c: t.loc[(w, scale, c)] for c in cands}
        gpu = int(r[cands[0]]["with_peer"]) > 0
        peer = r[cands[0]]["best_peer_median" if gpu else "model_peer_median"]
        n = int(r[cands[0]]["with_peer" if gpu else "realizations"])
        cells = [f"{r[c]['median']:.3f} ({r[c]['max']:.3f}); "
                 f"{int(r[c]['at_most_best_peer' if gpu else 'at_most_model_peer'])}/{n}" for c in cands]
        lines.append(f"| {w} (x{scale}) | {peer:.3f} ({'GPU' if gpu else 'models'}) | " + " | ".join(cells) + " |")
    return "\n".join([head, *lines])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=DEFAULT_OUT, help=f"CSV to write (default: {DEFAULT_OUT})")
    p.add_argument("--traces", help="comma-separated trace names (default: every one recorded)")
    p.add_argument("--summary", action="store_true", help="summarise the CSV at --out; replay nothing")
    p.add_argument("--markdown", action="store_true", help="print decision 0014's table of the CSV")
    p.add_argument("--variants", action="store_true",
                   help=f"replay scheme expandable's variants instead (default --out: {VARIANTS_OUT})")
    a = p.parse_args(argv)
    if a.variants and a.out == DEFAULT_OUT:
        a.out = VARIANTS_OUT
    if a.summary:
        df = pd.read_csv(a.out)
    else:
        known = traces()
        names = a.traces.split(",") if a.traces else known
        bad = [n for n in names if n not in known]
        if bad:
            p.error(f"unknown trace(s) {', '.join(bad)}; known: {', '.join(known)}")
        df = publish(study(names, VARIANTS, experiment="cupy_default_variants") if a.variants else study(names), a.out)
    if a.markdown:
        print(variants_markdown(df) if a.variants else markdown(df))
        return 0
    with pd.option_context("display.width", 200, "display.max_columns", 30, "display.float_format", "{:.4g}".format):
        print((variants_summary(df) if a.variants else summary(df)).to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
