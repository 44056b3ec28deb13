"""Every name passed to a notebook is one of its parameters, or an error that names it and lists them: papermill
injects `-p NAME VALUE` as a cell of assignments (tagged `injected-parameters`) after the parameters cell, and a name
the notebook assigns in a later cell (`rows`, `checks`, `threads`) would otherwise be taken for the notebook's own.
The injected cell is papermill's own (papermill.parameterize_notebook), run as IPython runs it (`In`, the cells so
far), without a kernel; one papermill run with a kernel checks the whole way."""
import ast
import subprocess
import sys

import pytest

nbformat = pytest.importorskip("nbformat")
papermill_parameterize = pytest.importorskip("papermill.parameterize")

from papermill.iorw import load_notebook_node
from test_notebooks import NAMES, as_ipynb, notebook
from xlab import notebook_utils as nbu


def internal_name(name: str) -> str:
    """A name notebook `name` assigns in a cell after its parameters (the first one), not a parameter."""
    params = nbu.schema(name)
    code = [c.source for c in notebook(name).cells if c.cell_type == "code"]
    for source in code[1:]:
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store) and node.id not in params \
                    and not node.id.startswith("_"):
                return node.id
    raise AssertionError(f"{name} assigns no name of its own")


def as_papermill_runs(name: str, parameters: dict, folder) -> dict:
    """The namespace of notebook `name` at its setup cell as papermill runs it with `parameters`: its parameters
    cell, papermill's injected cell, then the setup cell, each executed and recorded in `In` as IPython does."""
    nb = papermill_parameterize.parameterize_notebook(load_notebook_node(str(as_ipynb(name, folder))), parameters)
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    tags = [c.metadata.get("tags", []) for c in nb.cells if c.cell_type == "code"]
    assert "injected-parameters" in tags[1] and "nbu.setup(" in code[2]
    namespace = {"In": [""]}
    for source in code[:2]:
        namespace["In"].append(source)
        exec(source, namespace)
    namespace["In"].append(code[2])
    return namespace


@pytest.mark.parametrize("name", NAMES)
def test_a_name_the_notebook_assigns_is_no_parameter(name, tmp_path):
    stray = internal_name(name)
    namespace = as_papermill_runs(name, {stray: 4}, tmp_path)
    with pytest.raises(nbu.ParameterError, match=rf"unknown parameter {stray!r} for notebook {name}.*; its "
                                                 rf"parameters: {', '.join(nbu.schema(name))}$"):
        nbu.check_parameters(name, namespace, gpu=False)


@pytest.mark.parametrize("name", NAMES)
def test_every_parameter_passes(name, tmp_path):
    defaults = {k: v for k, (_, v) in nbu.schema(name).items()}
    namespace = as_papermill_runs(name, {k: v for k, v in defaults.items() if k != "data_dir"}, tmp_path)
    assert nbu.check_parameters(name, namespace, gpu=False) == []


def test_only_this_runs_injected_cells_count():
    """A setup cell run again in JupyterLab after the whole notebook (the last cell before it assigns `rows`) and a
    papermill run without parameters name nothing."""
    name = "02_allocator_microbench"
    code = [c.source for c in notebook(name).cells if c.cell_type == "code"]
    namespace = {"In": ["", *code, "# Parameters\nsizes = 4\n", code[1]]}
    assert nbu.injected(namespace) == ["sizes"]
    namespace["In"] = ["", *code, code[1]]
    assert nbu.injected(namespace) == []
    assert nbu.injected({}) == []


def test_a_hint_names_the_notebooks_own_parameter():
    defaults = {k: v for k, (_, v) in nbu.schema("04_multi_gpu").items()}
    with pytest.raises(nbu.ParameterError, match=r"parameter 'worlds' must be a list\[int\] \(-p worlds 1, or "
                                                 r"-y 'worlds: \[1, 2\]'\), got 'two'"):
        nbu.check_parameters("04_multi_gpu", {**defaults, "worlds": "two"}, gpu=False)


@pytest.mark.slow
def test_papermill_exits_non_zero_on_a_name_the_notebook_assigns(tmp_path, monkeypatch):
    """The issue's case: `-p threads 4` on 02 ran to the end and exited 0."""
    monkeypatch.setenv("XPOOL_REPO", str(nbu.paths.repo_root()))
    nb = as_ipynb("02_allocator_microbench", tmp_path / "nb")
    r = subprocess.run([sys.executable, "-m", "papermill", str(nb), str(tmp_path / "out.ipynb"), "-p", "threads", "4",
                        "--cwd", str(nb.parent)], capture_output=True, text=True)
    assert r.returncode != 0
    assert r.stderr.strip().splitlines()[-1].startswith(
        "ParameterError: unknown parameter 'threads' for notebook 02_allocator_microbench")


HEAVY = ("pandas", "numpy", "matplotlib", "jupytext", "nbformat", "cupy", "torch", "xlab.notebook_utils")


@pytest.mark.parametrize("name", NAMES)
def test_the_cell_after_the_parameters_checks_them_before_any_other_import(name):
    """JupyterLab showed a misspelled parameter 11-28 s after the kernel started: the check ran after pandas,
    matplotlib, jupytext and CuPy had loaded. The cell after the parameters checks first, with xlab.parameters alone."""
    code = [c.source for c in notebook(name).cells if c.cell_type == "code"]
    body = ast.parse(code[1]).body
    assert ast.unparse(body[0]) == "from xlab import parameters"
    assert ast.unparse(body[1]) == f"parameters.check({name!r}, globals())"


@pytest.mark.parametrize("name", NAMES)
def test_the_check_fails_without_loading_anything_heavy(name, tmp_path):
    """The setup cell up to its check, run as papermill runs it with a name the notebook assigns, in a fresh
    interpreter: a ParameterError, and none of HEAVY imported."""
    stray = internal_name(name)
    nb = papermill_parameterize.parameterize_notebook(load_notebook_node(str(as_ipynb(name, tmp_path))), {stray: 4})
    code = [c.source for c in nb.cells if c.cell_type == "code"]
    check = "\n".join(code[2].splitlines()[:3])
    script = f"""
import sys
namespace = {{"In": ["", {code[0]!r}, {code[1]!r}, {code[2]!r}]}}
exec({code[0]!r}, namespace)
exec({code[1]!r}, namespace)
try:
    exec({check!r}, namespace)
except Exception as e:
    print(type(e).__name__, e)
print(sorted(m for m in {HEAVY!r} if m in sys.modules))
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=nbu.paths.repo_root())
    assert r.returncode == 0, r.stderr
    error, imported = r.stdout.strip().splitlines()
    assert error.startswith(f"ParameterError unknown parameter {stray!r} for notebook {name}")
    assert imported == "[]"


@pytest.mark.parametrize("name", NAMES)
def test_the_cells_read_without_jupytext_are_jupytexts(name):
    """xlab.parameters reads a notebook's code cells from its percent-format .py itself (jupytext takes seconds to
    import): the same sources and the same parameters cell as jupytext reads."""
    import jupytext
    from xlab import parameters
    cells = jupytext.read(nbu.paths.repo_root() / "notebooks" / f"{name}.py").cells
    assert parameters.code_cells(name) == [(c.source, "parameters" in c.metadata.get("tags", ()))
                                           for c in cells if c.cell_type == "code"]
