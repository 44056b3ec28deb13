"""Notebooks as a user meets them: git holds each as a plain-text .py (jupytext) and ignores the .ipynb paired with
it, so a run and its save leave the tree clean; parameters documented with their ranges and checked at setup in one
line; tables for people; progress bars; every notebook through papermill in CPU mode (with SYNTHETIC CSVs, and with
none at all), and a fresh clone's `git status` clean after a run. The tests read the notebooks as git's index holds
them (what a commit takes), never the working copy JupyterLab's autosave changes."""
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time

import pandas as pd
import pytest

nbformat = pytest.importorskip("nbformat")   # absent on the GPU machines; the CPU suite has it
jupytext = pytest.importorskip("jupytext")

from jupytext.config import load_jupytext_config
from lab_fixtures import synthetic
from xlab import notebook_utils as nbu
from xlab import report, sources, summaries, tables

ROOT = pathlib.Path(__file__).resolve().parents[2]
NAMES = sorted(p.stem for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.py"))
FIGURE_CELLS = {"01_correctness": 1, "02_allocator_microbench": 3, "03_single_gpu": 1, "04_multi_gpu": 4,
                "05_memory": 3, "06_dynamic_shapes": 5}
PROGRESS = {"01_correctness", "03_single_gpu", "04_multi_gpu", "06_dynamic_shapes"}   # cells over ~5 s on a CPU
# figures whose CSVs the GPU has yet to write (issue #46's scaled runs): drawn only where data/ has them
WAITING = {"06_dynamic_shapes": ("dynamic_scale", "memory_cap")}


def figures_from(name: str, data: pathlib.Path) -> int:
    """The figures notebook `name` draws from the CSVs in `data` (FIGURE_CELLS, less those whose CSV is not there)."""
    return FIGURE_CELLS[name] - sum(not (data / f"{csv}.csv").is_file() for csv in WAITING.get(name, ()))


def committed(name: str) -> str:
    """notebooks/NAME.py as git's index holds it (the file itself outside a git checkout)."""
    r = subprocess.run(["git", "show", f":notebooks/{name}.py"], cwd=ROOT, capture_output=True, text=True)
    return r.stdout if r.returncode == 0 else (ROOT / "notebooks" / f"{name}.py").read_text()


def notebook(name: str):
    return jupytext.reads(committed(name), fmt="py:percent")


def as_ipynb(name: str, folder: pathlib.Path) -> pathlib.Path:
    """The committed notebook as the .ipynb `make setup` pairs with it, in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.ipynb"
    nbformat.write(notebook(name), path)
    return path


def fresh_clone(clone: pathlib.Path) -> pathlib.Path:
    """A clone of the committed tree as `make setup` leaves it, built with this environment: the allocator's C core
    copied in, the notebooks paired by the Makefile's own rule (this venv's jupytext; the venv itself left alone)."""
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
    for so in (ROOT / "xpool").glob("_core*.so"):
        shutil.copy(so, clone / "xpool")
    venv = pathlib.Path(sys.executable).parent.parent
    subprocess.run(["make", "-C", str(clone), "notebooks", f"VENV={venv}", "-o", f"{venv}/.installed"], check=True,
                   capture_output=True)
    return clone


@pytest.fixture
def repo_env(monkeypatch):
    """A kernel started from a notebook outside the checkout finds the checkout (xlab.paths)."""
    monkeypatch.setenv("XPOOL_REPO", str(ROOT))


def test_the_six_notebooks_exist():
    assert NAMES == ["01_correctness", "02_allocator_microbench", "03_single_gpu", "04_multi_gpu", "05_memory",
                     "06_dynamic_shapes"]
    assert set(report.CPU_QUICK) == set(NAMES)


def test_git_holds_the_text_notebooks_and_ignores_their_pairs():
    files = subprocess.run(["git", "ls-files", "notebooks"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    assert sorted(files) == sorted([f"notebooks/{n}.py" for n in NAMES] + ["notebooks/.gitignore",
                                                                          "notebooks/jupytext.toml"])
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *(f"notebooks/{n}.ipynb" for n in NAMES)],
                             cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert ignored == [f"notebooks/{n}.ipynb" for n in NAMES]


@pytest.mark.parametrize("name", NAMES)
def test_a_save_writes_the_committed_text_again(name):
    """What JupyterLab (jupytext's contents manager) writes on a save, outputs, counts and kernel metadata included,
    is the committed .py byte for byte: a run and its autosave change no tracked file."""
    config = load_jupytext_config(str(ROOT / "notebooks"))
    text = committed(name)
    nb = jupytext.reads(text, fmt="py:percent")
    assert jupytext.writes(nb, fmt="py:percent", config=config) == text
    nb.metadata["language_info"] = {"name": "python", "version": "3.11.7", "codemirror_mode": {"name": "ipython"}}
    nb.metadata["kernelspec"]["display_name"] = "Python 3 (ipykernel)"
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}}}
    for i, cell in enumerate(c for c in nb.cells if c.cell_type == "code"):
        cell.execution_count = i + 1
        cell.outputs = [nbformat.v4.new_output("stream", name="stdout", text="a line\n"),
                        nbformat.v4.new_output("display_data", {"image/png": "iVBORw0KGgo=", "text/plain": "<img>"})]
        cell.metadata.update(execution={"iopub.status.idle": "2026-12-05T00:00:00Z"}, scrolled=True)
    assert jupytext.writes(nb, fmt="py:percent", config=config) == text


@pytest.mark.parametrize("name", NAMES)
def test_one_parameters_cell_first_and_the_kernel_named(name):
    nb = notebook(name)
    assert nb.metadata["kernelspec"]["name"] == "python3"
    assert set(nb.metadata) <= {"kernelspec", "jupytext"}                     # no language_info, no widget state
    code = [c for c in nb.cells if c.cell_type == "code"]
    tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    assert len(tagged) == 1 and tagged[0] is code[0], "one parameters cell, the first code cell"
    assert "nbu.setup(" in code[1].source, "the cell after the parameters checks them"


@pytest.mark.parametrize("name", NAMES)
def test_every_parameter_is_annotated_commented_and_ranged(name):
    """`papermill --help-notebook` documents each parameter: type, literal default, what it sets and its range (the
    range nbu.PARAMETERS checks, and where it acts)."""
    from papermill.translators import PythonTranslator
    cell = next(c for c in notebook(name).cells if "parameters" in c.metadata.get("tags", []))
    lines = [ln for ln in cell.source.splitlines() if ln.strip()]
    params = PythonTranslator.inspect(cell)
    assert len(params) == len(lines)
    assert {"data_dir", "publish"} <= {p.name for p in params}
    assert next(p for p in params if p.name == "publish").default == "False"        # writes build/ unless asked
    for p in params:
        spec = nbu.PARAMETERS[p.name]
        where = {"gpu": "; GPU only", "cpu": "; without a GPU only"}.get(spec.only, "")
        assert p.inferred_type_name != "None" and p.help.endswith(f"; {spec.allowed(p.inferred_type_name)}{where}"), \
            f"{name}: {p.name}'s comment should end with its range: {spec.allowed(p.inferred_type_name)}{where}"


def _outputs(path) -> str:
    """All text a notebook printed or displayed (errors and warnings included)."""
    nb = nbformat.read(path, as_version=4)
    out = []
    for c in nb.cells:
        for o in c.get("outputs", []):
            out.append(o.get("text", "") + o.get("data", {}).get("text/plain", "") + o.get("evalue", ""))
    return "\n".join(out)


def _count(path, mime: str) -> int:
    nb = nbformat.read(path, as_version=4)
    return sum(mime in o.get("data", {}) for c in nb.cells for o in c.get("outputs", []))


def _html(path) -> str:
    nb = nbformat.read(path, as_version=4)
    return "\n".join(o["data"]["text/html"] for c in nb.cells for o in c.get("outputs", [])
                     if "text/html" in o.get("data", {}))


def _committed_files() -> dict:
    return {p: p.stat().st_mtime_ns for folder in ("data", "figures") for p in (ROOT / folder).rglob("*")}


# The CPU-mode runs below, each a papermill run of its own kernel: made together, two at a time (in two processes;
# CI has two cores), before the first test that reads one, and each read and judged by its own test. No
# other test runs while they do (the kernels start from this environment: XPOOL_REPO is the checkout's throughout).
CPU_RUNS = [(name, "data") for name in NAMES] + [(name, "none") for name in NAMES] + [("06_dynamic_shapes", "scaled")]


@pytest.fixture(scope="module")
def cpu_runs(tmp_path_factory):
    """{(notebook, data): (report.run_notebook's result, the data folder)}, and the committed files' mtimes before:
    data 'data' (SYNTHETIC CSVs, five trials), 'none' (an empty folder), 'scaled' (two of five trials of the scaled
    runs, under the judged cap alone: a run under way)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    jobs = {}
    for name, kind in CPU_RUNS:                    # the folders first, here; the runs alone on the threads
        tmp = tmp_path_factory.mktemp(f"{name}_{kind}")
        data = tmp / "data"
        if kind == "data":
            synthetic.write_all(data, trials=5)
        elif kind == "scaled":
            synthetic.write_all(data, trials=5, scaled=2, caps=(1.10,))
        else:
            data.mkdir()
        jobs[name, kind] = (as_ipynb(name, tmp / "nb"), tmp / "out", dict(report.CPU_QUICK[name], data_dir=str(data)))
    before = _committed_files()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XPOOL_REPO", str(ROOT))         # a kernel started outside the checkout finds it (xlab.paths)
        # processes, not threads: papermill's run changes directory to the notebook's (os.chdir, the whole process)
        with ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = {key: pool.submit(report.run_notebook, *job) for key, job in jobs.items()}
            runs = {key: f.exception() or f.result() for key, f in futures.items()}
    return runs, before


def _run(cpu_runs, name, kind):
    got = cpu_runs[0][name, kind]
    if isinstance(got, BaseException):
        raise got
    return got


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_in_cpu_mode_with_committed_data(name, cpu_runs):
    r = _run(cpu_runs, name, "data")
    assert r["ok"], r["error"]
    text = _outputs(r["output"])
    assert "Traceback" not in text and "<Figure size" not in text and "IProgress not found" not in text
    if name != "01_correctness" or "correctness_gpu.csv" in text:
        assert "SYNTHETIC GPU" in text and "2000-01-01" in text   # it says which machine and date
    assert _count(r["output"], "image/png") == FIGURE_CELLS[name]      # every figure inline
    assert (_count(r["output"], "application/vnd.jupyter.widget-view+json") > 0) == (name in PROGRESS)
    html = _html(r["output"])
    assert not re.search(r"\d[eE][+-]\d", html), "a table in scientific notation"
    if name == "03_single_gpu":
        assert "Ignored here (no GPU" in text and "steps=3" in text        # CPU_QUICK's GPU-only parameters
        assert "tokens/s" in html and re.search(r"\d,\d{3} \[\d", html)     # units, separators, intervals
    assert _committed_files() == cpu_runs[1]                  # nothing committed was written


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_notebook_runs_in_cpu_mode_without_data(name, cpu_runs):
    r = _run(cpu_runs, name, "none")
    assert r["ok"], r["error"]
    assert "missing" in _outputs(r["output"])
    if name == "06_dynamic_shapes":                 # issue #46's sections: what measures them, no figure
        for csv in ("dynamic_scale", "memory_cap"):
            assert f"Not measured yet: {summaries.HOW_TO_MEASURE} writes `data/{csv}.csv`." in _outputs(r["output"])
        assert _count(r["output"], "image/png") == 0


@pytest.mark.slow
def test_notebook_06_shows_a_scaled_run_under_way(cpu_runs):
    """Two of five trials of the scaled runs, under the judged cap alone (a run under way): the sections say how
    many trials so far, without an interval (the values instead), and draw both figures from them."""
    name = "06_dynamic_shapes"
    r = _run(cpu_runs, name, "scaled")
    assert r["ok"], r["error"]
    text, html = _outputs(r["output"]), _html(r["output"])
    assert "`dynamic_scale.csv` at synthetic (SYNTHETIC GPU" in text and "2 of 5 trials so far" in text
    assert "caps of 1.10× the peak requested" in text and "Not measured yet" not in text
    # no interval below 5 trials: each trial's value instead (issue #52)
    assert "(no interval: 2 trials, " in html and "[n/a]" not in html and "2/2" in html and "1.05×" not in html
    assert _count(r["output"], "image/png") == FIGURE_CELLS[name]


def _defaults(name: str, **kw) -> dict:
    return {**{k: v for k, (_, v) in nbu.schema(name).items()}, **kw}


def test_parameters_are_brought_to_their_types():
    g = _defaults("03_single_gpu", batches=4, allocators="xpool")      # papermill -p batches 4 -p allocators xpool
    nbu.setup("03_single_gpu", g)
    assert g["batches"] == [4] and g["allocators"] == ["xpool"]
    g = _defaults("03_single_gpu", batches="4,8")
    nbu.setup("03_single_gpu", g)
    assert g["batches"] == [4, 8]


@pytest.mark.parametrize("name, values, message", [
    ("03_single_gpu", dict(steps=-5), r"parameter 'steps' \(int\) must be 1 to 10,000; got -5$"),
    ("03_single_gpu", dict(trials=0), r"parameter 'trials' \(int\) must be 1 to 100; got 0$"),
    ("04_multi_gpu", dict(batch=0), r"parameter 'batch' \(int\) must be 1 to 4,096; got 0$"),
    ("05_memory", dict(ks=0), r"'ks' \(list\[int\]\) must be 1 to 64 each, at least one; got \[0\]$"),
    ("05_memory", dict(ks=[]), r"'ks' .* at least one; got \[\]$"),
    ("04_multi_gpu", dict(modes="thread"), r"'modes' .* must be threads or processes each, at least one"),
    ("06_dynamic_shapes", dict(workloads="cupy_mixx"), r"'workloads' .*: 'cupy_mixx' is not one of cupy_mix, "),
    ("03_single_gpu", dict(allocators=["xpoool"]), r"'allocators' .*unknown allocator 'xpoool'"),
    ("03_single_gpu", dict(data_dir="/no/such/folder"), r"'data_dir' .*: no such folder$"),
    ("03_single_gpu", dict(batches="four"), r"parameter 'batches' must be a list\[int\].*got 'four'"),
    ("03_single_gpu", dict(steps="10"), r"parameter 'steps' must be int .*got str '10'"),
    ("03_single_gpu", dict(measure=1), r"parameter 'measure' must be bool"),
    ("03_single_gpu", dict(batchs=4), r"unknown parameter 'batchs' for notebook 03_single_gpu .did you mean 'batches'"),
])
def test_a_bad_parameter_is_named_with_its_range_in_one_line(name, values, message):
    with pytest.raises(nbu.ParameterError, match=message) as e:
        nbu.setup(name, _defaults(name, **values))
    shown = e.value._render_traceback_()
    assert len(shown) == 1 and "\n" not in shown[0] and "ParameterError" in shown[0]


def test_parameters_a_machine_ignores_are_named():
    g = _defaults("03_single_gpu", steps=3, batches=[4])
    assert nbu.check_parameters("03_single_gpu", g, gpu=False) == ["steps=3", "batches=[4]"]
    assert nbu.check_parameters("03_single_gpu", _defaults("03_single_gpu"), gpu=False) == []   # defaults: silent
    assert nbu.check_parameters("03_single_gpu", _defaults("03_single_gpu", cpu_check=False), gpu=True) == \
        ["cpu_check=False"]


@pytest.mark.slow
def test_a_bad_parameter_stops_papermill_at_setup_with_one_line(tmp_path, repo_env):
    """papermill exits non-zero, the message last on its stderr; in the notebook the error is one line, in the
    setup cell (the one after the parameters)."""
    nb = as_ipynb("05_memory", tmp_path / "nb")
    out = tmp_path / "out.ipynb"
    r = subprocess.run([sys.executable, "-m", "papermill", str(nb), str(out), "-p", "ks", "0", "--cwd",
                        str(nb.parent)], capture_output=True, text=True, env={**os.environ})
    assert r.returncode != 0
    assert r.stderr.strip().splitlines()[-1] == \
        "ParameterError: parameter 'ks' (list[int]) must be 1 to 64 each, at least one; got [0]"
    cells = [c for c in nbformat.read(out, as_version=4).cells if c.cell_type == "code"]
    errors = [(i, o) for i, c in enumerate(cells) for o in c.outputs if o.output_type == "error"]
    assert len(errors) == 1 and "nbu.setup(" in cells[errors[0][0]].source
    assert len(errors[0][1].traceback) == 1
    r = report.run_notebook(nb, tmp_path / "typo", dict(measure=False, kss=4))
    assert not r["ok"] and "unknown parameter 'kss'" in r["error"] and "did you mean 'ks'" in r["error"]


def _header_command(name: str) -> str:
    md = notebook(name).cells[0].source
    return re.search(r"`(mkdir -p build/notebooks && papermill [^`]+)`", md)[1]


def _together(commands, **kw) -> None:
    """Run the commands at once (two cores), each as subprocess.run(..., check=True, capture_output=True) would."""
    procs = [(c, subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)) for c in commands]
    for c, proc in procs:
        out, err = proc.communicate()
        if proc.returncode:
            raise subprocess.CalledProcessError(proc.returncode, c, out, err)


@pytest.mark.slow
def test_a_fresh_clone_pairs_runs_and_stays_clean(tmp_path):
    """What a new user does: clone, `make setup`'s pairing, run a notebook as its header says (and once in place, as
    JupyterLab would save it), rebuild the report; nothing tracked moves."""
    clone = fresh_clone(tmp_path / "clone")
    assert all((clone / "notebooks" / f"{n}.ipynb").is_file() for n in NAMES)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XPOOL_REPO")}
    env["PATH"] = f"{pathlib.Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    env["PYTHONPATH"] = str(clone)
    names = ("05_memory", "03_single_gpu")
    _together([_header_command(name).replace("papermill", "papermill -p measure False", 1) for name in names],
              cwd=clone, env=env, shell=True)
    for name in names:
        assert (clone / "build" / "notebooks" / f"{name}.ipynb").is_file()
    inplace = "notebooks/05_memory.ipynb"        # beside it, the report (it reads data/, never notebooks/)
    _together([["papermill", inplace, inplace, "-p", "measure", "False", "--cwd", "notebooks"],
               [sys.executable, "-m", "xlab.report", "--no-notebooks"]], cwd=clone, env=env)
    assert '"output_type"' in (clone / inplace).read_text()     # outputs on disk, in the file git ignores
    status = subprocess.run(["git", "status", "--porcelain"], cwd=clone, capture_output=True, text=True).stdout
    assert status == "", status


@pytest.fixture
def tiny_repo(tmp_path, monkeypatch):
    """A checkout (as xlab.paths finds one) holding notebooks/05_memory.py as committed: its notebooks folder."""
    (tmp_path / "lab" / "xlab").mkdir(parents=True)
    (tmp_path / "pyproject.toml").write_text("")
    folder = tmp_path / "notebooks"
    folder.mkdir()
    (folder / "05_memory.py").write_text(committed("05_memory"))
    monkeypatch.setenv("XPOOL_REPO", str(tmp_path))
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    return folder


def _edit(path: pathlib.Path, when: float) -> None:
    """Add a line to the notebook's first unparameterised code cell (.py or .ipynb), dated `when`."""
    nb = jupytext.read(path)
    next(c for c in nb.cells if c.cell_type == "code" and "tags" not in c.metadata).source += "\nx = 1"
    jupytext.write(nb, path, fmt="py:percent" if path.suffix == ".py" else None)
    os.utime(path, (when, when))


def test_make_setup_pairs_each_notebook_and_leaves_the_paired_alone(tiny_repo):
    py, ipynb = tiny_repo / "05_memory.py", tiny_repo / "05_memory.ipynb"
    assert nbu.pair() == ["paired 05_memory.ipynb with 05_memory.py"] and ipynb.is_file()
    nb = nbformat.read(ipynb, as_version=4)
    nb.cells[-1].outputs = [nbformat.v4.new_output("stream", name="stdout", text="kept\n")]
    nbformat.write(nb, ipynb)
    os.utime(ipynb, (1e9, 1e9))
    assert nbu.pair() == [] and ipynb.stat().st_mtime == 1e9        # in step: not rewritten (open in JupyterLab)
    _edit(py, 2e9)                                                   # a .py changed by git pull: the .ipynb follows
    assert nbu.pair() == ["paired 05_memory.ipynb with 05_memory.py"] and nbu.unpaired() == []
    assert "kept" in ipynb.read_text() and "x = 1" in ipynb.read_text()     # its outputs kept
    _edit(ipynb, 3e9)                                                # edited without jupytext: kept, and said
    assert nbu.pair()[0].startswith("left 05_memory.ipynb alone")
    assert any("x = 1\nx = 1" in c.source for c in nbformat.read(ipynb, as_version=4).cells)


def test_a_stale_pair_is_named_outside_jupyterlab(tiny_repo, monkeypatch):
    """papermill runs the .ipynb: one whose cells differ from its .py's says so, and how to bring them in step."""
    assert nbu.stale("05_memory") == ""                          # no pair yet: nothing to say
    nbu.pair()
    assert nbu.stale("05_memory") == ""
    _edit(tiny_repo / "05_memory.py", time.time() + 10)
    assert "`make setup`" in nbu.stale("05_memory")
    monkeypatch.setenv("JPY_SESSION_NAME", str(tiny_repo / "05_memory.ipynb"))
    assert nbu.stale("05_memory") == ""                          # JupyterLab reads the .py itself


# --- tables for people
def test_numbers_for_people():
    assert [tables.number(v) for v in (92843.2, 0.02587, 1.4949, 482, 0, 1234567.8, float("nan"))] == \
        ["92,800", "0.0259", "1.49", "482", "0", "1,230,000", "n/a"]
    assert tables.number(1.234e-9) == "1.23×10⁻⁹"
    assert tables.interval(92843, 79812, 94832) == "92,800 [79,800, 94,800]"
    assert tables.interval(1.001, 1.0004, 1.0016) == "1.001 [1.000, 1.002]"         # bounds that differ print apart
    assert tables.interval(482, float("nan"), float("nan")) == "482 (single run)"
    assert [tables.cell("size_bytes", 4096.0), tables.cell("trial", 3.0), tables.cell("passed", True),
            tables.cell("date", "2026-11-30T01:02:03Z"), tables.cell("tokens_per_s", 92843.2)] == \
        ["4 KiB", "3", "yes", "2026-11-30", "92,800"]
    assert tables.label("tokens_per_s") == "tokens/s" and tables.label("some_column") == "some column"


def first_table(text: str) -> pd.DataFrame:
    """The first <table> of an HTML text, its cells as text, under its header's names."""
    from html.parser import HTMLParser

    class Cells(HTMLParser):
        rows, cell, done = [], None, False

        def handle_starttag(self, tag, attrs):
            if not self.done and tag == "tr":
                self.rows.append([])
            elif not self.done and tag in ("td", "th"):
                self.cell = ""

        def handle_endtag(self, tag):
            if tag in ("td", "th") and self.cell is not None:
                self.rows[-1].append(self.cell.strip())
                self.cell = None
            self.done = self.done or tag == "table"

        def handle_data(self, data):
            if self.cell is not None:
                self.cell += data

    parser = Cells()
    parser.rows = []
    parser.feed(text)
    return pd.DataFrame(parser.rows[1:], columns=parser.rows[0])


def test_a_summary_names_units_and_the_source_of_each_row():
    rows = synthetic.single_gpu()
    old = rows.assign(csv="single_gpu.csv", commit="aaaaaaa", run="aaaaaaa", date="2026-11-30T00:00:00Z")
    new = rows.assign(csv="single_gpu_recheck.csv", commit="bbbbbbb", run="bbbbbbb", date="2026-12-01T00:00:00Z",
                      batch=rows["batch"] + 1000)
    html = tables.summary(pd.concat([old, new], ignore_index=True), ["batch", "allocator"], ["tokens_per_s"])
    assert "<th>tokens/s</th>" in html and "<th>batch (sequences)</th>" in html
    assert "[1] single_gpu.csv · aaaaaaa · 2026-11-30; [2] single_gpu_recheck.csv · bbbbbbb · 2026-12-01" in html
    shown = first_table(html)                                         # each row names its source by number
    assert set(shown[tables.SOURCE]) == {"[1]", "[2]"}
    assert shown[tables.SOURCE].tolist() == ["[1]" if int(b.replace(",", "")) < 1000 else "[2]" for b in shown["batch (sequences)"]]
    one = tables.summary(old, ["batch", "allocator"], ["tokens_per_s"])
    assert "Rows from single_gpu.csv · aaaaaaa · 2026-11-30." in one and f"<th>{tables.SOURCE}</th>" not in one
    assert f"All {len(old)} rows" in one                                      # every row a click away


def test_a_summary_of_several_csvs_fits_beside_jupyterlabs_file_browser():
    """Notebook 03's first table, its rows from three CSVs, was 1,150 px wide, cut off in a 1,500 px window beside
    JupyterLab's file browser: each row named its CSV, commit and date. Numbered sources under the table keep its
    widest row (characters as a proxy for pixels) within what ~1,000 px show."""
    # what notebook 03 showed before the H100 run joined the lineage (its newest rows of each arm, three CSVs)
    runs = pd.concat([f for f in sources.frames(ROOT / "data", "single_gpu")        # the H100 runs' folders left out
                      if not re.match(r"\d{4}-\d\d-\d\d_", str(f["csv"].iloc[0]))], ignore_index=True)
    rows = runs[runs["order"] == runs.groupby(["batch", "allocator"])["order"].transform("max")]
    assert rows["csv"].nunique() > 2
    html = tables.summary(rows, ["batch", "allocator"], ["tokens_per_s", "host_ms_per_step", "gpu_ms_per_step",
                                                          "gpu_util_mean"])
    shown = first_table(html)
    assert max(len(" ".join(map(str, row))) for row in shown.itertuples(index=False)) <= 105


def test_a_long_table_folds_by_its_first_key():
    df = pd.DataFrame({"workload": [f"w{i // 5}" for i in range(40)], "allocator": [f"a{i % 5}" for i in range(40)],
                       "trial": 0, "ms_per_step": [float(i) for i in range(40)]})
    html = tables.summary(df, ["workload", "allocator"], ["ms_per_step"])
    folds = re.findall(r"<summary>(.*?)</summary>", html)
    assert len(folds) == 8 + 1 and folds[0] == "workload w0: 5 allocators; median ms/step from 0 (a0) to 4.00 (a4)"
    assert tables.summary(df.head(10), ["workload", "allocator"], ["ms_per_step"]).count("<summary>") == 1
    assert tables.summary(None, ["workload"], ["ms_per_step"]) is None


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
