"""The public face (issue #10): the backend contract is a Protocol both shipped backends meet, and the
public API says what it takes, returns and raises."""
import inspect

import pytest

import xpool
from faults import AddressBackend, FaultyBackend
from xpool import HostBackend, Pool
from xpool.backends import Backend, CupyBackend
from xpool.pool import BACKEND_METHODS

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
    for topic in ("Units", "Thread-safety", "MemoryError", "Failed frees", "Fork"):
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
    if params:
        assert "Args:" in doc, f"{name} takes {params} but its docstring has no Args:"
    source = inspect.getsource(fn)
    if "return " in source and "-> None" not in source.split(":\n", 1)[0]:
        assert "Returns:" in doc or "Yields:" in doc, f"{name} returns something; its docstring has no Returns:"


def test_the_core_exports_what_the_package_needs_and_no_lab_probe():
    """xpool._core is the allocator's: the lab's timing probes live in xlab._probes (#20)."""
    from xpool import _core
    assert sorted(n for n in dir(_core) if not n.startswith("__")) == [
        "Allocation", "Allocator", "EVENT_SIZE", "MAX_CLASSES_PER_DOUBLING", "MAX_DEVICES", "MAX_REQUEST",
        "Settings", "size_class", "torch_bound"]
    from xlab import _probes
    assert {"time_pairs", "time_calls", "time_torch_pairs", "noop_cfunctions"} <= set(dir(_probes))
