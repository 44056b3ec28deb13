"""Project hygiene: environment.yml and pyproject.toml list the same dependencies; CI runs the README's test command."""
import pathlib
import re
import tomllib

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[1]
# conda-forge name -> PyPI name, where they differ
CONDA_TO_PIP = {"cupy": "cupy-cuda12x", "pytorch-cpu": "torch"}
CONDA_ONLY = {"python", "pip", "c-compiler", "cuda-version"}


def _name(req: str) -> str:
    return re.split(r"[<>=!\[ ;]", req.strip(), maxsplit=1)[0].lower()


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pip = {_name(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda = {_name(d) for d in env["dependencies"] if isinstance(d, str)} - CONDA_ONLY
    assert {CONDA_TO_PIP.get(n, n) for n in conda} == pip


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in readme and "make test" in ci
    assert "make report" in readme
