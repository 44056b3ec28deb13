"""Which release rule each scheme keeps: every recorded trace replayed under every (scheme, release rule) pair.

data/release_rules.csv holds the replays of every rule through xpool as at RESEARCH_COMMIT (5bcaad4, the last commit
with all of them; the tag record-2026-12-05 keeps that code), each at its default release_idle and release_bound;
this module summarises those committed rows and chooses a rule per scheme from them. What it still replays is the
checkout's own xpool, one built-in rule per scheme (rule "builtin"), for the comparison before and after the rules
left the product (data/release_rules_product.csv). The replays are memory_study's: a trace's requests and frees, in
order, through a pool over a backend that touches no memory (2 MiB pages for scheme expandable), exact to the byte
and the call. One row per trace x scheme x rule.

    python -m xlab.rule_study                     # data/release_rules_product.csv: the product's replays
    python -m xlab.rule_study --summary           # the summary of data/release_rules.csv and the chosen rules
    python -m xlab.rule_study --summary --markdown    # its table in docs/decisions/0001-one-release-rule-per-scheme.md
"""
from __future__ import annotations

import argparse
import math
import os
import pathlib
import re
from concurrent.futures import ProcessPoolExecutor

import pandas as pd

from xlab import memory_study as ms
from xlab.bench.dynamic import steady_state
from xlab.paths import data_dir, publish
from xlab.provenance import provenance

RESEARCH_COMMIT = "5bcaad4"  # the build whose replays data/release_rules.csv holds (tag record-2026-12-05)
PRODUCT = "product"        # the build replayed now: the checkout's own xpool
BUILTIN = "builtin"        # the product's rule: the one its scheme has, no setting
RULES = {                  # RESEARCH_COMMIT's rules per scheme (until_churn: expandable only)
    "segments": ("never", "high_water", "always", "bounded", "growth", "peak"),
    "expandable": ("never", "high_water", "always", "bounded", "growth", "until_churn", "peak"),
}
# Tunable parameters a rule reads (release_idle, release_bound); the miss budget (1 high-water mark) bounds all but
# "never", and until_churn's and peak's churn ring has 8 entries: constants, not counted.
PARAMETERS = {"never": 0, "always": 0, "high_water": 1, "bounded": 1, "growth": 1, "until_churn": 1, "peak": 1}
# The recorded traces besides memory_study's DYN_TRACES, HELD_OUT_TRACES and TRACES: the keep-previous-step loop
# (KEEP_TRACES below). data/segments_trace_dyn_test_*.csv.gz are not replayed: they are
# test_b4's and test_b32_perparam's request streams again, recorded under scheme segments.
KEEP_TRACES = {"gpt_b32_keep_cupy_path_numpy": "memory_trace_cupy_path_b32_keep.csv.gz",
               "gpt_b32_perparam_keep_cupy_path_numpy": "memory_trace_cupy_path_b32_perparam_keep.csv.gz"}
FILE_TRACES = {**ms.TRACES, **KEEP_TRACES}      # name -> its file under data/
NEAR_BEST = 0.02           # a rule is near the best on a trace within this much reserved/requested of the least
DEFAULT_OUT = "data/release_rules.csv"            # RESEARCH_COMMIT's rows, committed
PRODUCT_OUT = "data/release_rules_product.csv"   # the product's rows: what main() replays
# A row: the trace (fixed_shape: by its name); the pair; peaks over the whole trace; device calls (mallocs + frees,
# or maps + unmaps) in all; steady_calls and steady_unmaps, the calls and the gives back (frees, unmaps) over the
# steady_steps, as memory_study.replay_rule counts them (steady_calls_per_step: their ratio); calls_after_warmup.
COLUMNS = ["trace", "trace_group", "workload", "seed", "fixed_shape", "scheme", "rule", "build",
           "peak_bytes_requested", "peak_bytes_reserved", "reserved_over_requested", "device_calls", "steady_calls",
           "steady_unmaps", "steady_steps", "steady_calls_per_step", "calls_after_warmup", "demand_peak_step",
           "warmup", "steps", "events", "unmatched_frees"]


# --- the traces
def trace_names() -> list:
    """Every recorded trace: the dynamic ones (DYN_TRACES with their seeds, HELD_OUT_TRACES), then FILE_TRACES."""
    return [*ms.DYN_TRACES, *ms.HELD_OUT_TRACES, *FILE_TRACES]


def trace_group(name: str) -> str:
    """"held_out" for the held-out workloads' traces, "tuned" for those the rules were developed on."""
    return "held_out" if name in ms.HELD_OUT_TRACES else "tuned"


def is_fixed_shape(name: str) -> bool:
    """Whether a trace's program repeats one shape every step (by its name)."""
    return (any(k in name for k in ("fixed", "b32", "b4"))
            and not any(k in name for k in ("varlen", "varres", "mix")))


def load_trace(name: str, folder=None) -> pd.DataFrame:
    """One trace of trace_names() from `folder` (default: the repository's data/)."""
    if name in FILE_TRACES:
        return pd.read_csv(pathlib.Path(folder or data_dir()) / FILE_TRACES[name])
    return ms.dyn_trace(name, folder)


def trace_info(name: str, tl: pd.DataFrame) -> dict:
    """What a row says of its trace: group, workload, seed (0 where the recording names none), whether its shapes
    are fixed, its warm-up and timed steps (GPT traces without them: memory_study's WARMUP_STEPS, the rest timed)."""
    first = tl.iloc[0]
    suffix = re.search(r"_s(\d+)$", name)
    seed = int(first["seed"]) if "seed" in tl else int(suffix.group(1)) if suffix else 0
    last_step = int(tl["step"].max())
    warmup = int(first["warmup"]) if "warmup" in tl else ms.WARMUP_STEPS
    steps = int(first["steps"]) if "steps" in tl else last_step + 1 - warmup
    return dict(trace=name, trace_group=trace_group(name), workload=first.get("workload", name), seed=seed,
                fixed_shape=is_fixed_shape(name), warmup=warmup, steps=steps)


# --- the pools
def make_pool(scheme: str):
    """A fresh pool of the product's `scheme`, its one built-in rule, over memory_study.AddressSpaceBackend."""
    import xpool
    return xpool.pool.Pool(ms.AddressSpaceBackend(), scheme=scheme, limit=0, timeline=0, debug=False)


def check_environment(pkg) -> None:
    """ValueError when an XPOOL_* variable would change the pools' settings: the study replays the defaults."""
    set_ = sorted(v for v in pkg.settings.ENV.values() if v in os.environ)
    if set_:
        raise ValueError(f"unset {', '.join(set_)}: the rule study replays each rule at its defaults")


# --- the replay
def _counts(stats) -> tuple:
    """(device calls, of which gives back, peak requested) of a pool's stats row: mallocs + frees + maps + unmaps,
    frees + unmaps."""
    releases = int(stats["device_frees"] + stats["device_unmaps"])
    return int(stats["device_mallocs"] + stats["device_maps"]) + releases, releases, int(stats["peak_bytes_requested"])


def replay(pool, tl: pd.DataFrame, warmup: int, steps: int) -> dict:
    """A trace replayed through `pool`, probed after every step as memory_study.replay_rule probes it: peaks,
    device calls in all, steady_calls and steady_unmaps (calls, and gives back alone, over the steady steps of
    xlab.bench.dynamic.steady_state: from warm-up on, after the demand's last new high; NaN when there is none),
    calls_after_warmup (from the end of the last warm-up step to the end of the trace)."""
    events = ms._replay_events(tl)
    if events["device"].nunique() != 1 or int(events["device"].iloc[0]) != 0:
        raise ValueError("a trace of device 0 alone is replayed")
    probes = {}                                   # step -> _counts at its end (None: before the first event)

    def probe(step):
        probes[step] = _counts(ms.stats_row(pool))

    live, unmatched = ms._drive(pool, ms._rows(events), probe)
    stats = ms.stats_row(pool)
    live.clear()
    per_step = [probes[k] for k in range(warmup + steps)]
    calls = steady_state([(c, p) for c, _, p in per_step], warmup)
    unmaps = steady_state([(u, p) for _, u, p in per_step], warmup)
    last = probes[max(k for k in probes if k is not None)]
    reserved, requested = int(stats["peak_bytes_reserved"]), int(stats["peak_bytes_requested"])
    n = calls["steady_steps"]
    return dict(peak_bytes_requested=requested, peak_bytes_reserved=reserved,
                reserved_over_requested=reserved / requested, device_calls=_counts(stats)[0],
                steady_calls=calls["device_calls_steady"], steady_unmaps=unmaps["device_calls_steady"],
                steady_steps=n, steady_calls_per_step=calls["device_calls_steady"] / n if n else math.nan,
                calls_after_warmup=last[0] - probes[warmup - 1][0], demand_peak_step=calls["demand_peak_step"],
                events=len(events), unmatched_frees=unmatched)


def load_build(build: str):
    """The package a build names: PRODUCT, this checkout's xpool; ValueError for any other (RESEARCH_COMMIT's
    replays are committed in data/release_rules.csv, its code kept by the tag record-2026-12-05)."""
    if build != PRODUCT:
        raise ValueError(f"build must be {PRODUCT!r}, got {build!r}: the replays of {RESEARCH_COMMIT} are committed "
                         f"({DEFAULT_OUT}); its code is at the tag record-2026-12-05")
    import xpool
    return xpool


def pairs(build: str) -> list:
    """The (scheme, rule) pairs of a build's rows: each scheme's BUILTIN (PRODUCT), or every rule of RULES (the
    committed rows of RESEARCH_COMMIT)."""
    if build == PRODUCT:
        return [(scheme, BUILTIN) for scheme in RULES]
    return [(scheme, rule) for scheme, rules in RULES.items() for rule in rules]


def trace_rows(name: str, build: str = PRODUCT) -> list:
    """The rows of one trace: each scheme of the product replayed over it under its built-in rule."""
    pkg = load_build(build)
    check_environment(pkg)
    tl = load_trace(name)
    info = trace_info(name, tl)
    return [dict(info, scheme=scheme, rule=rule, build=build, **replay(make_pool(scheme), tl, info["warmup"],
                                                                       info["steps"]))
            for scheme, rule in pairs(build)]


def study(names=None, jobs: int | None = None) -> pd.DataFrame:
    """Every trace of `names` (default: trace_names()) through the product, one process per CPU (jobs), in trace
    order: COLUMNS with provenance."""
    names = list(names or trace_names())
    jobs = jobs or min(len(names), os.cpu_count() or 1)
    if jobs > 1:
        with ProcessPoolExecutor(jobs) as ex:
            rows = [r for rs in ex.map(trace_rows, names) for r in rs]
    else:
        rows = [r for name in names for r in trace_rows(name)]
    return pd.DataFrame(rows, columns=COLUMNS).assign(**provenance(experiment="rule_study"))


# --- the summary and the choice
def summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per (scheme, rule): median and max of reserved/requested over tuned and over held-out traces; the share of
    traces on which it is within NEAR_BEST of the least of its scheme's rules; how many traces have a steady-state
    give-back (steady_unmaps > 0) or any steady call; on the fixed-shape traces, steady calls and give-backs in
    all; and the rule's tunable parameters."""
    df = df.assign(best=df.groupby(["trace", "scheme"])["reserved_over_requested"].transform("min"))
    df = df.assign(near=df["reserved_over_requested"] <= df["best"] + NEAR_BEST)
    out = []
    for (scheme, rule), g in df.groupby(["scheme", "rule"], sort=False):
        tuned, held = (g.loc[g["trace_group"] == k, "reserved_over_requested"] for k in ("tuned", "held_out"))
        fixed = g[g["fixed_shape"].astype(bool)]
        out.append(dict(scheme=scheme, rule=rule, traces=len(g),
                        tuned_median=tuned.median(), tuned_max=tuned.max(),
                        held_out_median=held.median(), held_out_max=held.max(),
                        share_near_best=g["near"].mean(),
                        traces_steady_unmaps=int((g["steady_unmaps"] > 0).sum()),
                        traces_steady_calls=int((g["steady_calls"] > 0).sum()),
                        fixed_steady_calls=int(fixed["steady_calls"].fillna(0).sum()),
                        fixed_steady_unmaps=int(fixed["steady_unmaps"].fillna(0).sum()),
                        parameters=PARAMETERS.get(rule, 0)))
    return pd.DataFrame(out)


def choose(table: pd.DataFrame) -> dict:
    """The rule each scheme keeps, from a summary(): among the rules that give nothing back in the steady state of
    any fixed-shape trace (a fixed-shape loop must not churn), the least held-out worst case, then the least
    held-out median, both to 3 significant figures; ties to the rule with fewer parameters, then the earlier in
    RULES."""
    chosen = {}
    for scheme, g in table.groupby("scheme", sort=False):
        g = g[g["fixed_steady_unmaps"] == 0]
        key = g.assign(worst=g["held_out_max"].map(_sig3), median=g["held_out_median"].map(_sig3),
                       order=g["rule"].map(lambda r: RULES.get(scheme, (r,)).index(r)))
        chosen[scheme] = key.sort_values(["worst", "median", "parameters", "order"])["rule"].iloc[0]
    return chosen


def markdown(table: pd.DataFrame) -> str:
    """A summary() as the decision record's Markdown table, to 3 significant figures."""
    head = ("| scheme | rule | parameters | fixed-shape steady calls (gives back) | held-out median, max "
            "| tuned median, max | near best |\n|---|---|---|---|---|---|---|")
    lines = [f"| {r.scheme} | {r.rule} | {r.parameters} | {r.fixed_steady_calls} ({r.fixed_steady_unmaps}) "
             f"| {r.held_out_median:#.3g}, {r.held_out_max:#.3g} | {r.tuned_median:#.3g}, {r.tuned_max:#.3g} "
             f"| {r.share_near_best:#.3g} |" for r in table.itertuples()]
    return "\n".join([head, *lines])


def _sig3(x: float) -> float:
    """x to 3 significant figures."""
    return float(f"{x:.3g}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help=f"CSV to write (default: {PRODUCT_OUT}; with --summary, the CSV read: "
                                 f"{DEFAULT_OUT})")
    p.add_argument("--traces", help="comma-separated trace names (default: every recorded trace)")
    p.add_argument("--jobs", type=int, help="worker processes (default: one per CPU)")
    p.add_argument("--summary", action="store_true", help="summarise the CSV at --out; replay nothing")
    p.add_argument("--markdown", action="store_true", help="print the summary as the decision record's table")
    a = p.parse_args(argv)
    if a.summary:
        df = pd.read_csv(a.out or DEFAULT_OUT)
    else:
        df = study(a.traces.split(",") if a.traces else None, a.jobs)
        publish(df, a.out or PRODUCT_OUT)
    table = summary(df)
    if a.markdown:
        print(markdown(table))
        return 0
    with pd.option_context("display.width", 200, "display.max_columns", 30, "display.float_format", "{:.3g}".format):
        print(table.to_string(index=False))
    if set(df["build"].astype(str)) != {PRODUCT}:
        print("chosen:", ", ".join(f"{scheme}: {rule}" for scheme, rule in choose(table).items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
