"""The product stays small and readable (issue #42): its C files call each other in one direction only (a scheme is
reached through its table), no C file is over 900 lines nor any function over 60, _core.h lists every file of the
extension and every lock, xpool/ is at most 7,000 lines, and the public surface is the frozen one."""
import pathlib
import re

import xpool
from xpool.pool import Pool

ROOT = pathlib.Path(__file__).resolve().parents[2]
XPOOL = ROOT / "xpool"
C_FILES = sorted(XPOOL.glob("*.c"))


def _strip(text: str) -> str:
    """C source without comments and string literals (a name in them is no call)."""
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    text = re.sub(r"//[^\n]*", " ", text)
    return re.sub(r'"(?:\\.|[^"\\])*"', '""', text)


def _functions(text: str, exported: bool = False):
    """(name, first line, last line) of each function defined in a C file (a body that opens at column 0); only
    those other files can call (not static) when `exported`."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("{"):
            j = i - 1
            while j >= 0 and "(" not in lines[j]:
                j -= 1
            m = re.search(r"(\w+)\s*\(", lines[j]) if j >= 0 else None
            end = next(k for k in range(i, len(lines)) if lines[k].startswith("}"))
            if m and not (exported and lines[j].lstrip().startswith("static")):
                yield m.group(1), i, end


def _calls_between_files() -> dict:
    """{file: {files whose functions it calls by name}}, over the extensions' C files."""
    defined = {}
    for path in C_FILES:
        for name, _, _ in _functions(_strip(path.read_text()), exported=True):
            defined.setdefault(name, path.name)
    calls = {}
    for path in C_FILES:
        text = _strip(path.read_text())
        used = set(re.findall(r"(?<![.>\w])(\w+)\s*\(", text))   # not a member: A->ops->try_(...) is no call by name
        calls[path.name] = {defined[n] for n in used if n in defined and defined[n] != path.name}
    return calls


def test_no_two_c_files_call_each_other():
    calls = _calls_between_files()
    pairs = sorted((a, b) for a, callees in calls.items() for b in callees if a in calls.get(b, set()) and a < b)
    assert pairs == [], f"these files call each other: {pairs}"


def test_the_recovery_ladder_reaches_a_scheme_through_its_table_only():
    calls = _calls_between_files()
    assert calls["_ladder.c"] <= {"_pool.c"}, calls["_ladder.c"]
    for scheme in ("_blocks.c", "_pages.c"):
        assert "_alloc.c" not in calls[scheme] and "_module.c" not in calls[scheme]
    assert "_pages.c" not in calls["_alloc.c"] and "_blocks.c" not in calls["_alloc.c"]


def test_no_c_file_over_900_lines_nor_function_over_60():
    for path in C_FILES:
        text = path.read_text()
        assert len(text.splitlines()) <= 900, f"{path.name} has {len(text.splitlines())} lines"
        long = [(name, end - start + 1) for name, start, end in _functions(text) if end - start + 1 > 60]
        assert long == [], f"{path.name}: functions over 60 lines: {long}"


def test_core_h_lists_every_file_and_every_lock():
    core = (XPOOL / "_core.h").read_text()
    header = core.split("#ifndef XPOOL_CORE_H", 1)[0]
    setup = (ROOT / "setup.py").read_text()
    sources = re.findall(r'"xpool/(_\w+\.c)"', setup.split('"xpool._vmm"', 1)[0])
    assert sources and all(f"{name} " in header for name in sources), sources
    locks = set()
    for path in [*C_FILES, *XPOOL.glob("*.h")]:
        text = _strip(path.read_text())
        locks |= set(re.findall(r"pthread_mutex_t\s+(\w+)", text))
    locks -= {"lock"}                                   # DevicePool.lock and Timeline.lock, named by their types
    assert {"registry_lock", "debug_lock", "pin_lock", "ended_lock"} <= locks
    lock_list = header.split("Locks, and their order", 1)[1]
    for name in locks:
        assert name in lock_list, f"_core.h's list of locks misses {name}"
    assert "DevicePool.lock" in lock_list and "Timeline.lock" in lock_list


def test_the_package_is_at_most_7160_lines():
    """7000 until issue #50's mends (6999 at 0c022c2): the ended-thread give-back and its Note (~35 C lines), and
    CuPy's MemoryPool contract, reads without effects, one message per entry point and named errors (~110 Python)."""
    files = [p for p in XPOOL.iterdir() if p.suffix in (".c", ".h", ".py")]
    total = sum(len(p.read_text().splitlines()) for p in files)
    assert total <= 7160, f"xpool/ has {total} lines"


def test_the_public_surface_is_the_frozen_one():
    assert len(xpool.__all__) <= 14 and all(hasattr(xpool, n) for n in xpool.__all__)
    members = [n for n in dir(Pool) if not n.startswith("_")]
    assert len(members) <= 12, members
    assert set(members) == {"allocate", "empty_cache", "trim", "stats", "reset_peak_stats", "set_limit",
                            "get_limit", "check", "timeline", "live_blocks", "check_ipc"}
    from xpool.settings import ENV
    assert list(ENV) == ["scheme", "classes_per_doubling", "limit", "debug", "timeline"]
