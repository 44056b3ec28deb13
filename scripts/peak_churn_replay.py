"""release_on_miss "peak" and its churn stop (Note [Release on miss: peak]), replayed on every H200 trace of the
dynamic-shape benchmark (tests/test_expandable_pool.py's DYN) and of its held-out workloads (HELD_OUT: the PyTorch
language model at batch 32 on seeds 0-4, the fixed-length model at batch 32, the GPT at varying lengths' seeds 1-4),
beside "bounded", "growth" and "until_churn".  Scheme expandable with 2 MiB pages over the host twin
(xlab.memory_study.AddressSpaceBackend), the settings the trace tests use; the replays equal the GPU's runs to the
byte and the call (tests/test_expandable_pool.py checks each trace against the counters of its recording run).

One row per (trace, rule):
- ratio: peak reserved / peak requested;
- steady_calls, steady_unmaps: maps + unmaps, and unmaps alone, in the benchmark's steady state
  (xlab.bench.dynamic.steady_state: the timed steps after the demand's last new high, probed after every step of the
  workload as the benchmark probes them; the events after the last step, the trace's teardown, are not counted);
- calls_after_warmup: maps + unmaps from the end of the last warm-up step to the end of the trace (its teardown
  included), as the trace tests count them (_replay_rule).

A rule's rows come from the build the script runs against (the provenance's commit).  To compare a rule with an
earlier build of itself, run the script at that build with --rules peak --as peak_old: those rows are kept (merged by
(trace, rule)) when the script runs again at the new build.

    python scripts/peak_churn_replay.py                                 (CPU, ~10 s: data/peak_churn_replay.csv)
    python scripts/peak_churn_replay.py --rules peak --as peak_old      (at the build before the change)
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import pandas as pd

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from xlab import memory_study as m  # noqa: E402
from xlab.bench.dynamic import steady_state  # noqa: E402
from xlab.provenance import provenance  # noqa: E402
from xpool import Pool  # noqa: E402

DYN = ("cupy_mix", "torch_varlen", "gpt_varlen", "gpt_b4", "test_b4", "test_b32_perparam", "torch_fixed", "gpt_b32",
       "resnet_varres", "resnet_fixed",
       *(f"{w}_s{s}" for w in ("cupy_mix", "torch_varlen", "resnet_varres") for s in (1, 2, 3, 4)))
HELD_OUT = ("torch_varlen_b32", *(f"torch_varlen_b32_s{s}" for s in (1, 2, 3, 4)), "torch_fixed_b32",
            "resnet_varres_b64", *(f"resnet_varres_b64_s{s}" for s in (1, 2, 3, 4)),
            *(f"gpt_varlen_s{s}" for s in (1, 2, 3, 4)))
RULES = ("bounded", "growth", "until_churn", "peak")
COLUMNS = ["trace", "rule", "ratio", "steady_calls", "steady_unmaps", "calls_after_warmup"]


def trace(name: str) -> pd.DataFrame:
    return pd.read_csv(ROOT / "data" / f"memory_trace_dyn_{name}.csv.gz")


def replay(tl: pd.DataFrame, rule: str) -> dict:
    """One trace under `rule`: the CSV's columns (module docstring) and the counts they come from."""
    pool = Pool(m.AddressSpaceBackend(), scheme="expandable", limit=0, timeline=0, release_on_miss=rule)
    probes = {}                                           # step -> (maps, unmaps, peak requested) at its end

    def probe(step):                                      # _drive calls it with None before the first event
        s = pool._core.stats(0)
        probes[step] = (s["device_maps"], s["device_unmaps"], s["peak_bytes_requested"])
    live, unmatched = m._drive(pool, m._replay_events(tl), probe)
    s = pool._core.stats(0)
    live.clear()
    warmup, steps = int(tl["warmup"].iloc[0]), int(tl["steps"].iloc[0])
    per_step = [probes[k] for k in range(warmup + steps)]   # the workload's steps: the benchmark's probes
    calls = steady_state([(mp + un, p) for mp, un, p in per_step], warmup)
    unmaps = steady_state([(un, p) for _, un, p in per_step], warmup)
    last = probes[max(k for k in probes if k is not None)]
    return dict(ratio=s["peak_bytes_reserved"] / s["peak_bytes_requested"],
                steady_calls=calls["device_calls_steady"], steady_unmaps=unmaps["device_calls_steady"],
                calls_after_warmup=sum(last[:2]) - sum(probes[warmup - 1][:2]),
                steady_steps=calls["steady_steps"], demand_peak_step=calls["demand_peak_step"],
                device_calls=s["device_maps"] + s["device_unmaps"],
                peak_bytes_reserved=s["peak_bytes_reserved"], peak_bytes_requested=s["peak_bytes_requested"],
                unmatched_frees=unmatched)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "data" / "peak_churn_replay.csv"))
    p.add_argument("--rules", default=",".join(RULES), help="release rules to replay, comma-separated")
    p.add_argument("--as", dest="label", default=None, help="the rows' rule name (one rule only): e.g. peak_old")
    a = p.parse_args(argv)
    rules = a.rules.split(",")
    if a.label and len(rules) != 1:
        p.error("--as names the rows of one rule")
    prov = provenance(experiment="peak_churn_replay")
    rows = []
    for name in DYN + HELD_OUT:
        tl = trace(name)
        for rule in rules:
            rows.append(dict(trace=name, rule=a.label or rule, release_on_miss=rule,
                             **replay(tl, rule), held_out=name in HELD_OUT, page_bytes=2 << 20, **prov))
    df = pd.DataFrame(rows)
    out = pathlib.Path(a.out)
    if out.exists():                                      # keep the other rules' rows (another build's, say)
        old = pd.read_csv(out)
        df = pd.concat([old[~old["rule"].isin(df["rule"].unique())], df], ignore_index=True)
    order = {n: i for i, n in enumerate(DYN + HELD_OUT)}
    df = df.sort_values(["trace", "rule"], key=lambda c: c.map(order) if c.name == "trace" else c, kind="stable")
    df = df[COLUMNS + [c for c in df.columns if c not in COLUMNS]]
    df.to_csv(out, index=False)
    table = df.assign(cell=df["ratio"].map("{:.4f}".format) + " " + df["steady_calls"].astype(str) + " " +
                      df["calls_after_warmup"].astype(str)).pivot(index="trace", columns="rule", values="cell")
    with pd.option_context("display.width", 250, "display.max_rows", 200):
        print("ratio, steady calls, calls after warm-up")
        print(table.loc[[n for n in DYN + HELD_OUT if n in table.index]].to_string())
    return 0


if __name__ == "__main__":
    sys.exit(main())
