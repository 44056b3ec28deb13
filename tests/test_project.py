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
    extras = project["optional-dependencies"]
    pip = {_name(r) for r in project["dependencies"] + extras["lab"] + extras["dev"]} - {"xpool"}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda = {_name(d) for d in env["dependencies"] if isinstance(d, str)} - CONDA_ONLY
    assert {CONDA_TO_PIP.get(n, n) for n in conda} == pip


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in readme and "make test" in ci
    assert "make report" in readme


def test_allocator_imports_no_research_dependency():
    """`import xpool` pulls in neither the lab's dependencies nor the sibling packages."""
    import subprocess
    import sys
    code = ("import sys, xpool; heavy = [m for m in ('pandas', 'matplotlib', 'tqdm', 'pynvml', 'tapegpt', 'xlab') "
            "if m in sys.modules]; print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "", f"import xpool imported {out}"


def test_packages_keep_their_direction():
    """The lab imports the workload and the allocator; the workload and the allocator never import the lab, and
    no package computes repository paths from its own location."""
    for pkg, banned in (("xpool", ("xlab", "tapegpt")), ("tapegpt", ("xlab",)), ("xlab", ())):
        for path in (ROOT / pkg).rglob("*.py"):
            text = path.read_text()
            for name in banned:
                assert not re.search(rf"^\s*(from|import) {name}\b", text, re.M), f"{path} imports {name}"
            assert "__file__" not in text, f"{path} derives a path from __file__"


def test_the_readmes_numbers_are_the_reports():
    """README quotes the report, never numbers of its own: each number of its Results section is in REPORT.md."""
    readme = (ROOT / "README.md").read_text()
    results = readme.split("## Results", 1)[1].split("\n## ", 1)[0]
    page = (ROOT / "report" / "REPORT.md").read_text()
    numbers = re.findall(r"\d+\.\d+|\d+ of \d+|\d+ met|\d+ missed|\d+ within noise|\d+ targets", results)
    assert len(numbers) > 15
    for n in numbers:
        assert n in page, f"README's {n!r} is not in report/REPORT.md"
