"""Tests that cannot rot unseen: every name of xpool that a test, a fixture of the lab or the lab itself reaches is one
the package has, checked on a CPU.  A GPU-only test skips on CI, so a name removed or renamed under it (the freeze's
``xpool._vmm``, ``MemoryPool.scheme``, ``enable_timeline``) would fail only on a GPU; read here from the source
(``ast``), each chain ``xpool.a.b``, each ``from xpool... import`` and each member of a pool (``pool.settings.scheme``,
``vm._core.stats``) is resolved against the live package and a live pool."""
import ast
import functools
import importlib
import pathlib

import pytest

import xpool
from xpool.backends import CupyBackend
from xpool_twin import TwinBackend

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCES = sorted({*ROOT.glob("tests/**/*.py"), *ROOT.glob("lab/xlab/**/*.py"), *ROOT.glob("workload/**/*.py")}
                 - {*ROOT.glob("tests/xpool/fixtures/twin/build/**/*.py")})
# names a test binds to a pool: its fixtures' names (tests/conftest.py's pool, test_gpu_expandable's vm), and
# every name assigned from, or bound by `with ... as`, a call of one of these
POOL_FIXTURES = {"pool", "vm"}
POOL_MAKERS = {"MemoryPool", "Pool", "install", "use", "enable_torch", "current", "installed"}
# chains reached on purpose where they are missing: test_api's unknown name; the lab's reading of a build before
# the freeze (xlab.builds), behind hasattr
ABSENT_ON_PURPOSE = {"xpool.nothing_here", "Pool().nothing_here", "pool.snapshot"}


def _chain(node, calls=False) -> list[str] | None:
    """`a.b.c` as ["a", "b", "c"]; None for anything else (a subscript) at its root, and for a call unless `calls`,
    then a call of a pool's maker as its first name: `xpool.current().settings` as ["xpool.current()", "settings"]."""
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if calls and _maker(node):
        return [ast.unparse(node.func) + "()", *reversed(names)]
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(names)]


def _resolve(obj, attrs: list[str]) -> str | None:
    """None when `attrs` are reached from `obj` (an attribute, else a submodule of a module); else the first one
    missing."""
    for i, attr in enumerate(attrs):
        if hasattr(obj, attr):
            obj = getattr(obj, attr)
        elif hasattr(obj, "__path__"):                  # a package: its submodule
            try:
                obj = importlib.import_module(f"{obj.__name__}.{attr}")
            except ModuleNotFoundError:
                return ".".join(attrs[:i + 1])
        else:
            return ".".join(attrs[:i + 1])
    return None


def _maker(call) -> bool:
    chain = _chain(call.func) if isinstance(call, ast.Call) else None
    # a bare name only for the classes (`from xpool import Pool`): a lab's own `installed()` is not xpool's
    return bool(chain) and chain[-1] in POOL_MAKERS and (chain[0] == "xpool" or chain in (["Pool"], ["MemoryPool"]))


class Reach(ast.NodeVisitor):
    """Every xpool name one source file reaches: (line, what it spells, the module or pool it starts from)."""

    def __init__(self):
        self.modules: dict[str, str] = {}    # a local name -> the xpool module it stands for
        self.reached: list[tuple[int, str, str, list[str]]] = []   # line, spelling, root ("module:..."/"pool")

    def visit_Import(self, node):
        for a in node.names:
            if a.name == "xpool" or a.name.startswith("xpool."):
                if a.asname:
                    self.modules[a.asname] = a.name
                else:
                    self.modules["xpool"] = "xpool"
                    self.reached.append((node.lineno, a.name, "xpool", a.name.split(".")[1:]))

    def visit_ImportFrom(self, node):
        if node.module and (node.module == "xpool" or node.module.startswith("xpool.")) and node.level == 0:
            for a in node.names:
                if a.name == "*":
                    continue
                self.reached.append((node.lineno, f"{node.module}.{a.name}", "xpool",
                                     [*node.module.split(".")[1:], a.name]))
                target = f"{node.module}.{a.name}"
                try:
                    if hasattr(importlib.import_module(target), "__file__"):
                        self.modules[a.asname or a.name] = target
                except ImportError:
                    pass

    def visit_Attribute(self, node):
        chain = _chain(node)
        if chain and chain[0] in self.modules:
            module = self.modules[chain[0]]
            self.reached.append((node.lineno, ".".join([module, *chain[1:]]), module, chain[1:]))
            return                                      # the longest chain alone, not its prefixes
        self.generic_visit(node)


class PoolNames(ast.NodeVisitor):
    """Per function, the names bound to a pool; each `name.member...` chain on one of them."""

    def __init__(self):
        self.reached: list[tuple[int, str, list[str]]] = []

    def visit_FunctionDef(self, node):
        pools = {a.arg for a in node.args.args if a.arg in POOL_FIXTURES} if node.name.startswith("test") else set()
        for sub in ast.walk(node):
            if isinstance(sub, ast.Assign) and _maker(sub.value):
                pools |= {t.id for t in sub.targets if isinstance(t, ast.Name)}
            elif isinstance(sub, ast.withitem) and _maker(sub.context_expr) and isinstance(sub.optional_vars, ast.Name):
                pools.add(sub.optional_vars.id)
        seen = set()
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store):
                seen |= {id(n) for n in ast.walk(sub)}      # an attribute a test sets on its pool
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute) and id(sub) not in seen:
                chain = _chain(sub, calls=True)
                if chain and (chain[0] in pools or chain[0].endswith("()")):
                    self.reached.append((sub.lineno, ".".join(chain), chain[1:]))
                    seen |= {id(n) for n in ast.walk(sub)}   # its prefixes are the same chain
        self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef


@functools.cache
def _live_pools():
    """Pools with every member a test may reach: a debug hook, a timeline, each scheme."""
    return tuple(xpool.MemoryPool(backend=TwinBackend(), scheme=s, debug="raise", timeline=16)
            for s in ("segments", "expandable", "seed"))


def missing_names(source: str, pools=None) -> list[str]:
    """Each xpool name `source` reaches that the package, or a pool, does not have: "line N: spelling"."""
    tree = ast.parse(source)
    reach = Reach()
    reach.visit(tree)
    missing = []
    for line, spelled, module, attrs in reach.reached:
        if spelled in ABSENT_ON_PURPOSE:
            continue
        gone = _resolve(importlib.import_module(module.split(".")[0]), [*module.split(".")[1:], *attrs])
        if gone is not None:
            missing.append(f"line {line}: {spelled} (xpool has no {gone})")
    names = PoolNames()
    names.visit(tree)
    pools = pools if pools is not None else _live_pools()
    for line, spelled, attrs in names.reached:
        if spelled in ABSENT_ON_PURPOSE:
            continue
        if attrs[0] == "_backend":                      # a pool's backend: CuPy's on a GPU, the twin on a CPU
            if len(attrs) > 1 and all(_resolve(b, attrs[1:]) is not None for b in (CupyBackend, TwinBackend())):
                missing.append(f"line {line}: {spelled} (neither CupyBackend nor TwinBackend has {attrs[1]})")
        elif all(_resolve(p, attrs) is not None for p in pools):
            missing.append(f"line {line}: {spelled} (no pool has {_resolve(pools[0], attrs)})")
    return sorted(missing, key=lambda m: int(m.split(":")[0].removeprefix("line ")))


def test_the_check_finds_each_kind_of_missing_name():
    bad = ("import xpool\nfrom xpool import _vmm\nfrom xpool.backends import HostBackend\nimport xpool.testing\n"
           "xpool.enable_timeline(10)\nxpool.backends.CupyBackend.nothing\n"
           "def test(pool):\n    pool.scheme\n    pool.enable_timeline(10)\n    pool._core.no_such_hook()\n"
           "def test_made():\n    p = xpool.MemoryPool(scheme='seed')\n    p.set_debug('raise')\n"
           "    with xpool.use() as q:\n        q.snapshot()\n    xpool.cupy_adapter.installed().scheme\n")
    found = missing_names(bad)
    assert [f.split(":")[0] for f in found] == [f"line {n}" for n in (2, 3, 4, 5, 6, 8, 9, 10, 13, 15, 16)], found
    good = ("import xpool\nfrom xpool import _core, Pool\nfrom xpool.backends import CupyBackend\nimport xpool.errors\n"
            "xpool.errors.IpcUnsupportedError\n_core.VmmError\nxpool.backends.CupyBackend().vmm().anything\n"
            "def test(pool, other):\n    pool.settings.scheme\n    pool._core.stats(0)\n    other.scheme\n"
            "def test_made():\n    p = xpool.MemoryPool(scheme='seed')\n    p.timeline()\n    p.stats().hits\n")
    assert missing_names(good) == []


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_xpool_name_a_source_reaches_is_there(path):
    assert missing_names(path.read_text()) == [], path
