"""Figures check themselves: every figure is drawn from small SYNTHETIC CSVs, and each bar's and point's value, its
tick label and its legend label are read back from the matplotlib axes and compared with the medians the CSVs
give (computed here with pandas, from the newest CSV of each kind that has the arm: what the figure must show).

The readback knows nothing of how a figure is drawn: bars are the axes' BarContainer patches, points the data of
its Line2D artists; which arm an artist is comes from the legend (its handle's colour, hatch and marker), which
configuration from the nearest tick label."""
import itertools
import math
import pathlib
import re

import numpy as np
import pandas as pd
import pytest
import seaborn as sns
from matplotlib.colors import to_hex
from matplotlib.container import BarContainer, ErrorbarContainer
from matplotlib.patches import Patch

from lab_fixtures import synthetic
from xlab import plots
from xlab.shared import FRONT_END_NAMES

try:                                   # the arms table; an older lab named its labels in plots
    from xlab.allocators import by_scheme, canonical, label as arm_label
except ImportError:
    def arm_label(a):
        return plots.style(a)["label"]

    def canonical(df):
        return df

    def by_scheme(df):
        return df

MODES = {v: k for k, v in plots.MODES.items()}
SIZES = {plots.fmt_bytes(n): n for n in (4 << 10, 64 << 10, 1 << 20, 12 << 20, 96 << 20, 64 << 20)}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    synthetic.write_all(d, trials=5)
    synthetic.correctness("cpu").assign(gpu="none").to_csv(d / "correctness_cpu.csv", index=False)
    return d


def _draw(name, data):
    draw = getattr(plots, "draw", None) or (lambda n, d: plots.FIGURES[n][1](plots.load_for(n, d)))
    return draw(name, data)


def newest(data, *csvs, arm="allocator", keys=(), arms=None):
    """What a figure must show: for each arm (and configuration), the rows of the last CSV listed that has it (of
    `arms` only, where given)."""
    frames = [pd.read_csv(data / f"{c}.csv").assign(_order=i) for i, c in enumerate(csvs)
              if (data / f"{c}.csv").is_file()]
    df = canonical(pd.concat(frames, ignore_index=True))      # the names of today (allocators.LEGACY)
    df = df if arms is None else df[df[arm].isin(arms)]
    by = [arm, *keys]
    return df[df["_order"] == df.groupby(by)["_order"].transform("max")]


def newest_run(df, by=("allocator", "workload")):
    """A CSV that holds several runs (dynamic_scale, memory_cap): for each arm and workload, the rows of its newest
    run (the commit whose rows are dated last); a CSV of one run as it is."""
    if "commit" not in df or df["commit"].nunique() < 2:
        return df
    dated = df.assign(_d=df["commit"].map(df.groupby("commit")["date"].max()))
    return df[dated["_d"] == dated.groupby(list(by))["_d"].transform("max")]


# --- readback


def _key(artist):
    if isinstance(artist, ErrorbarContainer):
        artist = artist.lines[0]
    if isinstance(artist, Patch):
        return ("patch", to_hex(artist.get_facecolor()), artist.get_hatch() or "")
    if hasattr(artist, "get_marker"):
        return ("line", to_hex(artist.get_color()), str(artist.get_marker()))
    return ("other", id(artist))


def legend(fig, ax) -> dict:
    """{artist key: legend text} from the axes' legend and the figure's."""
    out = {}
    for leg in [ax.get_legend(), *fig.legends]:
        if leg is not None:
            for text, handle in zip(leg.get_texts(), leg.legend_handles):
                out.setdefault(_key(handle), text.get_text().replace("\n", " "))     # a long label, wrapped
    return out


def _name(a: str, framework: str | None = None) -> str:
    """An arm's one name: its front end's ("xpool (CuPy)") where it is that front end's default, else its label."""
    from xlab import shared
    return shared.FRONT_END_NAMES[framework] if framework and a == shared.default_arm(framework) else arm_label(a)


def arm_of(text: str, arms, framework: str | None = None) -> str:
    """The arm whose name the legend text is (the longest it starts with: a label may add qualifiers or the run);
    `framework`: the front end whose default arm is named for it."""
    found = [a for a in arms if text == _name(a, framework) or text.startswith(_name(a, framework) + " ·")]
    assert found, f"legend entry {text!r} names none of {sorted(arms)}"
    return max(found, key=lambda a: len(_name(a, framework)))


def read_bars(fig, ax):
    """[(legend text, tick text, height)] of every finite bar."""
    names = legend(fig, ax)
    ticks = [(t, lab.get_text()) for t, lab in zip(ax.get_xticks(), ax.get_xticklabels())]
    out = []
    for c in ax.containers:
        if isinstance(c, BarContainer):
            for p in c.patches:
                if np.isfinite(p.get_height()):
                    x = p.get_x() + p.get_width() / 2
                    out.append((names.get(_key(p)), min(ticks, key=lambda t: abs(t[0] - x))[1], p.get_height()))
    return out


def read_lines(fig, ax):
    """[(legend text, x, y)] of every point of every line that a legend entry names."""
    names = legend(fig, ax)
    out = []
    for line in ax.lines:
        name = names.get(_key(line))
        if name is not None and line.get_marker() not in ("None", "", None):
            out += [(name, x, y) for x, y in line.get_xydata() if np.isfinite(y)]
    return out


def check(drawn, expected: dict, what):
    """Every drawn value is its configuration's median, and every expected one is drawn."""
    got = {}
    for key, value in drawn:
        assert key in expected, f"{what}: drew {key} = {value}, which the CSV has not"
        assert value == pytest.approx(expected[key], rel=1e-9, abs=1e-12), f"{what}: {key}"
        got[key] = value
    assert set(got) == set(expected), f"{what}: not drawn: {sorted(set(expected) - set(got))}"


def medians(df, arm, keys, metric, scale=1.0):
    return {(a, *k): v * scale for (a, *k), v in df.groupby([arm, *keys])[metric].median().items()}


def bar_panel(fig, ax, df, x, metric, tick, arm="allocator", scale=1.0):
    arms = set(df[arm])
    drawn = [((arm_of(lab, arms), tick(t)), h) for lab, t, h in read_bars(fig, ax)]
    check(drawn, {(a, k): v for (a, k), v in medians(df, arm, [x], metric, scale).items()}, f"{ax.get_title()!r}")


def line_panel(fig, ax, df, x, metric, arm="allocator"):
    arms = set(df[arm])
    drawn = [((arm_of(lab, arms), xv), y) for lab, xv, y in read_lines(fig, ax)]
    check(drawn, {(a, k): v for (a, k), v in medians(df, arm, [x], metric).items()}, f"{ax.get_title()!r}")


# --- the figures


def test_every_figure_is_checked():
    assert set(plots.FIGURES) == set(CHECKS)


def check_ddp_before_after(fig, data):
    """Every arm from one run: the newest CSV of the lineage that measured raw cudaMalloc, all of its arms."""
    runs = [c for c in ("ddp_scaling", "ddp_expandable") if (data / f"{c}.csv").is_file()
            and "raw" in set(pd.read_csv(data / f"{c}.csv")["allocator"])]
    df = canonical(pd.read_csv(data / f"{runs[-1]}.csv"))
    top = df[(df["mode"] != "single") & (df["world"] == df["world"].max())]
    sp, ut = fig.axes[:2]
    bar_panel(fig, sp, top, "mode", "speedup", MODES.__getitem__)
    bar_panel(fig, ut, top, "mode", "gpu_util_mean", MODES.__getitem__)
    data_line = fig._supxlabel.get_text().splitlines()[0]
    assert data_line.count(".csv") == 1 and f"{runs[-1]}.csv" in data_line          # one run, named


_ONE_GPU_ARMS = ("raw", "cupy_pool", "xpool", "xpool_seed")


def check_single_gpu(fig, data):
    csvs = ("single_gpu", "single_gpu_recheck", "graph/single_gpu", "2026-12-07_db0b678/single_gpu",
            "2026-12-08_f5a602a/single_gpu")
    df = newest(data, *csvs, keys=("batch",), arms=_ONE_GPU_ARMS)
    cols = ["tokens_per_s", "host_ms_per_step", "gpu_ms_per_step", "gpu_util_mean", "device_mallocs_per_step",
            "reserved_over_requested"]
    for ax, col in zip(fig.axes, cols):
        bar_panel(fig, ax, df.dropna(subset=[col]), "batch", col, lambda t: int(t.split()[1]))
    data_lines = fig._supxlabel.get_text().split("Measured on")[0]       # arms of several runs: the caption says whose
    for i in sorted(set(df["_order"])):                                   # each CSV whose rows are drawn
        assert f"{csvs[i]}.csv at " in data_lines


def test_no_legend_names_a_commit_unless_it_sets_runs_side_by_side(data):
    """Labels are the arms'; the caption names each CSV, its commit and its arms (the old dynamic figure's legend
    carried commit hashes). Only a figure whose rows hold several runs names, after " · run ", each arm's runs in
    its legend entry (issue #52: arms of different runs side by side say so in place), and those are runs its rows
    hold."""
    for name in plots.FIGURES:
        fig = plots.draw(name, data)
        texts = [t.get_text() for leg in [*fig.legends, *(ax.get_legend() for ax in fig.axes)] if leg is not None
                 for t in leg.get_texts()]
        rows = plots.rows(name, data)
        runs = set(rows["run"].astype(str)) if rows is not None and "run" in rows else set()
        for t in texts:
            label, _, named = t.partition(" · run ")
            assert not ("synthetic" in label or re.search(r"\b[0-9a-f]{7,12}\b", label)), (name, t)
            if named:
                assert len(runs) > 1 and set(named.split("/")) <= runs, (name, t, runs)


def check_graph_steps(fig, data):
    df = pd.concat([pd.read_csv(data / f"graph/{n}.csv") for n in ("single_gpu", "single_gpu_b4", "ddp_scaling")])
    thr = df[(df["mode"] == "threads") & (df["world"] == df["world"].max())]
    single = df[df["mode"] == "single"]
    for ax, rows, col in zip(fig.axes, (thr, single, single[single["batch"] == single["batch"].min()]),
                             ("speedup", "dispatch_ms_per_step", "gpu_util_mean")):
        bar_panel(fig, ax, rows, "batch", col, lambda t: int(t.split()[1]))


_ALLOC_ARMS = ("raw", "raw_held", "noop", "c_noop", "cupy_pool", "cupy_torch", "cupy_async", "xpool", "xpool_seed",
               "xpool_expandable")


def check_alloc_cost(fig, data):
    df = newest(data, "alloc_microbench", "alloc_hit_sweep", "alloc_hit_sweep_repeat", "core_split_gpu",
                "2026-12-07_db0b678/alloc_microbench", "2026-12-08_f5a602a/alloc_microbench", keys=("size_bytes",),
                arms=_ALLOC_ARMS)
    df = df[df["sweep"] == "size"]
    cost, rel = fig.axes[:2]
    line_panel(fig, cost, df, "size_bytes", "us_per_pair")
    r = df[~df["allocator"].isin(["raw", "raw_held", "cupy_pool"])]       # speed-up: CuPy's time / the arm's
    line_panel(fig, rel, r, "size_bytes", "ratio_vs_cupy_pool")
    assert "above 1: faster" in rel.get_ylabel()
    assert [t.get_text() for t in cost.get_xticklabels()] == [plots.fmt_bytes(n) for n in sorted(df["size_bytes"].unique())]


def check_alloc_threads(fig, data):
    df = newest(data, "alloc_microbench", "alloc_hit_threads", "2026-12-07_db0b678/alloc_microbench",
                "2026-12-08_f5a602a/alloc_microbench", keys=("threads",))
    line_panel(fig, fig.axes[0], df[(df["sweep"] == "threads") & (df["size_bytes"] == 65536)], "threads",
               "kpairs_per_s")


def check_ddp_scaling(fig, data):
    df = newest(data, "ddp_scaling", "ddp_expandable", keys=("mode", "world"))
    df = df[df["mode"] != "single"]
    modes = [m for m in ("threads", "processes") if m in set(df["mode"])]
    for j, mode in enumerate(modes):
        top, bottom = fig.axes[j], fig.axes[len(modes) + j]
        assert top.get_title() == plots.MODES[mode]
        line_panel(fig, top, df[df["mode"] == mode], "world", "tokens_per_s")
        line_panel(fig, bottom, df[df["mode"] == mode], "world", "speedup")


def check_batch_sweep(fig, data):
    df = newest(data, "batch_sweep", "graph/batch_sweep", keys=("world", "batch"))
    sp, ms = fig.axes[:2]
    line_panel(fig, sp, df[df["world"] == df["world"].max()], "batch", "speedup")
    one = df[(df["world"] == 1) & (df["allocator"] == "xpool")]
    assert one.empty or ms.lines


def check_torch_interop(fig, data):
    df = by_scheme(canonical(pd.read_csv(data / "torch_interop.csv")))   # xpool drawn as its pool's scheme
    left, right = fig.axes[:2]
    bar_panel(fig, left, df[df["case"] == "empty_del"], "size_bytes", "value", SIZES.__getitem__, arm="arm")
    bar_panel(fig, right, df[df["case"] == "train_step"].assign(x="training step"), "x", "value", str, arm="arm",
              scale=1e-3)


def check_memory_waste(fig, data):
    df = pd.read_csv(data / "memory_waste.csv")
    drawn = {}
    for lab, tick, h in read_bars(fig, fig.axes[0]):
        col = "class_over_requested" if lab.startswith("size classes") else "reserved_over_requested"
        drawn[(col, int(tick.split("=")[1]))] = h
    check(drawn.items(), {(c, int(k)): 100 * (v - 1) for c in ("class_over_requested", "reserved_over_requested")
                          for k, v in df.groupby("k")[c].median().items()}, "memory waste")
    assert "seed scheme" in fig.legends[0].get_title().get_text() if fig.legends else "seed" in fig._suptitle.get_text()


def check_memory_schemes(fig, data):
    df = pd.read_csv(data / "memory_schemes.csv")
    df["w"] = (100 * (df["reserved_over_requested"] - 1)).clip(lower=0.01)
    labels = {plots.trace_label(t): t for t in df["trace"]}
    waste, cost = fig.axes[:2]
    bar_panel(fig, waste, df, "trace", "w", labels.__getitem__)
    bar_panel(fig, cost, df.dropna(subset=["ns_per_pair"]), "trace", "ns_per_pair", labels.__getitem__)


def check_memory_timeline(fig, data):
    df = pd.read_csv(data / "memory_timeline.csv")
    whole = fig.axes[0]
    reserved = next(ln for ln in whole.lines if to_hex(ln.get_color()) == "#d62728")
    assert np.allclose(reserved.get_ydata(), df["bytes_reserved"] / 2**30)
    assert "seed scheme" in (fig.legends[0].get_title().get_text() if fig.legends else fig._suptitle.get_text())


_DYN_PEERS = ("cupy_pool", "cupy_async", "rmm_pool", "cupy_torch_expandable", "torch", "torch_expandable")
_DYN_XPOOL = ("xpool_segments", "xpool_expandable")          # the product's schemes drawn (the seed scheme is not)
_DEFAULTS = {"CuPy programs": ("cupy", "xpool_segments"), "PyTorch programs": ("torch", "xpool_expandable")}


def _dynamic_check(fig, data, expected, csv="dynamic_shapes"):
    """Both panels: their bars are `expected(rows of the panel's front end)` per (workload, arm); the front end's
    default is marked (its label says so, its bars outlined thicker) and no legend names a commit."""
    df = newest_run(pd.read_csv(data / f"{csv}.csv"))
    df = df[df["allocator"].isin(_DYN_PEERS + _DYN_XPOOL)]
    assert [ax.get_title(loc="left") for ax in fig.axes] == list(_DEFAULTS)
    for ax in fig.axes:
        f, default = _DEFAULTS[ax.get_title(loc="left")]
        rows = df[df["framework"] == f]
        arms = set(rows["allocator"])
        drawn = [((arm_of(lab, arms, f), t.partition("\n")[0]), h) for lab, t, h in read_bars(fig, ax)]
        check(drawn, expected(rows), ax.get_title(loc="left"))
        texts = [t.get_text().replace("\n", " ") for t in ax.get_legend().get_texts()]
        marked = [t for t in texts if t.startswith(FRONT_END_NAMES[f])]             # the default: the front end's
        assert len(marked) == 1 and arm_of(marked[0], arms, f) == default, texts    # name, no other entry has it
        assert not any("default" in t for t in texts), texts                        # no arm called "default"
        assert not any(re.search(r"\b[0-9a-f]{7,}\b", t) for t in texts), texts       # no commit in a legend
        widths = {arm_of(lab, arms, f): p.get_linewidth() for c, lab in zip(ax.containers, texts) for p in c.patches}
        assert widths[default] > max(w for a, w in widths.items() if a != default)


def check_dynamic_shapes(fig, data):
    def held(rows):
        pct = rows.assign(h=(100 * (rows["reserved_over_requested"] - 1)).clip(lower=0.01))
        return {k: v for k, v in pct.groupby(["allocator", "workload"])["h"].median().items()}
    _dynamic_check(fig, data, held)


def check_dynamic_scale(fig, data):
    """The scaled runs (issue #46) as dynamic_shapes draws the benchmark's: memory held per workload and arm, each
    workload's tick naming its factor and its peak requested, the title the span of peaks."""
    def held(rows):
        pct = rows.assign(h=(100 * (rows["reserved_over_requested"] - 1)).clip(lower=0.01))
        return {k: v for k, v in pct.groupby(["allocator", "workload"])["h"].median().items()}
    _dynamic_check(fig, data, held, "dynamic_scale")
    df = newest_run(pd.read_csv(data / "dynamic_scale.csv"))

    def gib(rows):
        lo, hi = (f"{v / 2**30:.2g}" for v in (rows["peak_requested_bytes"].min(), rows["peak_requested_bytes"].max()))
        return lo if lo == hi else f"{lo}-{hi}"
    for ax in fig.axes:
        for t in ax.get_xticklabels():
            w, _, said = t.get_text().partition("\n")
            rows = df[df["workload"] == w]
            assert said == f"(×{rows['scale'].iloc[0]}, {gib(rows)} GiB requested)"
    title = fig.legends[0].get_title().get_text() if fig.legends else fig._suptitle.get_text()
    assert title.startswith(f"Dynamic shapes at {gib(df)} GiB requested:")


def read_grid(ax) -> dict:
    """{(arm label, workload, cap tick): (cell text, its colour's value)} of a grid panel (memory_cap): the cells'
    texts where the image has them, the rows' labels from the y ticks, each column's cap from its x tick and its
    workload from the names above the columns (white lines part them)."""
    rows = [t.get_text().replace("\n", " ") for t in ax.get_yticklabels()]
    caps = [t.get_text() for t in ax.get_xticklabels()]
    heads = sorted((t.get_position()[0], t.get_text()) for t in ax.texts if not re.fullmatch(r"\d+/\d+", t.get_text()))
    parts = sorted(ln.get_xdata()[0] for ln in ax.lines)
    image = ax.images[0].get_array()
    out = {}
    for t in ax.texts:
        if re.fullmatch(r"\d+/\d+", t.get_text()):
            j, i = (int(round(v)) for v in t.get_position())
            workload = heads[sum(p < j for p in parts)][1]
            out[(rows[i], workload, caps[j])] = (t.get_text(), float(image[i, j]))
    return out


def check_memory_cap(fig, data):
    """Each front end's grid: every cell is the trials its arm finished under its cap of those it ran, coloured by
    that share; the default's row is labelled and outlined; the title names the caps."""
    df = newest_run(pd.read_csv(data / "memory_cap.csv"))
    assert [ax.get_title(loc="left") for ax in fig.axes] == list(_DEFAULTS)
    for ax in fig.axes:
        f, default = _DEFAULTS[ax.get_title(loc="left")]
        rows = df[df["framework"] == f]
        arms = set(rows["allocator"])
        drawn = {(arm_of(lab, arms, f), w, c): cell for (lab, w, c), cell in read_grid(ax).items()}
        expected = {}
        for (a, w, c), g in rows.groupby(["allocator", "workload", "cap_over_peak_requested"]):
            k, n = int(g["completed"].sum()), g["trial"].nunique()
            expected[(a, w, f"{c:.2f}×")] = (f"{k}/{n}", k / n)
        assert drawn == expected, ax.get_title(loc="left")
        labels = [t.get_text().replace("\n", " ") for t in ax.get_yticklabels()]
        marked = [t for t in labels if t.startswith(FRONT_END_NAMES[f])]              # the default: the front end's
        assert len(marked) == 1 and arm_of(marked[0], arms, f) == default, labels    # name, no other row has it
        assert not any("default" in t for t in labels), labels                       # no arm called "default"
        (box,) = [p for p in ax.patches if p.get_linewidth() > 2]                     # the default's row outlined
        assert box.get_y() + box.get_height() / 2 == pytest.approx([arm_of(t, arms, f) for t in labels].index(default))
    caps = ", ".join(f"{c:.2f}×" for c in sorted(df["cap_over_peak_requested"].unique()))
    title = fig.legends[0].get_title().get_text() if fig.legends else fig._suptitle.get_text()
    assert f"caps of {caps} its peak requested" in title


def check_dynamic_calls(fig, data):
    _dynamic_check(fig, data, lambda rows: dict(rows.groupby(["allocator", "workload"])
                                                ["device_calls_per_steady_step"].median().items()))


def check_dynamic_speed(fig, data):
    def speedup(rows):
        """The fastest peer's median ms over each arm's, over the trials both ran (ratio of medians)."""
        per = rows.groupby(["workload", "allocator", "trial"])["ms_per_step"].median()
        out = {}
        for w, g in rows.groupby("workload"):
            ref = g[g["allocator"].isin(_DYN_PEERS)].groupby("allocator")["ms_per_step"].median().idxmin()
            for a in g["allocator"].unique():
                common = per[w][a].index.intersection(per[w][ref].index)
                out[(a, w)] = per[w][ref][common].median() / per[w][a][common].median()
        return out
    _dynamic_check(fig, data, speedup)


def check_correctness(fig, data):
    df = pd.concat([pd.read_csv(data / f"correctness_{d}.csv") for d in ("cpu", "gpu")], ignore_index=True)
    assert len(fig.axes) == df["device"].nunique()
    for ax in fig.axes:
        g = df[df["device"] == ax.get_title(loc="left").split(":")[0].lower()]
        assert ax.get_title(loc="left") == f"{g['device'].iloc[0].upper()}: {int(g['passed'].sum())} of {len(g)} checks pass"
        ticks = [t.get_text() for t in ax.get_yticklabels()]
        n = sum(int(t.rsplit("(", 1)[1].split(" of ")[1].rstrip(")")) for t in ticks)
        assert n == len(g)                                   # every check is in one family's count
        points = {round(y): x for c in ax.collections for x, y in c.get_offsets()}    # a point per family, log x
        for i, t in enumerate(ticks):
            fam = t.rsplit(" (", 1)[0]
            rows = g[g["check"].map(plots.family) == fam] if hasattr(plots, "family") else g[g["check"] == fam]
            tol = rows[rows["threshold"] > 0]
            if len(tol) and (tol["measured"] > 0).any():
                assert points[i] == pytest.approx((tol["measured"] / tol["threshold"]).max()), t
            elif (rows["measured"] == 0).all():                              # a zero: one label, exact or not
                assert i not in points and any(tx.get_text() == "measured 0 ✓" and round(tx.xy[1]) == i
                                               for tx in ax.texts), t


CHECKS = {name[len("check_"):]: fn for name, fn in globals().items() if name.startswith("check_")}


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_figure_shows_the_csvs_medians(name, data):
    fig = _draw(name, data)
    CHECKS[name](fig, data)
    assert not math.isnan(fig.get_figwidth())


# --- what every figure has, beside its numbers


def _all_text(fig) -> str:
    parts = [t.get_text() for t in fig.texts]
    for t in (fig._suptitle, fig._supxlabel):
        if t is not None:
            parts.append(t.get_text())
    parts += [leg.get_title().get_text() for leg in fig.legends]
    return "\n".join(parts)


@pytest.mark.parametrize("name", sorted(plots.FIGURES))
def test_figure_has_title_labels_and_a_caption_naming_csv_and_machine(name, data, tmp_path):
    fig = plots.draw(name, data)
    text = _all_text(fig)
    assert "SYNTHETIC GPU" in text and "2000-01-01" in text and "Data: " in text
    axes = [ax for ax in fig.axes if ax.has_data()]
    assert axes and all(ax.get_ylabel() or any(o.get_ylabel() for o in ax.get_shared_y_axes().get_siblings(ax))
                        or any(t.get_text() for t in ax.get_yticklabels()) for ax in axes)
    assert all(ax.get_xlabel() or [t.get_text() for t in ax.get_xticklabels()] for ax in axes)
    png, svg = plots.save(fig, name, tmp_path)
    assert png.stat().st_size > 10_000 and svg.stat().st_size > 10_000


def test_a_csv_without_trials_draws_no_interval_and_says_so(tmp_path):
    synthetic.write_all(tmp_path, trials=0)
    fig = plots.draw("single_gpu", tmp_path)
    assert "no interval" in _all_text(fig)
    assert "95% bootstrap interval" in _all_text(plots.draw("single_gpu", _trials(tmp_path / "t")))


def _trials(path):
    synthetic.write_all(path, trials=5)
    return path


def test_build_all_skips_missing_csvs_and_writes_only_where_told(tmp_path):
    built = plots.build_all(tmp_path / "nothing", tmp_path / "figures")
    assert all(str(v).startswith("skipped") for v in built.values())
    assert not (tmp_path / "figures").exists()


def test_the_scaled_figures_wait_for_their_csvs_and_show_a_run_under_way(data, tmp_path):
    """Issue #46's figures: not built without their CSVs (nothing written), and from a run under way (two trials,
    one cap) its medians without an interval, the caption saying how many trials; five trials draw intervals."""
    synthetic.write_all(tmp_path / "none", trials=5, scaled=0)
    for name in ("dynamic_scale", "memory_cap"):
        assert str(plots.build(name, tmp_path / "none", tmp_path / "figures")).startswith("skipped")
    assert not (tmp_path / "figures").exists()
    synthetic.write_all(tmp_path / "partial", trials=5, scaled=2, caps=(1.10,))
    fig = plots.draw("dynamic_scale", tmp_path / "partial")
    check_dynamic_scale(fig, tmp_path / "partial")
    assert not any(_interval_tops(ax) for ax in fig.axes)
    assert "2 of 5 trials so far; an interval needs 5 trials" in " ".join(_all_text(fig).split())
    assert all(_interval_tops(ax) for ax in plots.draw("dynamic_scale", data).axes)
    fig = plots.draw("memory_cap", tmp_path / "partial")
    check_memory_cap(fig, tmp_path / "partial")
    assert {t.get_text() for ax in fig.axes for t in ax.get_xticklabels()} == {"1.10×"}
    assert "2 of 5 trials so far" in " ".join(_all_text(fig).split())


def test_saved_figures_are_reproducible(data, tmp_path):
    """No timestamps in the files: unchanged CSVs give unchanged PNG and SVG (quiet diffs in figures/)."""
    a, b = (plots.build("alloc_cost", data, tmp_path / d) for d in "12")
    assert a.read_bytes() == b.read_bytes()
    assert a.with_suffix(".svg").read_bytes() == b.with_suffix(".svg").read_bytes()
    assert plots.png(plots.draw("alloc_cost", data))[:8] == b"\x89PNG\r\n\x1a\n"     # inline: bytes, no file


def test_correctness_figure_marks_failures_and_exact_checks(tmp_path):
    df = synthetic.correctness("cpu", fail=True)
    ax = plots.correctness(df).axes[0]
    assert ax.get_title(loc="left").startswith("CPU: 6 of 7 checks pass")
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert "PyTorch parity: every parameter's gradient, float64 wte (2 of 2)" not in labels
    assert any(lab.startswith("PyTorch parity: every parameter's gradient") for lab in labels)
    assert any(t.get_text() == "measured 0 ✓" for t in ax.texts)
    assert not any(t.get_text() in ("0", "exact: measured 0 ✓") for t in ax.texts)           # a zero said one way
    assert not ax.patches                                                    # points: no bar from the axis's floor
    assert len({tuple(np.round(c[:3], 3)) for c in ax.collections[0].get_facecolors()}) == 2  # pass and fail


def test_correctness_without_a_device_column_says_where_from_the_array_module():
    gpu = synthetic.correctness("gpu").drop(columns="device")
    fig = plots.correctness(pd.concat([synthetic.correctness("cpu"), gpu], ignore_index=True))
    assert [ax.get_title(loc="left").split(":")[0] for ax in fig.axes] == ["CPU", "GPU"]


def test_caption_lists_each_machine():
    df = pd.concat([synthetic.correctness("cpu").assign(gpu="none"), synthetic.correctness("gpu")])
    cap = plots.caption(df)
    assert "a CPU, no GPU" in cap and "SYNTHETIC GPU" in cap and cap.count("Measured on") == 2


@pytest.mark.parametrize("name", sorted(CHECKS))
def test_committed_figure_shows_the_committed_csvs_medians(name):
    """The same readback on data/ itself: every figure the report shows is what the committed CSVs give."""
    data = pathlib.Path(__file__).resolve().parents[2] / "data"
    fig = _draw(name, data)
    if fig is None:
        pytest.skip(f"no committed CSV for {name}")
    CHECKS[name](fig, data)


# --- defect classes found by hand in the figures (#23): each has a test so that it cannot come back


def _interval_tops(ax):
    """[(x from, x to, top)] of every narrow line of the axes: an error bar with its caps, or a min-max span."""
    width = max((p.get_width() for p in ax.patches), default=0)
    out = []
    for line in ax.lines:
        x, y = (np.asarray(v, dtype=float) for v in line.get_data())
        ok = np.isfinite(x) & np.isfinite(y)
        if ok.any() and np.ptp(x[ok]) <= width:
            out.append((x[ok].min(), x[ok].max(), y[ok].max()))
    return out


@pytest.mark.parametrize("name", sorted(set(plots.FIGURES) - {"correctness"}))   # correctness: bars, no intervals
def test_value_labels_sit_above_their_intervals(name, data):
    """A bar's value is written above its error bar, never across it (seaborn draws a capped bar as one line)."""
    fig = plots.draw(name, data)
    labelled = 0
    for ax in fig.axes:
        tops = _interval_tops(ax)
        for text in ax.texts:
            if not hasattr(text, "xy") or not ax.containers:
                continue
            x, y = text.xy
            over = [top for lo, hi, top in tops if lo - 1e-9 <= x <= hi + 1e-9]
            labelled += bool(over)
            assert y >= max(over, default=-np.inf) - 1e-9, f"{name}, {ax.get_title()!r}: {text.get_text()!r}"
    if name in ("torch_interop", "single_gpu", "ddp_before_after", "graph_steps", "dynamic_shapes"):
        assert labelled, f"{name}: no value label over an interval was found to check"


@pytest.mark.parametrize("name", sorted(plots.FIGURES))
def test_no_legend_inside_the_axes_hides_data(name, data):
    """A legend drawn inside the axes covers none of their points (the timeline's once hid the rug of misses)."""
    fig = plots.draw(name, data)
    fig.canvas.draw()
    for ax in fig.axes:
        leg = ax.get_legend()
        if leg is None:
            continue
        box = leg.get_window_extent()
        for line in ax.lines:
            xy = line.get_transform().transform(np.asarray(line.get_xydata(), dtype=float))
            xy = xy[np.isfinite(xy).all(axis=1)]
            inside = box.contains_points(xy) if hasattr(box, "contains_points") else [box.contains(*p) for p in xy]
            assert not np.any(inside), f"{name}, {ax.get_title()!r}: the legend covers {line.get_label()!r}"


def test_memory_timeline_legend_is_outside_and_names_the_rug(data):
    fig = plots.draw("memory_timeline", data)
    assert all(ax.get_legend() is None for ax in fig.axes)
    texts = [t.get_text() for leg in fig.legends for t in leg.get_texts()]
    assert any("cudaMalloc" in t for t in texts) and any(t.startswith("reserved") for t in texts)


def test_graph_steps_caption_names_only_the_csvs_it_draws(data, tmp_path):
    """Rows one process per GPU are in the lineage but in no panel: the caption must not name their CSV."""
    import shutil
    shutil.copytree(data, tmp_path, dirs_exist_ok=True)
    ddp = pd.read_csv(tmp_path / "graph/ddp_scaling.csv")
    ddp.assign(mode="processes").to_csv(tmp_path / "graph/ddp_processes.csv", index=False)
    text = _all_text(plots.draw("graph_steps", tmp_path))
    assert "graph/ddp_scaling.csv" in text and "ddp_processes" not in text


def _overlapping_labels(fig) -> list:
    """Pairs of texts inside one axes (value labels, notes) whose boxes overlap on the canvas ('1.0031.0031.003')."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    out = []
    for ax in fig.axes:
        boxes = [(t.get_text(), t.get_window_extent(renderer)) for t in ax.texts if t.get_text() and t.get_visible()]
        for (a, p), (b, q) in itertools.combinations(boxes, 2):
            if p.x0 < q.x1 - 1 and q.x0 < p.x1 - 1 and p.y0 < q.y1 - 1 and q.y0 < p.y1 - 1:
                out.append((ax.get_title(loc="left") or ax.get_title(), a, b))
    return out


@pytest.mark.parametrize("name", sorted(plots.FIGURES))
def test_no_two_labels_overlap(name, data):
    assert _overlapping_labels(plots.draw(name, data)) == []


@pytest.mark.parametrize("name", sorted(plots.FIGURES))
def test_no_two_labels_overlap_in_the_committed_figures(name):
    data = pathlib.Path(__file__).resolve().parents[2] / "data"
    fig = plots.draw(name, data)
    if fig is None:
        pytest.skip(f"no committed CSV for {name}")
    assert _overlapping_labels(fig) == []


def test_the_overlap_check_finds_labels_drawn_on_top_of_each_other():
    """The check itself: three bars too narrow for their unrotated labels overlap (the old dynamic figure's
    '1.0031.0031.003'), and the same labels rotated do not."""
    df = pd.DataFrame(dict(arm=["a", "b", "c"] * 2, label=["a", "b", "c"] * 2, x=[0] * 6, v=[1.003] * 6))
    for rotate, overlapping in ((0, True), (90, False)):
        fig, [[ax]] = plots._figure(1, 1, size=(1.2, 3))
        sns.barplot(df, x="x", y="v", hue="label", ax=ax, errorbar=None)
        for c in ax.containers:
            for p in c.patches:
                ax.annotate("1.003", (p.get_x() + p.get_width() / 2, p.get_height()), xytext=(0, 3), fontsize=7,
                            textcoords="offset points", ha="center", va="bottom", rotation=rotate)
        assert bool(_overlapping_labels(fig)) == overlapping
