"""Every Python block of README.md and docs/ runs as written, in a fresh interpreter: a block marked
`<!-- snippet: gpu -->` (`gpu torch`: PyTorch with CUDA too) on a GPU, the others here too, where `xpool.install()`
and `xpool.MemoryPool()` get the host twin (xpool_twin.TwinBackend) in place of the GPU. On any machine each block
defines every name it uses, and every `xpool.NAME` the pages give (in prose too) exists."""
import ast
import builtins
import importlib
import inspect
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
# every page a user reads, but the record of the names retired at 0.3.0, which names them to say they are gone
PAGES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if p.name != "0012-retired-names.md")]
BLOCK = re.compile(r"(?:<!-- snippet: ([a-z ]+) -->\n)?```python\n(.*?)```", re.S)
# what a block runs after, on a machine without a GPU: every pool xpool makes holds host memory
ON_THE_TWIN = """
import xpool.cupy_adapter as adapter
from xpool_twin import TwinBackend
_init = adapter.MemoryPool.__init__
def _on_the_twin(self, settings=None, *, backend=None, **fields):
    _init(self, settings, backend=TwinBackend() if backend is None else backend, **fields)
adapter.MemoryPool.__init__ = _on_the_twin
"""


def blocks() -> list:
    """(id, marks, source) of each Python block of the pages."""
    found = []
    for page in PAGES:
        text = page.read_text()
        for m in BLOCK.finditer(text):
            line = text[:m.start(2)].count("\n") + 1
            found.append(pytest.param(set((m[1] or "").split()), m[2], id=f"{page.relative_to(ROOT)}:{line}"))
    return found


BLOCKS = blocks()


def undefined(source: str) -> list[str]:
    """The names a block reads that it never binds (nor Python does)."""
    tree = ast.parse(source)
    bound = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
    return sorted({n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)} - bound)


def run(source: str, prelude: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", f"{prelude}\nexec(compile({source!r}, 'snippet', 'exec'))"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_the_pages_have_blocks_of_both_kinds():
    marks = [p.values[0] for p in BLOCKS]
    assert any("gpu" in m for m in marks) and any(not m for m in marks)
    assert {"README.md:", "docs/usage.md:"} <= {p.id.split(":")[0] + ":" for p in BLOCKS}


@pytest.mark.parametrize("marks, source", BLOCKS)
def test_a_block_defines_what_it_uses(marks, source):
    assert undefined(source) == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_xpool_name_a_page_gives_exists(page):
    """`xpool.snapshot()`, `xpool.RequestTooLargeError` and the like raise "moved": a page names where they are."""
    missing = []
    for path in sorted(set(re.findall(r"(?<![\w/.])xpool((?:\.[A-Za-z_]\w*)+)", page.read_text()))):
        parts, obj = path.strip(".").split("."), importlib.import_module("xpool")
        for i, part in enumerate(parts):
            try:
                obj = getattr(obj, part)
            except AttributeError:
                if isinstance(obj, type) and f"self.{part} =" in inspect.getsource(obj):    # an instance's
                    break
                try:
                    obj = importlib.import_module("xpool." + ".".join(parts[:i + 1]))
                except ImportError:
                    missing.append("xpool" + path)
                    break
    assert missing == []


@pytest.mark.parametrize("marks, source", [p for p in BLOCKS if "gpu" not in p.values[0]],
                         ids=[p.id for p in BLOCKS if "gpu" not in p.values[0]])
def test_a_block_runs_on_the_twin(marks, source):
    r = run(source, ON_THE_TWIN)
    assert r.returncode == 0, r.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("marks, source", BLOCKS)
def test_a_block_runs_on_a_gpu(marks, source):
    if "torch" in marks:
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA build of PyTorch")
    r = run(source)
    assert r.returncode == 0, r.stderr
