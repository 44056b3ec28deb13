"""Map slack (#22's steady-state maps from fragmentation), replayed on every H200 trace of the dynamic-shape benchmark
(xlab.memory_study's DYN_TRACES) and of its held-out workloads (HELD_OUT_TRACES), under release_on_miss "peak" (the
PyTorch front end's default) and "never" (CuPy's expandable default).  Scheme expandable with 2 MiB pages over the
host twin, as xlab.memory_study.replay_rule replays them (the replays equal the GPU's runs to the byte and the
call).

Slack: when a miss maps pages, the run it maps is rounded up to cover `slack` more bytes past the block (only where
the plan ends in an unmapped run; capped at that run), so the next odd-sized requests find a free piece.  It needs an
EXPERIMENTAL build, not kept: `git apply scripts/map_slack_experiment.patch`, build the extension, run this script,
`git apply -R` the patch and build again.  That build reads the slack per miss from $XPOOL_EXP_SLACK =
"form:value[:cap]" (read once per process, so every slack runs in its own process):
- pages:k          k pages on every miss;
- demand:f         f x the bytes in use by request (this request's included) on every miss;
- peak:f           f x the most bytes ever requested, on a miss whose demand is within release_bound of that most;
- req:f            f x the request, on every miss;
- rpages:k, rmost:f, rreq:f        the same, only on a miss that does not raise the demand's most (after its peak);
- rpeakpages:k, rpeakmost:f, rpeakreq:f   only on such a miss within release_bound of the most;
- cap 1: the slack never takes committed bytes past release_bound x the most (the mark of "peak"/"bounded"), so a
  slack never makes a miss under "peak" give back.
slack "none" is the build without slack (the same as today's main to the call).

One row per (trace, rule, slack): ratio (peak reserved / peak requested), steady_calls and steady_unmaps (maps +
unmaps, unmaps alone, after the demand's last new high: xlab.bench.dynamic.steady_state), calls_after_warmup (maps +
unmaps from the end of the warm-up to the end of the trace), and the same four of slack "none" beside them.

    git apply scripts/map_slack_experiment.patch && python setup.py build_ext --inplace
    python scripts/map_slack_replay.py                      (CPU, ~3 min on 2 cores: data/map_slack_replay.csv)
    git apply -R scripts/map_slack_experiment.patch && python setup.py build_ext --inplace
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pandas as pd

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SLACKS = ("none",
          "pages:1", "pages:2", "pages:4", "pages:8", "demand:0.005", "demand:0.01", "demand:0.02", "req:1",
          "demand:0.01:1", "demand:0.02:1", "peak:0.01", "peak:0.02:1",
          "rpages:1", "rpages:2", "rpages:4", "rpages:8", "rpages:4:1", "rpages:16:1", "rpeakpages:4:1",
          "rmost:0.01", "rmost:0.01:1", "rmost:0.05:1", "rreq:1", "rreq:1:1", "rreq:2:1")
RULES = ("peak", "never")
COLUMNS = ["trace", "rule", "slack", "ratio", "steady_calls", "steady_unmaps", "calls_after_warmup",
           "ratio_none", "steady_calls_none", "steady_unmaps_none", "calls_after_warmup_none"]


def worker(slack: str, rules) -> list:
    """Every trace under every rule in this process, whose $XPOOL_EXP_SLACK is `slack`."""
    from xlab import memory_study as m
    rows = []
    for name in m.DYN_TRACES + m.HELD_OUT_TRACES:
        tl = m.dyn_trace(name)
        for rule in rules:
            r = m.replay_rule(tl, rule)
            rows.append(dict(trace=name, rule=rule, slack=slack, held_out=name in m.HELD_OUT_TRACES,
                             **{k: (float(v) if k == "ratio" else int(v)) for k, v in r.items()}))
    return rows


def run(slack: str, rules) -> list:
    env = dict(os.environ)
    env.pop("XPOOL_EXP_SLACK", None)
    if slack != "none":
        env["XPOOL_EXP_SLACK"] = slack
    out = subprocess.run([sys.executable, __file__, "--worker", slack, "--rules", ",".join(rules)], env=env,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "data" / "map_slack_replay.csv"))
    p.add_argument("--rules", default=",".join(RULES))
    p.add_argument("--slacks", default=",".join(SLACKS))
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    rules = a.rules.split(",")
    if a.worker:
        json.dump(worker(a.worker, rules), sys.stdout)
        return 0
    from xlab.provenance import provenance
    slacks = a.slacks.split(",")
    if "none" not in slacks:
        slacks.insert(0, "none")
    with ThreadPoolExecutor(a.jobs) as ex:
        rows = [r for rs in ex.map(lambda s: run(s, rules), slacks) for r in rs]
    df = pd.DataFrame(rows)
    base = df[df["slack"] == "none"].set_index(["trace", "rule"])
    if len(slacks) > 1 and (df[df["slack"] != "none"].merge(base.reset_index(), on=["trace", "rule"],
                                                            suffixes=("", "_b"))
                            .eval("device_calls == device_calls_b and peak_bytes_reserved == peak_bytes_reserved_b")
                            .all()):
        sys.exit("every slack replays as 'none': is this the build of scripts/map_slack_experiment.patch?")
    for c in ("ratio", "steady_calls", "steady_unmaps", "calls_after_warmup"):
        df[f"{c}_none"] = [base.loc[(t, r), c] for t, r in zip(df["trace"], df["rule"])]
    prov = provenance(experiment="map_slack_replay")
    for k, v in prov.items():
        df[k] = v
    df["build"] = f"{prov['commit'].removesuffix('+dirty')} with scripts/map_slack_experiment.patch applied"
    from xlab import memory_study as m
    df["page_bytes"] = m.DYN_PAGE
    df = df[COLUMNS + [c for c in df.columns if c not in COLUMNS]]
    df.to_csv(a.out, index=False)

    pytorch = [n for n in m.DYN_TRACES + m.HELD_OUT_TRACES if n.startswith(("resnet_varres", "torch_fixed_b32"))]
    summary = []
    for (slack, rule), g in df.groupby(["slack", "rule"], sort=False):
        w = g[g["ratio"] > g["ratio_none"] + 0.002]
        summary.append(dict(
            slack=slack, rule=rule,
            target_steady=int(g[g["trace"].isin(pytorch)]["steady_calls"].sum()),
            all_steady=int(g["steady_calls"].sum()), all_after_warmup=int(g["calls_after_warmup"].sum()),
            traces_more_calls=int(((g["steady_calls"] > g["steady_calls_none"]) |
                                   (g["calls_after_warmup"] > g["calls_after_warmup_none"])).sum()),
            traces_ratio_up=len(w),
            past_105=int(((g["ratio"] > 1.05 + 1e-4) & (g["ratio_none"] <= 1.05)).sum()),
            worst_ratio_up=round(float((g["ratio"] - g["ratio_none"]).max()), 4)))
    with pd.option_context("display.width", 250, "display.max_rows", 200):
        print(pd.DataFrame(summary).to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
