"""Notebooks: committed without outputs, in step with their generator, parameters documented, and every one
runs through papermill in CPU mode with small parameters (with SYNTHETIC CSVs, and with none at all).
Plots: every plotting function on SYNTHETIC frames with the real schemas."""
import json
import pathlib
import sys

import numpy as np
import pandas as pd
import pytest

nbformat = pytest.importorskip("nbformat")   # absent on the GPU machines; the CPU suite has it
from matplotlib.figure import Figure

from fixtures import synthetic
from xlab import notebook_utils as nbu
from xlab import plots, report

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
NAMES = [p.stem for p in NOTEBOOKS]


def test_the_five_notebooks_exist():
    assert NAMES == ["01_correctness", "02_allocator_microbench", "03_single_gpu", "04_multi_gpu", "05_memory"]
    assert set(report.CPU_QUICK) == set(NAMES)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=NAMES)
def test_committed_notebook_is_clean(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata["kernelspec"]["name"] == "python3"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.outputs == [] and c.execution_count is None for c in code), "strip outputs before committing"
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1 and tagged[0] is code[0], "one parameters cell, the first code cell"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=NAMES)
def test_every_parameter_is_annotated_and_commented(path):
    """`papermill --help-notebook` documents each parameter: type, literal default and a comment."""
    from papermill.translators import PythonTranslator
    cell = next(c for c in nbformat.read(path, as_version=4).cells if "parameters" in c.metadata.get("tags", []))
    lines = [ln for ln in cell.source.splitlines() if ln.strip()]
    params = PythonTranslator.inspect(cell)
    assert len(params) == len(lines)
    assert all(p.inferred_type_name != "None" and p.help for p in params)
    assert {"data_dir", "figures_dir"} <= {p.name for p in params}


def test_notebooks_match_their_generator():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import make_notebooks
    finally:
        sys.path.pop(0)
    assert make_notebooks.main(["--check"]) == 0, "run `python scripts/make_notebooks.py`"


def _outputs(path) -> str:
    """All text a notebook printed or displayed (errors included)."""
    nb = nbformat.read(path, as_version=4)
    out = []
    for c in nb.cells:
        for o in c.get("outputs", []):
            out.append(o.get("text", "") + o.get("data", {}).get("text/plain", "") + o.get("evalue", ""))
    return "\n".join(out)


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=NAMES)
def test_notebook_runs_in_cpu_mode_with_committed_data(path, tmp_path):
    data, figures = tmp_path / "data", tmp_path / "figures"
    synthetic.write_all(data)
    params = dict(report.CPU_QUICK[path.stem], data_dir=str(data), figures_dir=str(figures))
    r = report.run_notebook(path, tmp_path / "out", params)
    assert r["ok"], r["error"]
    text = _outputs(r["output"])
    assert "Traceback" not in text
    if path.stem != "01_correctness" or "correctness_gpu.csv" in text:
        assert "SYNTHETIC GPU" in text and "2000-01-01" in text   # it says which machine and date
    assert list(figures.glob("*.png")) and list(figures.glob("*.svg"))


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=NAMES)
def test_notebook_runs_in_cpu_mode_without_data(path, tmp_path):
    params = dict(report.CPU_QUICK[path.stem], data_dir=str(tmp_path / "data"), figures_dir=str(tmp_path / "f"))
    r = report.run_notebook(path, tmp_path / "out", params)
    assert r["ok"], r["error"]
    assert "missing" in _outputs(r["output"])


# ---------------------------------------------------------------------------------------------------------
# Plots on SYNTHETIC frames


def _all_text(fig: Figure) -> str:
    parts = [t.get_text() for t in fig.texts]
    if fig._suptitle is not None:
        parts.append(fig._suptitle.get_text())
    if fig._supxlabel is not None:
        parts.append(fig._supxlabel.get_text())
    for leg in fig.legends:
        parts.append(leg.get_title().get_text())
    return "\n".join(parts)


FRAMES = {
    "correctness": lambda: pd.concat([synthetic.correctness("cpu"), synthetic.correctness("gpu", fail=True)]),
    "alloc_cost": synthetic.alloc_microbench,
    "alloc_threads": synthetic.alloc_microbench,
    "single_gpu": synthetic.single_gpu,
    "ddp_scaling": synthetic.ddp_scaling,
    "ddp_before_after": synthetic.ddp_scaling,
    "batch_sweep": lambda: synthetic.with_trials(synthetic.batch_sweep()),
    "memory_waste": synthetic.memory_waste,
    "memory_timeline": synthetic.memory_timeline,
    "memory_schemes": synthetic.memory_schemes,
    "graph_steps": lambda: synthetic.graph_steps(trials=1).drop(columns="trial"),
}
TRIAL_FRAMES = {   # the newer schema: five trials per configuration, host/GPU ms per step
    "alloc_cost": lambda: synthetic.with_trials(synthetic.alloc_microbench()),
    "alloc_threads": lambda: synthetic.with_trials(synthetic.alloc_microbench()),
    "single_gpu": lambda: synthetic.with_trials(synthetic.with_step_times(synthetic.single_gpu())),
    "ddp_scaling": lambda: synthetic.with_trials(synthetic.with_step_times(synthetic.ddp_scaling())),
    "ddp_before_after": lambda: synthetic.with_trials(synthetic.with_step_times(synthetic.ddp_scaling())),
    "graph_steps": synthetic.graph_steps,
}


def test_every_registered_figure_has_a_frame():
    assert set(FRAMES) == set(plots.FIGURES)


@pytest.mark.parametrize("name", sorted(FRAMES))
def test_plot_has_title_labels_and_machine_caption(name, tmp_path):
    df = FRAMES[name]()
    fig = plots.FIGURES[name][1](df)
    assert isinstance(fig, Figure)
    text = _all_text(fig)
    assert "SYNTHETIC GPU" in text and "2000-01-01" in text and "driver" in text
    axes = [ax for ax in fig.axes if ax.has_data()]
    # Every panel's y axis is labelled, shares its axis with a labelled panel, or names its rows.
    assert axes and all(ax.get_ylabel() or any(o.get_ylabel() for o in ax.get_shared_y_axes().get_siblings(ax))
                        or any(t.get_text() for t in ax.get_yticklabels()) for ax in axes)
    assert all(ax.get_xlabel() or [t.get_text() for t in ax.get_xticklabels()] for ax in axes)
    png, svg = plots.save(fig, name, tmp_path)
    assert png.stat().st_size > 10_000 and svg.stat().st_size > 10_000


@pytest.mark.parametrize("name", sorted(TRIAL_FRAMES))
def test_timed_figures_draw_error_bars_from_trials(name):
    """Every timed figure shows each median's 95% interval: with trials there are error bars, and the caption
    says what a point is; the old one-row-per-point CSVs draw none and say so."""
    def bars(fig):
        return sum(len(c) for ax in fig.axes for c in ax.containers
                   if getattr(c, "has_yerr", False) or getattr(c, "errorbar", None) is not None)
    new = plots.FIGURES[name][1](TRIAL_FRAMES[name]())
    assert bars(new) > 0 and "95% bootstrap interval" in _all_text(new)
    old = plots.FIGURES[name][1](FRAMES[name]())
    assert "no interval" in _all_text(old)


@pytest.mark.parametrize("trials", [0, 5])
def test_plots_survive_a_csv_round_trip(tmp_path, trials):
    """Figures are made from the CSVs alone: what was written must plot after reading it back."""
    synthetic.write_all(tmp_path / "data", trials=trials)
    (tmp_path / "data" / "correctness_cpu.csv").write_text(synthetic.correctness("cpu").to_csv(index=False))
    built = plots.build_all(tmp_path / "data", tmp_path / "figures")
    skipped = {"batch_sweep", "graph_steps"} if not trials else set()
    assert all(isinstance(v, pathlib.Path) and v.is_file() for k, v in built.items() if k not in skipped), built


def test_build_all_skips_missing_csvs(tmp_path):
    built = plots.build_all(tmp_path / "nothing", tmp_path / "figures")
    assert all(str(v).startswith("skipped") for v in built.values())
    assert not (tmp_path / "figures").exists() or not list((tmp_path / "figures").iterdir())


def test_saved_figures_are_reproducible(tmp_path):
    """No timestamps in the files: unchanged CSVs give unchanged PNG and SVG (quiet diffs in figures/)."""
    df = synthetic.alloc_microbench()
    a = plots.save(plots.alloc_cost(df), "a", tmp_path / "1")
    b = plots.save(plots.alloc_cost(df), "a", tmp_path / "2")
    assert [p.read_bytes() for p in a] == [p.read_bytes() for p in b]


def test_correctness_plot_marks_failures_and_exact_checks():
    df = synthetic.correctness("cpu", fail=True)
    fig = plots.correctness(df)
    ax = fig.axes[0]
    assert ax.get_title(loc="left").startswith("CPU: 6 of 7 checks pass")
    labels = [t.get_text() for t in ax.get_yticklabels()]
    assert "torch grad float64 (worst parameter)" in labels and "torch grad float64 wte" not in labels
    notes = [t.get_text() for t in ax.texts]
    assert any("exact: measured 0" in n for n in notes)
    colors = {tuple(np.round(p.get_facecolor()[:3], 3)) for p in ax.patches}
    assert len(colors) == 2                                  # pass and fail


def test_caption_lists_each_machine():
    df = pd.concat([synthetic.correctness("cpu").assign(gpu="none"), synthetic.correctness("gpu")])
    cap = plots.caption(df)
    assert "a CPU, no GPU" in cap and "SYNTHETIC GPU" in cap and cap.count("Measured on") == 2


def test_describe_provenance_names_machine_and_date():
    text = nbu.describe_provenance(synthetic.single_gpu())
    assert "SYNTHETIC GPU" in text and "2000-01-01" in text and "commit synthetic" in text
    assert "without a GPU" in nbu.describe_provenance(synthetic.correctness().assign(gpu="none"))


def test_load_or_measure(tmp_path, capsys):
    calls = []

    def fake_measure(out, n):
        calls.append(out)
        return synthetic.single_gpu().head(n)

    assert nbu.load_or_measure("x", fake_measure, False, tmp_path) is None
    assert "missing" in capsys.readouterr().out
    df = nbu.load_or_measure("x", fake_measure, True, tmp_path, n=3)
    assert len(df) == 3 and df.attrs["source"] == "measured" and (tmp_path / "x.csv").is_file()
    assert "Measured now" in capsys.readouterr().out
    again = nbu.load_or_measure("x", fake_measure, False, tmp_path)
    assert len(again) == 3 and again.attrs["source"] == "committed" and len(calls) == 1
    assert "SYNTHETIC GPU" in capsys.readouterr().out
    assert nbu.load_or_measure("x", fake_measure, True, tmp_path, measure=False).attrs["source"] == "committed"


def test_load_or_measure_never_imports_the_measuring_module_without_a_gpu(tmp_path):
    assert nbu.load_or_measure("x", "xpool.no_such_module:run", False, tmp_path) is None


def test_the_gate_judges_only_what_ran_here():
    ran = synthetic.correctness("cpu")
    ran.attrs["source"] = "measured"
    old = synthetic.correctness("gpu", fail=True)
    old.attrs["source"] = "committed"
    nbu.assert_all_passed(nbu.measured_here(ran, old, None))
    failing = synthetic.correctness("cpu", fail=True)
    failing.attrs["source"] = "measured"
    with pytest.raises(AssertionError, match="a failing check"):
        nbu.assert_all_passed(nbu.measured_here(failing))


def test_transparency_rows():
    gate = pd.DataFrame(dict(allocator=["raw", "cupy", "xpool"], steps=50, identical_to_raw=[True, True, False]))
    rows = nbu.transparency_rows(gate)
    assert list(rows["passed"]) == [True, False] and list(rows["measured"]) == [0.0, 1.0]
    assert (rows["threshold"] == 0).all() and rows["check"].str.startswith("transparency").all()


def test_notebook_json_is_diff_friendly():
    for path in NOTEBOOKS:
        text = path.read_text()
        assert text.endswith("\n") and json.loads(text)["nbformat"] == 4
        assert '"outputs": []' in text and '"execution_count": null' in text


def test_correctness_csv_without_device_column():
    """`python -m tapegpt.checks --gpu` writes no device column: the array module says where it ran."""
    gpu = synthetic.correctness("gpu").drop(columns="device")
    both = pd.concat([synthetic.correctness("cpu"), gpu], ignore_index=True)
    assert list(nbu.correctness_summary(both)["device"]) == ["cpu", "gpu"]
    fig = plots.correctness(both)
    assert [ax.get_title(loc="left").split(":")[0] for ax in fig.axes] == ["CPU", "GPU"]
