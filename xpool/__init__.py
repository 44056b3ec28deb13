"""xpool: a measured, per-device caching allocator for CuPy and PyTorch (best fit in segments by default).

    import xpool
    pool = xpool.install()            # cupy now allocates through xpool
    ...
    xpool.stats()                     # exact counters, one row per device
    xpool.enable_torch()              # PyTorch's CUDA tensors from the same pool (before torch's first one)

Settings (``xpool.Settings``: scheme, limit, debug mode, ...) come from arguments, else ``XPOOL_*`` variables.
``xpool.testing`` is for benchmarks and tests.
"""
from __future__ import annotations

try:
    from . import _core  # noqa: F401 - the C hot path; everything below needs it
except ImportError as e:  # a source checkout that was never built
    raise ImportError("xpool's C core (xpool._core) is not built: run `pip install -e .` or "
                      "`python setup.py build_ext --inplace` in the repository (needs a C compiler)") from e

from .backends import Backend, CupyBackend, DeviceOutOfMemory, HostBackend
from .cupy_adapter import MemoryPool, current, install, installed, uninstall, use
from .errors import CorruptionError, CorruptionWarning, IpcUnsupportedError, OutOfMemoryError, RequestTooLargeError
from .pool import Pool
from .settings import SCHEMES, Settings
from .sizeclass import size_class
from .stats import Snapshot
from .torch_allocator import enable as enable_torch   # imports torch only when called

__version__ = "0.1.0"
__all__ = [
    "size_class", "Pool", "MemoryPool", "Backend", "HostBackend", "CupyBackend", "install", "uninstall",
    "installed", "current", "use", "empty_cache", "stats", "snapshot", "OutOfMemoryError",
    "CorruptionError", "CorruptionWarning", "DeviceOutOfMemory", "RequestTooLargeError", "Snapshot",
    "enable_torch", "Settings", "SCHEMES", "IpcUnsupportedError",
]


def _pool() -> Pool | None:
    return current()


def empty_cache() -> int:
    """Give the current pool's cached blocks back to the devices.

    The current pool is this thread's ``with xpool.use()`` pool, else the installed one.

    Returns:
        int: bytes given back (0 when xpool is not in use).

    Raises:
        Exception: a failed ``backend.free`` (see ``Pool.empty_cache``).
    """
    pool = _pool()
    return pool.empty_cache() if pool else 0


def stats():
    """The current pool's exact counters.

    Returns:
        pandas.DataFrame: one row per device (no rows when xpool is not in use).

    Raises:
        ImportError: pandas is not installed (``snapshot()`` needs no pandas).
    """
    from .stats import frame
    pool = _pool()
    return pool.stats() if pool else frame([])


def snapshot() -> Snapshot:
    """Cheap counters of the current pool.

    Returns:
        Snapshot: ``(after - before).device_mallocs`` and the like (empty when xpool is not in use).
    """
    pool = _pool()
    return pool.snapshot() if pool else Snapshot({})
