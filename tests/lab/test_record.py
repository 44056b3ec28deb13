"""The record in the tree: the decision records (docs/decisions/) and the usage page (docs/usage.md) quote numbers
only from committed CSVs (each number is recomputed here from the CSV they name, with the lab's statistics,
xlab.intervals, and must appear in the page as printed: a CSV that changes, or a page that drifts from its CSV,
fails here); CHANGELOG.md names commits of the dates it files them under; NOTES.md and the logs stay out of the
tree (tag record-2026-12-05)."""
import os
import pathlib
import re
import subprocess

import pandas as pd
import pytest

from xlab import intervals as iv
from xlab import sources
from xlab.shared import INTERVAL_TRIALS

ROOT = pathlib.Path(__file__).resolve().parents[2]
DATA, DECISIONS = ROOT / "data", ROOT / "docs" / "decisions"


def record(number: str) -> str:
    """The text of docs/decisions/<number>-*.md (exactly one such file), or of docs/usage.md for "usage"."""
    if number == "usage":
        return (ROOT / "docs" / "usage.md").read_text()
    found = sorted(DECISIONS.glob(f"{number}-*.md"))
    assert len(found) == 1, f"one record {number}, found {[p.name for p in found]}"
    return found[0].read_text()


def csv(name: str) -> pd.DataFrame:
    return pd.read_csv(DATA / name)


def ci(values, fmt="{:.3f}", scale=1.0) -> str:
    """'1.119 [1.099, 1.148]': the median of one value per trial with its 95% bootstrap interval (never over fewer
    than INTERVAL_TRIALS trials: `each` prints those)."""
    m, lo, hi, n = iv.median_ci(pd.Series(values, dtype=float) * scale)
    assert n >= INTERVAL_TRIALS, f"an interval over {n} trials: print the values (each)"
    return iv.fmt_ci(m, lo, hi, fmt)


def each(values, fmt="{:.3f}", scale=1.0, unit="", median=None) -> str:
    """'1.481 (1.214, 1.465, 1.496, 1.507)': over fewer than INTERVAL_TRIALS trials, no interval: the median (or
    `median`, a ratio of medians) and each trial's value, sorted; 'x (every trial)' where they print alike."""
    v = (pd.Series(values, dtype=float) * scale).dropna()
    assert 1 < len(v) < INTERVAL_TRIALS, f"{len(v)} trials: an interval (ci) from {INTERVAL_TRIALS}"
    said = [fmt.format(x) for x in sorted(v)]
    m = fmt.format(v.median() if median is None else median)
    return f"{m}{unit} (" + ("every trial" if len(set(said)) == 1 else ", ".join(said)) + ")"


def ratio(numerator, denominator, fmt="{:.3f}") -> str:
    """The ratio of the medians over paired trials, 'r× [lo, hi]' from INTERVAL_TRIALS pairs, else with each pair's
    ratio (each)."""
    a, b = (pd.Series(x, dtype=float).reset_index(drop=True) for x in (numerator, denominator))
    r, lo, hi, n = iv.ratio_ci(a.to_numpy(), b.to_numpy())
    return iv.fmt_ci(r, lo, hi, fmt, "×") if n >= INTERVAL_TRIALS else each(a / b, fmt, unit="×", median=r)


def table_row(df, workload, arms) -> str:
    """'| workload | a | b | ... |': peak reserved / peak requested per arm, median [interval] over its trials."""
    g = df[df.workload == workload]
    return "| " + " | ".join([workload] + [ci(g[g.allocator == a].reserved_over_requested) for a in arms]) + " |"


CUPY_WORKLOADS = ("cupy_mix", "gpt_b4", "gpt_b32", "gpt_varlen")
CUPY_ARMS = ("xpool_segments", "xpool_expandable", "xpool_seed", "cupy_pool")
TORCH_WORKLOADS = ("torch_varlen", "torch_fixed", "resnet_varres", "resnet_fixed")
TORCH_ARMS = ("xpool_expandable", "xpool_segments", "torch", "torch_expandable")


def expected_0002() -> list[str]:
    df = csv("dynamic_shapes.csv")
    rows = df[df.workload.isin(CUPY_WORKLOADS)]
    return [f"`dynamic_shapes.csv` at {sources.run_label(rows)}",
            *(table_row(df, w, CUPY_ARMS) for w in CUPY_WORKLOADS)]


SCALE_ARMS = ("xpool_segments", "xpool_expandable", "cupy_torch_expandable")
SCALE_RUN_0002 = "f7709ef"
SCALE_RUN_0014 = "db0b678"     # the full scaled run 0014 quotes (5 trials, three caps, one H100)     # the scaled run 0002 was checked on (later runs are the records that follow it)


def expected_0002_at_scale() -> list[str]:
    """0002's check at scale: memory held per CuPy workload and arm, trials finished under the 1.10x cap, the
    refused request's error, expandable's ms per step over segments' paired by trial."""
    df, caps = csv("dynamic_scale.csv"), csv("memory_cap.csv")
    at = lambda d: d[d.commit.astype(str).str.startswith(SCALE_RUN_0002)]      # noqa: E731 - 0002's own run
    df, caps = at(df), at(caps)
    caps = caps[caps.cap_over_peak_requested == 1.1]
    done = lambda w, a: caps[(caps.workload == w) & (caps.allocator == a)].completed      # noqa: E731
    out = [f"`dynamic_scale.csv` and `memory_cap.csv` at {sources.run_label(df)}",
           *(f"| {w}{label} | " + " | ".join(each(df[(df.workload == w) & (df.allocator == a)].reserved_over_requested)
                                              for a in SCALE_ARMS) + " |"
             for w, label in (("cupy_mix", ": peak reserved / peak requested"), ("gpt_varlen", ": the same"))),
           "trials finished under a cap of 1.10× the peak requested | " + " | ".join(
               "; ".join(f"{done(w, a).sum()} of {len(done(w, a))}" for w in ("cupy_mix", "gpt_varlen"))
               for a in SCALE_ARMS) + " |"]
    error = caps[(caps.workload == "cupy_mix") & (caps.allocator == "xpool_segments")].oom_error.dropna()
    said = [m.group(0) for m in map(re.compile(r"in use [\d.]+ GiB, cached [\d.]+ GiB").search, error) if m]
    out.append(said[0] if said else "(no refused request's error in memory_cap.csv)")
    busy = {a: df[(df.workload == "cupy_mix") & (df.allocator == a)].gpu_util_mean for a in SCALE_ARMS[:2]}
    out.append("(expandable's steps {:.0f}-{:.0f}% GPU-busy, segments' {:.1f}-{:.1f}%)".format(
        *busy["xpool_expandable"].agg(["min", "max"]), *busy["xpool_segments"].agg(["min", "max"])))
    for w in ("cupy_mix", "gpt_varlen"):
        ms = df[df.workload == w].pivot_table(index="trial", columns="allocator", values="ms_per_step").dropna(
            subset=["xpool_segments", "xpool_expandable"])
        out.append(f"{w} {ratio(ms.xpool_expandable, ms.xpool_segments)}")
    return out


def expected_0003() -> list[str]:
    df = csv("dynamic_shapes.csv")
    rows = df[df.workload.isin(TORCH_WORKLOADS)]
    return [f"`dynamic_shapes.csv` at {sources.run_label(rows)}",
            *(table_row(df, w, TORCH_ARMS) for w in TORCH_WORKLOADS)]


def expected_0004() -> list[str]:
    hit = csv("hit_breakdown.csv").assign(ns_pair=lambda d: d.ns / d.calls)
    small = hit[hit.size_bytes == 4096]
    out = [f"`hit_breakdown.csv` at {sources.run_label(hit)}"]
    for arm in ("c_noop", "xpool", "cupy_pool", "xpool_old_lookup", "lookup_c", "old_lookup_c"):
        out.append(f"{arm}: {ci(small[small.arm == arm].ns_pair, '{:.0f}')} ns")
    split = csv("core_split_gpu.csv")
    out.append(f"`core_split_gpu.csv` at {sources.run_label(split)}")
    for arm in ("c_noop", "xpool"):
        g = split[(split.allocator == arm) & (split.size_bytes == 4096)]
        out.append(f"{arm} {ci(g.ratio_vs_cupy_pool)} at 4 KiB")
    x = split[split.allocator == "xpool"]
    worst = x.groupby("size_bytes").ratio_vs_cupy_pool.median().idxmin()
    out.append(f"{ci(x[x.size_bytes == worst].ratio_vs_cupy_pool)} at {iv.fmt_bytes(worst)}")
    return out


def expected_0006() -> list[str]:
    df = csv("vmm_capture_probe.csv")
    if "stream" in df:            # the decision read a non-blocking stream's capture (issue #50 added the others)
        df = df[df.stream == "non_blocking"]
    unmap, other = df[df.op == "unmap"], df[df.op.isin(["reserve", "map"])]
    return [f"`vmm_capture_probe.csv` at {sources.run_label(df)}",
            f"{int((~unmap.capture_ok).sum())} of {len(unmap)} unmap rows",
            f"{int(other.capture_ok.sum())} of {len(other)} reserve and map rows",
            f"{df['mode'].nunique()} capture modes"]


def expected_0005() -> list[str]:
    """The capture probe's answers to issue #50's open case (0005's last paragraph)."""
    df = csv("vmm_capture_probe.csv")

    def said(query: str, name: str) -> str:
        rows = df.query(query)
        return f"({int(rows.capture_ok.sum())} of {len(rows)} `{name}` rows"

    return [f"`vmm_capture_probe.csv` at {sources.run_label(df)}",
            said("op == 'unmap_only'", "unmap_only"),
            said("op == 'legacy_event' and stream == 'per_thread'", "legacy_event"),
            said("op == 'event_query' and exchange_to_relaxed", "event_query"),
            said("op == 'free' and exchange_to_relaxed", "free")]


def _failing(df, scheme, peer_access=None) -> str:
    g = df[(df.scheme == scheme) & (df.peer_access.isna() if peer_access is None else df.peer_access == peer_access)]
    return ", ".join(f"`{c}`" for c in g[~g.ok].case) or "none"


def expected_0007() -> list[str]:
    before, after, cost = csv("peer_probe_before.csv"), csv("peer_probe.csv"), csv("peer_map_cost.csv")
    every, none = (cost[cost.peer_access == a].set_index("trial").s_per_miss for a in ("all", "none"))
    m, lo, hi, n = iv.ratio_ci(every, none.loc[every.index])
    return [f"`peer_probe_before.csv` at {sources.run_label(before)}",
            f"segments failed {_failing(before, 'segments')}", f"expandable failed {_failing(before, 'expandable')}",
            f"`peer_probe.csv` at {sources.run_label(after)}",
            f"expandable (default) failed {_failing(after, 'expandable')}",
            f'`peer_access="none"` failed {_failing(after, "expandable", chr(34) + "none" + chr(34))}',
            f"`peer_map_cost.csv` at {sources.run_label(cost)}",
            f"{ci(every, '{:.0f}', 1e6)} µs", f"{ci(none, '{:.0f}', 1e6)} µs", f"{iv.fmt_ci(m, lo, hi, unit='×')} ({n} trials"]


def expected_0008() -> list[str]:
    df = csv("rerun/alloc_hit_sweep.csv")
    x, c = (df[(df.allocator == a) & (df.size_bytes == 4096)].set_index("trial") for a in ("xpool", "cupy_pool"))
    return [f"`rerun/alloc_hit_sweep.csv` at {sources.run_label(df)}",
            f"per-trial ratio {ci(x.ratio_vs_cupy_pool)}",
            f"ratio of the medians read {c.us_per_pair.median() / x.us_per_pair.median():.3f}",
            f"{int((x.ratio_vs_cupy_pool > 1).sum())} of {len(x)} trials",
            f"{c.us_per_pair.min():.2f} to {c.us_per_pair.max():.2f} µs"]


def expected_0009() -> list[str]:
    old, new = csv("alloc_microbench.csv"), csv("alloc_hit_sweep.csv")
    return [f"`alloc_hit_sweep.csv` (at {sources.run_label(new)},", f"`alloc_microbench.csv` (at {sources.run_label(old)})"]


def expected_0010() -> list[str]:
    df = csv("dynamic_shapes.csv")
    g = df[(df.workload == "torch_varlen")]
    out = [f"`dynamic_shapes.csv` at {sources.run_label(g)}"]
    for arm in ("xpool_expandable_growth", "xpool_expandable"):
        per_seed = g[g.allocator == arm].set_index("seed").reserved_over_requested.sort_index()
        out.append(f"`{arm}`: " + ", ".join(f"{v:.4f}" for v in per_seed) + " on seeds "
                   + ", ".join(str(s) for s in per_seed.index))
    return out


def expected_usage() -> list[str]:
    df = csv("alloc_debug_cost.csv")
    at = lambda arm, size: df[(df.allocator == arm) & (df.size_bytes == size)].us_per_pair     # noqa: E731
    return [f"`data/alloc_debug_cost.csv` at {sources.run_label(df)}, {df.trial.nunique()} trials",
            f"xpool_k1_debug took {each(at('xpool_k1_debug', 4096), '{:.1f}', unit=' µs')} at 4 KiB",
            f"{each(at('xpool_k1_debug', 1 << 20), '{:.1f}', unit=' µs')} at 1 MiB",
            f"xpool_k1's {each(at('xpool_k1', 4096), '{:.1f}', unit=' µs')} at 4 KiB"]


def expected_0012() -> list[str]:
    """The version the retired names left at: the CHANGELOG's heading over the entry that retires them."""
    version = None
    for line in (ROOT / "CHANGELOG.md").read_text().splitlines():
        if m := re.match(r"## \d{4}-\d\d-\d\d \((\d+\.\d+\.\d+)\)", line):
            version = m[1]
        elif line.startswith("- The retired names leave"):
            break
    assert version, "the CHANGELOG files the retired names' removal under no version"
    return [f"Retired names leave at {version}", f"Remove them at {version}"]


def expected_0013() -> list[str]:
    """The growth sequence's driver calls under each rule (xlab.bench.growth's models; the twin and a fake driver
    check xpool's in tests/xpool)."""
    from xlab.bench import growth
    sizes = growth.sequence()
    now, ahead, torch = (growth.xpool_driver_calls(sizes), growth.xpool_driver_calls(sizes, ahead=True),
                         growth.pytorch_driver_calls(sizes))
    row = lambda name, r: f"| {name} | {r['handles']:,} | {r['maps']:,} | {r['calls']:,} |"
    return [row("xpool before (a handle a page, 3 calls each)", growth.xpool_driver_calls(sizes, page_handles=True)),
            row("xpool now", now),
            row("PyTorch's rules (`pytorch_driver_calls`)", torch), row("what-if: xpool mapping whole handles", ahead),
            f"{now['calls'] / now['maps']:.2f} against {torch['calls'] / torch['maps']:.2f} calls per mapping miss",
            f"PyTorch maps {now['maps'] - torch['maps']} fewer times",
            f"makes {100 * (1 - torch['calls'] / now['calls']):.0f}% fewer calls"] + expected_0013_gpu()


def expected_0013_gpu() -> list[str]:
    """The GPU's growth run 0013 quotes: medians, the paired ratio to PyTorch's, runs mapped, a request's median."""
    from xlab.bench import growth
    s = growth.summary(csv("2026-12-08_f5a602a/growth.csv")).set_index("arm")
    x, t = s.loc["xpool_expandable"], s.loc["torch_expandable"]
    ratio = iv.fmt_ci(x.over_torch_expandable, x.ratio_lo, x.ratio_hi, "{:.3f}", "×")
    noise = "within noise" if x.ratio_lo <= 1 <= x.ratio_hi else "slower" if x.ratio_lo > 1 else "faster"
    return [f"5 trials interleaved) the growth took {x.total_s:.3f} s under xpool expandable, {t.total_s:.3f} s "
            "under PyTorch's expandable", f"paired {ratio}, {noise}",
            f"{s.loc['cupy_async', 'total_s']:.3f} s under cudaMallocAsync",
            f"{x.device_calls:,.0f} device calls against {t.device_calls:,.0f}",
            f"a request's median {x.us_per_request:.1f} µs against {t.us_per_request:.1f} µs"]


def expected_0014() -> list[str]:
    """0014's table: xlab.cupy_default_study's markdown of its CSV, row by row."""
    from xlab import cupy_default_study as cds
    out = [f"`{cds.DEFAULT_OUT.rpartition('/')[2]}`", *cds.markdown(csv("cupy_default_replays.csv")).splitlines(),
]
    v = cds.variants_summary(csv("cupy_default_variants.csv")).set_index(["workload", "scale", "candidate"])
    at = lambda w, s, c: int(v.loc[(w, s, c), "at_most_best_peer"])        # noqa: E731
    small, tail, both = "expandable_small_pool", "expandable_tail_last", "expandable_small_pool_tail_last"
    out += [f"Its small pool alone gives gpt_b4 {v.loc[('gpt_b4', 1, small), 'median']:.3f} but gpt_varlen "
            f"{v.loc[('gpt_varlen', 1, small), 'median']:.3f} ({at('gpt_varlen', 1, small)} of 5), "
            f"{int(v.loc[('gpt_varlen', 1, small), 'calls_after_warmup'])} maps after the warm-up",
            f"cupy_mix {at('cupy_mix', 1, tail)} of 5 at x1 but {at('cupy_mix', 216, tail)} of 5 at x216",
            f"both, {at('cupy_mix', 1, both)} of 5 but on gpt_varlen ({at('gpt_varlen', 1, both)}) and cupy_mix x216 "
            f"({at('cupy_mix', 216, both)})"]
    at = lambda d: d[d.commit.astype(str).str.startswith(SCALE_RUN_0014)]      # noqa: E731
    df, caps = at(csv("dynamic_scale.csv")), at(csv("memory_cap.csv"))
    peers = ["cupy_pool", "cupy_async", "rmm_pool", "cupy_torch_expandable"]
    said = []
    for w in ("cupy_mix", "gpt_varlen"):
        p = df[df.workload == w].pivot_table(index="trial", columns="allocator", values="reserved_over_requested")
        best = p[peers].min(axis=1)
        said.append(f"{w} {(p.xpool_segments <= best).sum()}; {(p.xpool_expandable <= best).sum()} of {len(p)}")
    out.append(", ".join(said))
    c = caps[caps.workload == "cupy_mix"].groupby(["allocator", "cap_over_peak_requested"]).completed
    done = lambda a: ", ".join(str(int(v)) for v in c.sum()[a]) + f" of {int(c.count()[a].iloc[0])}"  # noqa: E731
    out.append(f"segments {done('xpool_segments')}; expandable {done('xpool_expandable')}")
    ms = df[df.workload == "cupy_mix"].pivot_table(index="trial", columns="allocator", values="ms_per_step")
    r, lo, hi, _ = iv.ratio_ci(ms.xpool_expandable.to_numpy(), ms.xpool_segments.to_numpy())
    out.append(iv.fmt_ci(r, lo, hi, '{:.3f}', '×') + (" (within noise)" if lo <= 1 <= hi else
                                                      " (slower)" if lo > 1 else " (faster)"))
    return out


EXPECTED = {"usage": expected_usage, "0002": lambda: expected_0002() + expected_0002_at_scale(),
            "0003": expected_0003, "0005": expected_0005, "0004": expected_0004, "0006": expected_0006, "0007": expected_0007,
            "0008": expected_0008, "0009": expected_0009, "0010": expected_0010, "0012": expected_0012,
            "0013": expected_0013, "0014": expected_0014}


@pytest.mark.parametrize("number", sorted(EXPECTED))
def test_every_number_a_record_quotes_is_its_csvs(number):
    text = " ".join(record(number).split())           # line breaks are spaces
    for piece in EXPECTED[number]():
        assert piece in text, f"{number}: {piece!r} is not in the page"


def test_every_record_has_its_parts_and_names_its_evidence():
    """Context, decision, evidence; one page; the evidence names a CSV under data/, a test or a notebook that
    exists; numbered from 0002 (0001 is the release rules' record)."""
    for path in sorted(DECISIONS.glob("[0-9][0-9][0-9][0-9]-*.md")):
        text = path.read_text()
        assert text.startswith(f"# {path.name[:4]}: "), path.name
        for part in ("## Context", "## Decision", "## Evidence"):
            assert part in text, (path.name, part)
        assert len(text.splitlines()) <= 60, (path.name, "over a page")
        evidence = text.split("## Evidence", 1)[1]
        named = re.findall(r"`((?:rerun/|graph/)?[a-z0-9_]+\.csv)`", evidence)
        files = re.findall(r"`((?:tests|notebooks|lab)/[\w/.]+\.(?:py|ipynb))", evidence)
        assert named or files, (path.name, "names no evidence")
        for name in named:
            assert (DATA / name).is_file(), (path.name, name)
        for name in files:
            assert (ROOT / name).is_file(), (path.name, name)


def test_every_record_with_numbers_is_checked_here():
    """A record that quotes a decimal is in EXPECTED, so its numbers are recomputed."""
    for path in sorted(DECISIONS.glob("[0-9][0-9][0-9][0-9]-*.md")):
        if path.name.startswith("0001-"):
            continue                 # the release rules' record, checked by its own study's tests
        if re.search(r"\d\.\d", path.read_text()):
            assert path.name[:4] in EXPECTED, path.name


def test_the_changelog_files_each_commit_under_its_date():
    """Every commit CHANGELOG.md names under a date heading exists, authored that day (UTC)."""
    if subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True,
                      text=True).stdout.strip() != "false":
        pytest.skip("needs the whole history")
    date, seen = None, 0
    for line in (ROOT / "CHANGELOG.md").read_text().splitlines():
        if m := re.match(r"## (\d{4}-\d\d-\d\d)", line):
            date = m[1]
            continue
        for commit in re.findall(r"\b[0-9a-f]{7}\b", line) if date else ():
            got = subprocess.run(["git", "log", "-1", "--format=%ad", "--date=format-local:%Y-%m-%d", commit],
                                 cwd=ROOT, capture_output=True, text=True, env={**os.environ, "TZ": "UTC"})
            assert got.returncode == 0 and got.stdout.strip() == date, (commit, date, got.stdout.strip())
            seen += 1
    assert seen > 50


def test_the_record_stays_out_of_the_tree():
    """The lab's notes, run logs and scripts of past runs are in git history (tag record-2026-12-05), not here."""
    for path in ("NOTES.md", "docs/tuning.md", "docs/past-runs", "data/logs"):
        assert not (ROOT / path).exists(), path
    assert "record-2026-12-05" in (ROOT / "CHANGELOG.md").read_text()
    assert "record-2026-12-05" in (ROOT / "docs" / "README.md").read_text()


def test_the_notes_beside_the_code_are_short_and_named_once():
    """A `# Note [Name]` in lab/ or workload/ is at most 40 lines and defined once: it explains the code beside it,
    and the history stays in git."""
    found = {}
    for path in sorted([*(ROOT / "lab").rglob("*.py"), *(ROOT / "workload").rglob("*.py")]):
        lines = path.read_text().split("\n")
        for i, line in enumerate(lines):
            if m := re.match(r"\s*# Note \[(.+)\]\s*$", line):
                n = 1
                while i + n < len(lines) and lines[i + n].lstrip().startswith("#"):
                    n += 1
                assert n <= 40, (path.name, m[1], n)
                found.setdefault(m[1], []).append(path.name)
    assert len(found) >= 10 and all(len(v) == 1 for v in found.values()), found
