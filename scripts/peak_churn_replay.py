"""release_on_miss "peak" and its churn stop (Note [Release on miss: peak]), replayed on every H200 trace of the
dynamic-shape benchmark (xlab.memory_study's DYN_TRACES) and of its held-out workloads (HELD_OUT_TRACES: the PyTorch
language model at batch 32 and the ResNet at batch 64 on seeds 0-4, the fixed-length model at batch 32, the GPT at
varying lengths' seeds 1-4), beside "bounded", "growth" and "until_churn", by xlab.memory_study.replay_rule (scheme
expandable with 2 MiB pages over the host twin, the settings the trace tests use; the replays equal the GPU's runs
to the byte and the call: tests/xpool/test_expandable_pool.py checks each trace against the counters of its recording
run).  One row per (trace, rule): replay_rule's columns (ratio, steady_calls, steady_unmaps, calls_after_warmup and
the counts they come from).

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
from xlab.provenance import provenance  # noqa: E402

DYN, HELD_OUT = m.DYN_TRACES, m.HELD_OUT_TRACES
RULES = ("bounded", "growth", "until_churn", "peak")
COLUMNS = ["trace", "rule", "ratio", "steady_calls", "steady_unmaps", "calls_after_warmup"]


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
        tl = m.dyn_trace(name)
        for rule in rules:
            rows.append(dict(trace=name, rule=a.label or rule, release_on_miss=rule,
                             **m.replay_rule(tl, rule), held_out=name in HELD_OUT, page_bytes=m.DYN_PAGE, **prov))
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
