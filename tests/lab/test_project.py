"""Project hygiene: environment.yml and pyproject.toml list the same dependencies; CI runs the README's test command."""
import pathlib
import re
import tomllib

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
# conda-forge name -> PyPI name, where they differ
CONDA_TO_PIP = {"cupy": "cupy-cuda12x", "pytorch-cpu": "torch"}
CONDA_ONLY = {"python", "pip", "c-compiler", "cuda-version"}


def _name(req: str) -> str:
    return re.split(r"[<>=!\[ ;]", req.strip(), maxsplit=1)[0].lower()


PACKAGES = {"xpool": ROOT / "xpool", "tapegpt": ROOT / "workload" / "tapegpt", "xlab": ROOT / "lab" / "xlab"}


def _project(where: str) -> dict:
    return tomllib.loads((ROOT / where / "pyproject.toml").read_text())["project"]


def test_environment_yml_matches_pyproject():
    """environment.yml installs what the three pyproject files ask for (the lab's extras included)."""
    lab = _project("lab")
    reqs = (_project(".")["dependencies"] + _project("workload")["dependencies"] + lab["dependencies"]
            + [r for extra in lab["optional-dependencies"].values() for r in extra] + ["cupy-cuda12x"])
    pip = {_name(r) for r in reqs} - {"xpool", "xpool-twin", "tapegpt"}
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
        for path in PACKAGES[pkg].rglob("*.py"):
            text = path.read_text()
            for name in banned:
                assert not re.search(rf"^\s*(from|import) {name}\b", text, re.M), f"{path} imports {name}"
            assert "__file__" not in text, f"{path} derives a path from __file__"


def test_the_c_sources_are_built_and_stay_small():
    """Every C file of xpool is a source of an extension in setup.py, and none is over 1,200 lines (#20): a file
    that grows past it is cut along its sections, the hit path kept in one compilation unit with _hot.h."""
    setup = (ROOT / "setup.py").read_text()
    sources = sorted((ROOT / "xpool").glob("*.c"))
    assert len(sources) >= 7
    for path in sources:
        assert f'"xpool/{path.name}"' in setup, f"{path.name} is not built by setup.py"
        lines = len(path.read_text().splitlines())
        assert lines <= 1200, f"{path.name} has {lines} lines"


def private_uses(source: str) -> list[str]:
    """What a module uses of xpool that is not its public API: an xpool._* module (or any _ part of an xpool
    module path), a _name imported from xpool, a _name read off xpool or off a name imported from it, any
    `._core` (but off another package: NumPy's np._core), and the private `_segments=` / `_stream_fn=`
    keywords (or any _ keyword to a name from xpool)."""
    import ast
    tree = ast.parse(source)
    found, from_xpool, others = [], {"xpool"}, set()

    def private_path(module):
        parts = module.split(".")
        return parts[0] == "xpool" and any(p.startswith("_") for p in parts[1:])

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if private_path(a.name):
                    found.append(f"line {node.lineno}: import {a.name}")
                bound = (a.asname or a.name).split(".")[0]
                (from_xpool if a.name.split(".")[0] == "xpool" else others).add(bound)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "xpool":
            for a in node.names:
                if private_path(node.module) or a.name.startswith("_"):
                    found.append(f"line {node.lineno}: from {node.module} import {a.name}")
                from_xpool.add(a.asname or a.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            root = node.value
            while isinstance(root, ast.Attribute):
                root = root.value
            name = root.id if isinstance(root, ast.Name) else None
            if (node.attr == "_core" and name not in others) or (
                    node.attr.startswith("_") and not node.attr.startswith("__") and name in from_xpool):
                found.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Call):
            root = node.func
            while isinstance(root, ast.Attribute):
                root = root.value
            for k in node.keywords:
                if k.arg in ("_segments", "_stream_fn") or (
                        k.arg and k.arg.startswith("_") and isinstance(root, ast.Name) and root.id in from_xpool):
                    found.append(f"line {node.lineno}: {k.arg}=")
    return found


def test_the_private_use_check_finds_each_kind():
    bad = ("import xpool._core\nfrom xpool import _core\nfrom xpool.cupy_adapter import _capsule_fn\n"
           "import xpool\nfrom xpool import cupy_adapter, Pool\n"
           "xpool.cupy_adapter._current_stream_fn()\npool._core.cfunctions()\ncupy_adapter._capsule_fn\n"
           "Pool(b, _segments={})\nf(_stream_fn=0)\nxpool.MemoryPool(_private=1)\n")
    assert len(private_uses(bad)) == 9
    good = ("import xpool\nfrom xpool_twin import testing\nfrom xpool.sizeclass import ALIGN\n"
            "testing.cfunctions(pool)\nxpool.Pool(b, release_idle=0)\nobj._other = 1\nf(_own=1)\n"
            "import numpy as np\nnp._core.multiarray\n")
    assert private_uses(good) == []


def test_the_lab_and_the_workload_use_only_xpools_public_api():
    """xlab and tapegpt configure and measure pools through xpool's public API (xpool.Settings; the C hooks
    through the tests' fixture package, xpool_twin.testing), never its private names (tests/ may, where they test
    internals)."""
    problems = []
    for pkg in ("xlab", "tapegpt"):
        for path in sorted(PACKAGES[pkg].rglob("*.py")):
            problems += [f"{path.relative_to(ROOT)} {p}" for p in private_uses(path.read_text())]
    assert problems == []


def test_the_readmes_numbers_are_the_reports():
    """README quotes the report, never numbers of its own: each number of its Results section is in REPORT.md."""
    readme = (ROOT / "README.md").read_text()
    results = readme.split("## Results", 1)[1].split("\n## ", 1)[0]
    page = (ROOT / "report" / "REPORT.md").read_text()
    numbers = re.findall(r"\d+\.\d+|\d+ of \d+|\d+ met|\d+ missed|\d+ within noise|\d+ targets", results)
    assert len(numbers) > 15
    for n in numbers:
        assert n in page, f"README's {n!r} is not in report/REPORT.md"
