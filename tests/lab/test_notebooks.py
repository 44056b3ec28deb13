"""Notebooks as a user meets them: committed without outputs, in step with their generator, parameters documented
and checked, every one runs through papermill in CPU mode (with SYNTHETIC CSVs, and with none at all), shows its
figures inline and its tables as summaries, and a run leaves a fresh clone's `git status` clean."""
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import numpy as np
import pandas as pd
import pytest

nbformat = pytest.importorskip("nbformat")   # absent on the GPU machines; the CPU suite has it

from lab_fixtures import synthetic
from xlab import notebook_utils as nbu
from xlab import plots, report

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
NAMES = [p.stem for p in NOTEBOOKS]


def test_the_six_notebooks_exist():
    assert NAMES == ["01_correctness", "02_allocator_microbench", "03_single_gpu", "04_multi_gpu", "05_memory",
                     "06_dynamic_shapes"]
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
    assert {"data_dir", "publish"} <= {p.name for p in params}
    assert next(p for p in params if p.name == "publish").default == "False"        # writes build/ unless asked


def test_notebooks_match_their_generator():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import make_notebooks
    finally:
        sys.path.pop(0)
    assert make_notebooks.main(["--check"]) == 0, "run `python scripts/make_notebooks.py`"


def _outputs(path) -> str:
    """All text a notebook printed or displayed (errors and warnings included)."""
    nb = nbformat.read(path, as_version=4)
    out = []
    for c in nb.cells:
        for o in c.get("outputs", []):
            out.append(o.get("text", "") + o.get("data", {}).get("text/plain", "") + o.get("evalue", ""))
    return "\n".join(out)


def _images(path) -> int:
    nb = nbformat.read(path, as_version=4)
    return sum("image/png" in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))


FIGURE_CELLS = {"01_correctness": 1, "02_allocator_microbench": 3, "03_single_gpu": 1, "04_multi_gpu": 4,
                "05_memory": 3, "06_dynamic_shapes": 1}


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=NAMES)
def test_notebook_runs_in_cpu_mode_with_committed_data(path, tmp_path):
    data = tmp_path / "data"
    synthetic.write_all(data, trials=5)
    before = {p: p.stat().st_mtime_ns for p in (ROOT / "data").rglob("*")} | \
        {p: p.stat().st_mtime_ns for p in (ROOT / "figures").rglob("*")}
    r = report.run_notebook(path, tmp_path / "out", dict(report.CPU_QUICK[path.stem], data_dir=str(data)))
    assert r["ok"], r["error"]
    text = _outputs(r["output"])
    assert "Traceback" not in text and "<Figure size" not in text and "IProgress not found" not in text
    if path.stem != "01_correctness" or "correctness_gpu.csv" in text:
        assert "SYNTHETIC GPU" in text and "2000-01-01" in text   # it says which machine and date
    assert _images(r["output"]) == FIGURE_CELLS[path.stem]      # every figure inline
    after = {p: p.stat().st_mtime_ns for p in (ROOT / "data").rglob("*")} | \
        {p: p.stat().st_mtime_ns for p in (ROOT / "figures").rglob("*")}
    assert after == before                                     # nothing committed was written


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=NAMES)
def test_notebook_runs_in_cpu_mode_without_data(path, tmp_path):
    params = dict(report.CPU_QUICK[path.stem], data_dir=str(tmp_path / "data"))
    r = report.run_notebook(path, tmp_path / "out", params)
    assert r["ok"], r["error"]
    assert "missing" in _outputs(r["output"])


def test_parameters_are_checked_naming_the_parameter_and_its_type():
    def ns(**kw):
        return {**{k: v for k, (_, v) in nbu.schema("03_single_gpu").items()}, **kw}
    g = ns(batches=4, allocators="xpool")                     # papermill -p batches 4 -p allocators xpool
    nbu.setup("03_single_gpu", g)
    assert g["batches"] == [4] and g["allocators"] == ["xpool"]
    g = ns(batches="4,8")
    nbu.setup("03_single_gpu", g)
    assert g["batches"] == [4, 8]
    with pytest.raises(TypeError, match=r"parameter 'batches' must be a list\[int\].*got 'four'"):
        nbu.setup("03_single_gpu", ns(batches="four"))
    with pytest.raises(TypeError, match="parameter 'steps' must be int .*got str '10'"):
        nbu.setup("03_single_gpu", ns(steps="10"))
    with pytest.raises(TypeError, match="parameter 'measure' must be bool"):
        nbu.setup("03_single_gpu", ns(measure=1))
    with pytest.raises(ValueError, match="unknown parameter 'batchs' for notebook 03_single_gpu .did you mean 'batches'"):
        nbu.setup("03_single_gpu", ns(batchs=4))
    with pytest.raises(ValueError, match="unknown allocator 'xpoool'"):
        nbu.setup("03_single_gpu", ns(allocators=["xpoool"]))


@pytest.mark.slow
def test_a_mistyped_parameter_fails_the_run_and_says_which(tmp_path):
    r = report.run_notebook(ROOT / "notebooks" / "05_memory.ipynb", tmp_path, dict(measure=False, kss=4))
    assert not r["ok"] and "unknown parameter 'kss'" in r["error"] and "did you mean 'ks'" in r["error"]


def _header_command(name: str) -> str:
    cell = nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4).cells[0].source
    return re.search(r"`(mkdir -p build/notebooks && papermill [^`]+)`", cell)[1]


@pytest.mark.slow
def test_a_fresh_clone_runs_the_header_command_and_make_report_and_stays_clean(tmp_path):
    """What a new user does: clone, run a notebook as its header says, rebuild the report; nothing committed moves."""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    for so in (ROOT / "xpool").glob("_core*.so"):              # what `make setup` builds in the clone
        shutil.copy(so, clone / "xpool")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XPOOL_REPO")}
    env["PATH"] = f"{pathlib.Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env["PYTHONPATH"] = str(clone)
    for name in ("05_memory", "03_single_gpu"):
        subprocess.run(_header_command(name).replace("papermill", "papermill -p measure False", 1), shell=True,
                       cwd=clone, env=env, check=True, capture_output=True)
        assert (clone / "build" / "notebooks" / f"{name}.ipynb").is_file()
    subprocess.run([sys.executable, "-m", "xlab.report", "--no-notebooks"], cwd=clone, env=env, check=True,
                   capture_output=True)
    status = subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True, text=True).stdout
    assert status == "", status


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
    df = nbu.load_or_measure("x", fake_measure, True, tmp_path, n=3, out=tmp_path)   # a run writes where it is told
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
