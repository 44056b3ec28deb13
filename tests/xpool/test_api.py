"""The public face: the backend contract is a Protocol both shipped backends meet, the public API says what it
takes, returns and raises, and the surface stays small: 13 names, a Pool of 12 members (a Snapshot's counters:
tests/xpool/test_stats.py); the names retired at 0.3.0 are gone, and the CHANGELOG's table says what replaced each."""
import importlib
import inspect
import itertools
import pathlib
import re

import pytest

import xpool
from faults import AddressBackend, FaultyBackend
from xpool import Pool
from xpool.backends import Backend, CupyBackend
from xpool.pool import BACKEND_METHODS
from xpool_twin import HostBackend


PROTOCOL_METHODS = sorted(n for n, v in vars(Backend).items() if callable(v) and not n.startswith("_"))


def test_the_pool_asks_for_exactly_the_protocols_methods():
    assert sorted(BACKEND_METHODS) == PROTOCOL_METHODS


@pytest.mark.parametrize("cls", [HostBackend, CupyBackend, FaultyBackend, AddressBackend])
def test_backends_meet_the_protocol_method_for_method(cls):
    for name in PROTOCOL_METHODS:
        want = list(inspect.signature(getattr(Backend, name)).parameters)
        have = list(inspect.signature(getattr(cls, name)).parameters)
        assert have == want, f"{cls.__name__}.{name}{have} != Backend.{name}{want}"


def test_a_host_backend_is_a_backend_at_runtime():
    assert isinstance(HostBackend(), Backend) and isinstance(AddressBackend(), Backend)
    assert not isinstance(object(), Backend)


def test_the_protocol_documents_what_a_backend_writer_needs():
    doc = inspect.getdoc(Backend)
    for topic in ("Units", "from any thread", "MemoryError", "frees the whole block or raises", "Fork",
                  "capturing(device, stream)"):
        assert topic in doc, topic


def test_a_backend_written_from_the_protocol_alone_runs_a_pool():
    pool = Pool(AddressBackend())
    a = pool.allocate(1000)
    a.release()
    assert pool.empty_cache() == 2 << 20      # the 2 MiB segment the 1024 B block was cut from


def _public_callables():
    for name in xpool.__all__:
        obj = getattr(xpool, name)
        if inspect.isfunction(obj):
            yield name, obj
    for cls in (Pool, xpool.MemoryPool):
        for name, fn in vars(cls).items():
            if not name.startswith("_") and inspect.isfunction(fn):
                yield f"{cls.__name__}.{name}", fn


@pytest.mark.parametrize("name, fn", list(_public_callables()), ids=lambda v: v if isinstance(v, str) else "")
def test_public_api_says_what_it_takes_returns_and_raises(name, fn):
    doc = inspect.getdoc(fn) or ""
    assert doc, f"{name} has no docstring"
    params = [p for p in inspect.signature(fn).parameters if p not in ("self", "kwargs")]
    for p in params:      # each argument named: ``p`` in the prose, or an Args: entry `p (type):` / `p:`
        assert f"``{p}``" in doc or f"{p} (" in doc or f"{p}:" in doc, f"{name} takes {p} but its docstring says nothing of it"
    source = inspect.getsource(fn)
    if "return " in source and "-> None" not in source.split(":\n", 1)[0]:
        assert "Returns:" in doc or "Yields:" in doc, f"{name} returns something; its docstring has no Returns:"


def test_the_core_exports_what_the_package_needs_and_no_lab_probe():
    """xpool._core is the allocator's: the lab's timing probes live in the lab (tests/lab/test_probes.py)."""
    from xpool import _core
    assert sorted(n for n in dir(_core) if not n.startswith("__")) == sorted([
        "Allocation", "Allocator", "EVENT_SIZE", "MAX_CLASSES_PER_DOUBLING", "MAX_DEVICES", "MAX_REQUEST",
        "Settings", "size_class", "torch_bound",
        # CUDA's virtual-memory ops (the expandable scheme's)
        "cuda_vmm", "VmmError", "VmmOutOfMemory", "ABI", "CAPSULE", "OK", "OOM", "INVALID", "UNAVAILABLE", "ERROR"])


# --- the surface: what is public, and the names retired at 0.3.0

PUBLIC = ["Pool", "MemoryPool", "Settings", "install", "uninstall", "use", "current", "enable_torch",
          "empty_cache", "stats", "OutOfMemoryError", "CorruptionError"]
POOL_MEMBERS = ["allocate", "check", "check_ipc", "empty_cache", "get_limit", "live_blocks", "reset_peak_stats",
                "set_limit", "settings", "stats", "timeline", "trim"]
ROOT = pathlib.Path(__file__).resolve().parents[2]
# every name 0.2.0 kept only to raise (xpool._MOVED, xpool.pool._REMOVED, xpool.settings.REMOVED and REMOVED_VALUES,
# the stubs xpool.testing and xpool._vmm): retired at 0.3.0, each a row of the CHANGELOG's table (decision 0012)
RETIRED = {
    "xpool": {"snapshot", "Snapshot", "size_class", "Backend", "CupyBackend", "DeviceOutOfMemory", "installed",
              "CorruptionWarning", "RequestTooLargeError", "IpcUnsupportedError", "SCHEMES", "HostBackend", "testing",
              "_vmm"},
    "Pool": {"snapshot", "devices", "scheme", "classes_per_doubling", "debug", "set_debug", "enable_timeline",
             "reserve", "backend"},
    "setting": {"release_on_miss", "release_idle", "release_bound", "small_segment", "segment_round", "peer_access"},
    "scheme": {'"xpool"'},
}


def _retired_table() -> list[tuple[str, str, str]]:
    """The CHANGELOG's table of retired names: (kind, name, what to use instead) per row."""
    text = (ROOT / "CHANGELOG.md").read_text()
    table = text.split("| Retired | Use instead |", 1)[1].splitlines()[2:]
    rows = []
    for line in itertools.takewhile(lambda ln: ln.lstrip().startswith("|"), table):
        retired, use = (cell.strip() for cell in line.strip().strip("|").split("|"))
        m = re.fullmatch(r"`(xpool|Pool)\.(\w+)`|(setting|scheme) `([^`]+)`", retired)
        assert m, line
        rows.append((m[1] or m[3], m[2] or m[4], use))
    return rows


def test_the_changelog_lists_every_retired_name_once():
    rows = _retired_table()
    assert len(rows) == len({(kind, name) for kind, name, _ in rows}) == 30
    assert {kind: {name for k, name, _ in rows if k == kind} for kind in RETIRED} == RETIRED


@pytest.mark.parametrize("kind, name, use", _retired_table(), ids=[f"{k}-{n}" for k, n, _ in _retired_table()])
def test_a_retired_name_is_gone_and_its_replacement_is_there(kind, name, use):
    pool = Pool(HostBackend())
    if kind == "xpool":
        assert name not in dir(xpool)
        with pytest.raises(AttributeError, match=f"^module 'xpool' has no attribute '{name}'$"):
            getattr(xpool, name)
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"xpool.{name}")
    elif kind == "Pool":
        assert not hasattr(Pool, name)
        with pytest.raises(AttributeError, match=f"^'Pool' object has no attribute '{name}'$"):
            getattr(pool, name)
    elif kind == "setting":
        assert name not in xpool.settings.ENV
        with pytest.raises(TypeError, match=f"unexpected keyword argument '{name}'"):
            xpool.Settings(**{name: 1})
        with pytest.raises(TypeError, match=f"Pool\\(\\) got no setting '{name}'"):
            Pool(HostBackend(), **{name: 1})
    else:
        with pytest.raises(ValueError, match=f"scheme={name.strip(chr(34))!r}: expected one of 'segments'"):
            xpool.Settings(scheme=name.strip('"'))
    # the replacement, where it is a path of the package, a twin's or a pool's, is reached as written
    path = re.match(r"`((?:xpool|xpool_twin|pool)(?:\.\w+)+)(?:\(\))?`", use)
    if path:
        head, *attrs = path[1].split(".")
        obj = pool if head == "pool" else importlib.import_module(head)
        for attr in attrs:          # an attribute, else a submodule (xpool_twin.testing)
            obj = getattr(obj, attr) if hasattr(obj, attr) else importlib.import_module(f"{obj.__name__}.{attr}")


def test_a_retired_settings_variable_is_not_read(monkeypatch):
    want = xpool.Settings()
    for name in RETIRED["setting"]:
        monkeypatch.setenv(f"XPOOL_{name.upper()}", "1")
    assert xpool.Settings() == want and Pool(HostBackend()).settings == want


def test_the_vmm_names_live_in_the_core():
    from xpool import _core
    assert issubclass(_core.VmmOutOfMemory, _core.VmmError) and callable(_core.cuda_vmm)


def test_all_is_the_small_public_surface():
    assert xpool.__all__ == PUBLIC and len(xpool.__all__) <= 14
    assert all(hasattr(xpool, name) for name in xpool.__all__)
    assert xpool.stats is xpool.__dict__["stats"] and callable(xpool.stats)


def test_an_unknown_name_is_an_ordinary_attribute_error():
    with pytest.raises(AttributeError, match="module 'xpool' has no attribute 'nothing_here'"):
        xpool.nothing_here


def test_pool_has_at_most_12_public_members():
    members = [n for n in dir(Pool) if not n.startswith("_")]
    assert len(members) <= 12 and members == sorted(set(POOL_MEMBERS) - {"settings"})
    pool = Pool(HostBackend())
    assert [n for n in dir(pool) if not n.startswith("_")] == POOL_MEMBERS


def test_an_unknown_pool_member_is_an_ordinary_attribute_error():
    with pytest.raises(AttributeError, match="'Pool' object has no attribute 'nothing_here'"):
        Pool(HostBackend()).nothing_here
