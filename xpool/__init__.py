"""xpool: a measured, per-device caching allocator for CuPy and PyTorch.

    import xpool
    pool = xpool.install()            # CuPy now allocates through xpool
    ...
    xpool.stats()                     # exact counters per device (a Snapshot; .frame() for pandas)
    xpool.enable_torch()              # PyTorch's CUDA tensors from the same pool (before torch's first one)

Five settings (``xpool.Settings``: scheme, limit, debug, timeline, classes_per_doubling) come from arguments, else
``XPOOL_*`` variables. ``xpool.backends`` and ``xpool.errors`` hold the rest.
"""
from __future__ import annotations

try:
    from . import _core  # noqa: F401 - the C hot path; everything below needs it
except ImportError as e:  # a source checkout that was never built
    raise ImportError("xpool's C core (xpool._core) is not built: run `pip install -e .` or "
                      "`python setup.py build_ext --inplace` in the repository (needs a C compiler)") from e

from .cupy_adapter import MemoryPool, current, install, uninstall, use
from .errors import CorruptionError, OutOfMemoryError
from .pool import Pool
from .settings import Settings
from .counters import Snapshot
from .torch_allocator import enable as enable_torch   # imports torch only when called

__version__ = "0.3.0"
__all__ = [
    "Pool", "MemoryPool", "Settings", "install", "uninstall", "use", "current", "enable_torch",
    "empty_cache", "stats", "OutOfMemoryError", "CorruptionError",
]

del Snapshot


def empty_cache() -> int:
    """Give the current pool's cached blocks back to the devices.

    The current pool is this thread's ``with xpool.use()`` pool, else the installed one.

    Returns:
        int: bytes given back (0 when xpool is not in use).

    Raises:
        Exception: a failed ``backend.free`` (see ``Pool.empty_cache``).
    """
    pool = current()
    return pool.empty_cache() if pool else 0


def stats():
    """The current pool's exact counters (this thread's ``with xpool.use()`` pool, else the installed one).

    Returns:
        xpool.counters.Snapshot: per device, summed as attributes (``xpool.stats().device_mallocs``), differenced by
        ``-``; ``.frame()`` gives a pandas DataFrame. Empty, and saying so, when no pool is in use.
    """
    pool = current()
    if pool is None:
        import importlib.util
        from .counters import Snapshot
        from .cupy_adapter import _NEEDS_CUPY
        note = "no xpool pool in use: xpool.install(), xpool.use() or xpool.enable_torch() make one"
        if importlib.util.find_spec("cupy") is None:
            note += f"; {_NEEDS_CUPY}"
        return Snapshot({}, note=note)
    return pool.stats()
