"""xpool.testing: what benchmarks and tests need of a pool's C side, as a documented API.

For measuring and testing xpool (the lab's benchmarks use it), not for training code: a program allocates
through ``xpool.install()``, ``xpool.MemoryPool`` or ``xpool.Pool``.

    param, malloc, free = xpool.testing.cfunctions(pool)     # CuPy's CFunctionAllocator, or a timing loop
    pool = xpool.testing.pool_with_stream_lookup(xpool.HostBackend(), 0)    # every block on stream 0
"""
from __future__ import annotations

import numbers

from .cupy_adapter import _capsule_fn, _current_stream_fn
from .pool import Pool
from .settings import Settings, resolve

__all__ = ["cfunctions", "allocate_function", "pool_with_stream_lookup", "cupy_stream_lookup",
           "capsule_function", "release_scan_visits"]


def cfunctions(pool: Pool) -> tuple[int, int, int]:
    """The pool's C allocation hooks ``(param, malloc, free)`` as ints, valid while the pool lives.

    ``void *malloc(void *param, size_t size, int device)`` and ``void free(void *param, void *ptr, int device)``,
    as ``xpool.MemoryPool`` hands them to CuPy's ``CFunctionAllocator(param, malloc, free, owner)`` (the pool as
    ``owner``). They need the GIL, key blocks by the pool's stream lookup (stream 0 without one), and report a
    failure as ``(void *)-1`` with a Python exception set.
    """
    return pool._core.cfunctions()


def allocate_function(pool: Pool):
    """The C core's ``allocate(nbytes, device, stream) -> Allocation``, every argument given (no current device or
    stream asked of the backend; the core checks them): for replays that time the core alone."""
    return pool._core.allocate


def pool_with_stream_lookup(backend, stream_lookup, settings: Settings | None = None, **fields) -> Pool:
    """An ``xpool.Pool`` whose C hooks (``cfunctions``) key blocks by a stream lookup of your choice.

    Args:
        backend: as for ``xpool.Pool``.
        stream_lookup: 0 (every block on stream 0), a ctypes function of type ``CFUNCTYPE(c_ssize_t, c_int)`` (kept
            alive by the pool), or the address of a C function ``intptr_t lookup(int device)`` returning the device's
            current stream (``cupy_stream_lookup()`` is CuPy's, which ``MemoryPool`` uses); it may set a Python error.
            An address is checked to lie in executable memory of this process (``/proc/self/maps``), so a stray int is
            refused rather than called; that it is such a function is the caller's word.
        settings, **fields: as for ``xpool.Pool``.

    Returns:
        Pool.

    Raises:
        TypeError: ``stream_lookup`` is neither an int nor a ctypes function.
        ValueError: ``stream_lookup`` is an address outside executable memory, or a bad setting.
    """
    address = _lookup_address(stream_lookup)
    pool = Pool.__new__(Pool)
    pool._start(backend, resolve(settings, fields, "pool_with_stream_lookup"), address)
    pool._stream_lookup = stream_lookup   # a ctypes function must outlive every call through it
    return pool


def _lookup_address(stream_lookup) -> int:
    """The address of a stream lookup given as 0, a ctypes function or an int address in executable memory."""
    import ctypes
    if isinstance(stream_lookup, ctypes._CFuncPtr):
        return ctypes.cast(stream_lookup, ctypes.c_void_p).value or 0
    if isinstance(stream_lookup, bool) or not isinstance(stream_lookup, numbers.Integral):
        raise TypeError(f"stream_lookup must be 0, a ctypes function or a function's address (an int), got "
                        f"{type(stream_lookup).__name__} {stream_lookup!r}")
    address = int(stream_lookup)
    if address and not _executable(address):
        raise ValueError(f"stream_lookup={address:#x} is not the address of a function in this process: no "
                         f"executable mapping holds it (pass 0, a ctypes function, or a C function's address)")
    return address


def _executable(address: int) -> bool:
    """Whether an executable mapping of this process holds `address` (True where /proc/self/maps is unreadable:
    then the caller's word is all there is)."""
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                span, perms = line.split(None, 2)[:2]
                lo, hi = span.split("-")
                if int(lo, 16) <= address < int(hi, 16):
                    return "x" in perms
    except OSError:
        return True
    return False


def release_scan_visits(pool: Pool, device: int = 0) -> int:
    """Nodes of the index of whole free segments (scheme segments) that the searches for segments to give back
    (``empty_cache``, ``trim``, the ladder) have visited on one device since the pool was made: their cost as a
    count, which does not grow with the free ranges of partly used segments (Note [Whole free segments])."""
    return pool._core.release_scan_visits(pool._device(device))


def cupy_stream_lookup() -> int:
    """Address of CuPy's ``intptr_t get_stream_ptr(int device)``, the lookup ``xpool.MemoryPool`` gives its hooks.
    ImportError without CuPy; RuntimeError when this CuPy does not export it with that signature."""
    return _current_stream_fn()


def capsule_function(module, name: str, signature: bytes) -> int:
    """Address of the C function `name` a Cython module exports in ``__pyx_capi__``, its signature (as Cython writes
    it, e.g. ``b"intptr_t (void)"``) checked: RuntimeError when the module does not export it so."""
    return _capsule_fn(module, name, signature)
