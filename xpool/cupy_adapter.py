"""CuPy adapter: xpool.MemoryPool with CuPy's pool method names, install/uninstall/use.

The allocation path never runs Python: `MemoryPool.malloc` is CuPy's own CFunctionAllocator calling xpool's C
functions, so CuPy builds its memory object in Cython and xpool's core does the free-list work in C.
"""
from __future__ import annotations

import contextlib
import ctypes
import os
import threading
import warnings

from .backends import CupyBackend
from .pool import Pool, _stream_handle, settings_signature
from .sizeclass import MAX_REQUEST
from .settings import ENV, Settings, resolve

_state_lock = threading.Lock()    # guards _installed and _previous; held only for the swap (never across CUDA)
_installed = None                 # the MemoryPool install() put in place
_previous = None                  # CuPy's allocator before install()
_scoped = threading.local()       # .pool: the pool of this thread's innermost `with use()` block
_NEEDS_CUPY = ("xpool allocates GPU memory for CuPy, and CuPy is not installed: pip install cupy-cuda12x (CUDA 12) "
               "or cupy-cuda13x (CUDA 13); from an xpool checkout, pip install '.[cuda12]' or '.[cuda13]' does it too")
CUPY_LIMIT_ENV = "CUPY_GPU_MEMORY_LIMIT"
# in a fork()ed child: a parent thread may have held the lock (inside install()), and is not there to release it
os.register_at_fork(after_in_child=lambda: globals().update(_state_lock=threading.Lock()))


def _cupy():
    """cupy, or the ImportError every entry point raises without it (the same words)."""
    try:
        from cupy.cuda import memory  # noqa: F401 - the part xpool uses
    except ImportError as e:
        raise ImportError(f"{_NEEDS_CUPY} ({e})") from e


def gpu_count(backend) -> None:
    """The RuntimeError every entry point raises where CuPy has no GPU or driver (backend.device_count())."""
    try:
        why = "none is visible: CUDA_VISIBLE_DEVICES?" if backend.device_count() <= 0 else None
    except Exception as e:               # CuPy's CUDARuntimeError: no driver, or one too old for this CuPy
        why = e
    if why is None:
        return
    raise RuntimeError(f"xpool needs a CUDA GPU and its driver, and CuPy cannot use one here ({why}); without a "
                       "GPU, xpool.Pool runs over a backend of your own (xpool.backends)")


def _cupy_limit(settings: Settings) -> Settings:
    """``settings`` with CuPy's ``CUPY_GPU_MEMORY_LIMIT`` as CuPy's pool reads it (bytes, ``"1073741824"``, or a share
    of each device, ``"50%"``) where no xpool setting gives a limit; a ValueError, naming xpool's, if CuPy can't."""
    text = os.environ.get(CUPY_LIMIT_ENV, "")
    if not text.strip() or settings.source("limit") != "default":
        return settings
    try:                             # as cupy.cuda.memory._parse_limit_string, and set_limit's range checks
        limit = float(text[:-1]) / 100 if text.endswith("%") else int(text)
        if not 0 <= limit <= (1 if isinstance(limit, float) else MAX_REQUEST):
            raise ValueError
        out = resolve(settings, {"limit": limit or 0})
    except ValueError:
        raise ValueError(f"{CUPY_LIMIT_ENV}={text!r}: CuPy reads whole bytes ('1073741824') or a share up to 100% "
                         f"('50%'); or give xpool's limit (limit= or {ENV['limit']}: '8GiB', '50%')") from None
    object.__setattr__(out, "_sources", {**out._sources, "limit": CUPY_LIMIT_ENV})   # a new Settings, unshared
    return out


def _capsule_fn(module, name: str, signature: bytes) -> int:
    """Address of the C function `name` that a Cython module exports in `__pyx_capi__`.

    Raises:
        RuntimeError: the module does not export it with that signature (another CuPy's ABI).
    """
    capsule = module.__pyx_capi__.get(name)
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    if capsule is None or get_name(capsule) != signature:
        found = None if capsule is None else get_name(capsule)
        raise RuntimeError(f"xpool needs {module.__name__}.{name} as {signature.decode()!r} "
                           f"(CuPy 13 and 14 have it); found {found!r}")
    get_ptr = ctypes.pythonapi.PyCapsule_GetPointer
    get_ptr.restype, get_ptr.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    return get_ptr(capsule, signature)


def _current_stream_fn() -> int:
    """Address of CuPy's C function `intptr_t get_stream_ptr(int device)`: the device's current stream.

    The one CuPy's own pool calls, `cupy.cuda.stream.get_current_stream_ptr()`, gives the same stream but
    first looks up a thread-local of its own and asks CUDA for the current device (cudaGetDevice), only to
    call this one; the hook is given the device, so the allocation path skips both (Note [CuPy's hooks] in
    xpool/_alloc.c). `with stream:` and `stream.use()` set what this returns.
    """
    from cupy_backends.cuda import stream as backends_stream
    return _capsule_fn(backends_stream, "get_stream_ptr", b"intptr_t (int)")


class MemoryPool(Pool):
    """Drop-in for cupy.cuda.MemoryPool: ``cupy.cuda.set_allocator(xpool.MemoryPool().malloc)``.

    CuPy's methods (malloc, free_all_blocks, free_all_free, used_bytes, free_bytes, total_bytes, n_free_blocks,
    set_limit, get_limit) act on the current device, as CuPy's do; xpool's own come from Pool.  ``malloc(size)``
    returns a ``cupy.cuda.MemoryPointer`` and raises ``xpool.OutOfMemoryError`` (a CuPy ``OutOfMemoryError``).
    CuPy's ``CUPY_GPU_MEMORY_LIMIT`` is read when the pool is made, as CuPy's pool reads it, where no xpool setting
    gives a limit (``limit=`` and ``XPOOL_MEMORY_LIMIT`` win).

    Args:
        settings (xpool.Settings), **fields: as for ``xpool.Pool``.
        backend: the raw memory (default ``CupyBackend()``; the tests' host backends run CuPy's C path on a CPU).

    Raises:
        ImportError: CuPy is not installed (the message says what to install).
        RuntimeError: no CUDA GPU or driver CuPy can use (with the default backend).
        TypeError, ValueError: a keyword is no setting, or a bad setting (``CUPY_GPU_MEMORY_LIMIT`` among them).
    """

    def __init__(self, settings: Settings | None = None, *, backend=None, **fields):
        if callable(settings) or "allocator" in fields:   # CuPy's MemoryPool(allocator), such as malloc_managed
            raise TypeError("allocator: xpool.MemoryPool takes no CuPy allocator (it allocates device memory through "
                            "its backend); for cupy.cuda.malloc_managed and the like, use cupy.cuda.MemoryPool")
        settings = _cupy_limit(resolve(settings, fields, type(self).__name__))
        _cupy()
        if backend is None:
            backend = CupyBackend()
            gpu_count(backend)
        # blocks are keyed by CuPy's current stream; other backends (host memory) use stream 0
        self._start(backend, settings, _current_stream_fn() if isinstance(backend, CupyBackend) else 0)

    def _start(self, backend, settings, stream_lookup):
        from cupy.cuda.memory import CFunctionAllocator
        super()._start(backend, settings, stream_lookup)
        param, malloc_fn, free_fn = self._core.cfunctions()
        self._cfa = CFunctionAllocator(param, malloc_fn, free_fn, self._core)
        self.malloc = self._cfa.malloc     # malloc(size) -> cupy.cuda.MemoryPointer

    def free_all_blocks(self, stream=None) -> None:
        """Give the current device's cached blocks back (CuPy's name for ``empty_cache``): only those cached for
        ``stream`` (a ``cupy.cuda.Stream`` or a handle) when one is given.

        Raises:
            ValueError: ``stream`` is neither.
            Exception: as ``Pool.empty_cache``.
        """
        d = self._current_device()
        if stream is not None:
            stream = _stream_handle(getattr(stream, "ptr", stream), "stream must be a cupy.cuda.Stream or")
        self._core.release(d, stream)

    def free_all_free(self) -> None:
        """(Deprecated, as in CuPy) ``free_all_blocks()``: warns a DeprecationWarning with CuPy's words."""
        warnings.warn("free_all_free is deprecated. Use free_all_blocks instead.", DeprecationWarning, stacklevel=2)
        self.free_all_blocks()

    def _gauge(self, name: str) -> int:   # the current device's; 0 on one never served (nothing is made there)
        d = self._current_device()
        return self._core.stats(d)[name] if d in self._core.devices() else 0

    def used_bytes(self) -> int:
        """Bytes in use on the current device (0 on a device never served: nothing is made there).

        Returns:
            int: the bytes of the blocks in use (their classes or ranges).
        """
        return self._gauge("bytes_in_use")

    def free_bytes(self) -> int:
        """Bytes cached on the current device.

        Returns:
            int: the bytes of the cached blocks.
        """
        return self._gauge("bytes_cached")

    def total_bytes(self) -> int:
        """Bytes the current device holds for this pool.

        Returns:
            int: in use, cached and being given back.
        """
        return self._gauge("bytes_reserved")

    def n_free_blocks(self) -> int:
        """Blocks cached on the current device.

        Returns:
            int: how many.
        """
        return self._gauge("blocks_cached")


settings_signature(MemoryPool.__init__, keywords=("backend",))


def _pool_from(pool, kwargs) -> MemoryPool:
    """The pool given, or a new one from settings (a Settings in its place, keywords); not both."""
    if pool is None or isinstance(pool, Settings):
        return MemoryPool(pool, **kwargs)
    if kwargs:
        raise ValueError("give a pool or pool settings, not both")
    if not isinstance(pool, MemoryPool):
        raise TypeError(f"pool must be an xpool.MemoryPool, got {type(pool).__name__}")
    return pool


def _swap_global(memory, allocator):
    """CuPy's process-wide allocator set to ``allocator``, also inside this thread's ``with xpool.use():`` (CuPy
    refuses a change, and get_allocator() answers the block's, while the thread-local one is set: it is set aside
    meanwhile).  Returns the one before."""
    scoped = memory._get_thread_local_allocator()
    memory._set_thread_local_allocator(None)
    try:
        previous = memory.get_allocator()
        memory.set_allocator(allocator)
        return previous
    finally:
        memory._set_thread_local_allocator(scoped)


def install(pool: MemoryPool | Settings | None = None, **kwargs) -> MemoryPool:
    """Make xpool CuPy's allocator, process-wide: ``pool``, or (None, or an ``xpool.Settings``) a new ``MemoryPool``
    from the settings and ``kwargs`` (its settings as keywords).  Inside a ``with xpool.use():`` block the block's
    pool stays this thread's until the block ends.

    Returns:
        MemoryPool: the installed pool.

    Raises:
        ImportError: CuPy is not installed (the message says what to install).
        RuntimeError: xpool is already installed, or no CUDA GPU or driver CuPy can use.
        ValueError: both a pool and settings given, or a bad setting.
        TypeError: ``pool`` is not an ``xpool.MemoryPool``.
    """
    global _installed, _previous
    _cupy()
    from cupy.cuda import memory
    already = ("xpool is already installed; call xpool.uninstall() first "
               "(or use `with xpool.use(): ...` for a scoped pool)")
    if _installed is not None:       # before a pool is made for nothing
        raise RuntimeError(already)
    pool = _pool_from(pool, kwargs)  # outside the lock: CUDA's first call may take seconds
    with _state_lock:
        if _installed is not None:
            raise RuntimeError(already)
        _previous, _installed = _swap_global(memory, pool.malloc), pool
        return pool


def uninstall() -> None:
    """Put back the allocator CuPy had before ``install()`` (nothing happens if none is installed; without CuPy
    none can be).  Also inside a ``with xpool.use():`` block, whose pool stays this thread's until the block ends.

    Cached blocks stay until the pool dies or ``empty_cache()`` is called on it.
    """
    global _installed, _previous
    if _installed is None:           # without CuPy, never installed
        return
    from cupy.cuda import memory
    with _state_lock:
        if _installed is None:
            return
        _swap_global(memory, _previous)
        _installed, _previous = None, None


def installed() -> MemoryPool | None:
    """The installed pool, or None."""
    return _installed


def current() -> MemoryPool | None:
    """The pool this thread allocates from.

    Returns:
        MemoryPool or None: this thread's innermost ``with use()`` pool, else the installed one, else None.
    """
    return getattr(_scoped, "pool", None) or _installed


@contextlib.contextmanager
def use(pool: MemoryPool | Settings | None = None, **kwargs):
    """``with xpool.use() as pool:``: ``pool`` (or, None or an ``xpool.Settings``, a new one from the settings and
    ``kwargs``) for this thread inside the block, then the allocator before.

    Yields:
        MemoryPool: the pool in use.

    Raises:
        ImportError, RuntimeError, ValueError, TypeError: as ``install``.
    """
    _cupy()
    from cupy.cuda import memory
    pool = _pool_from(pool, kwargs)
    prev, prev_pool = memory._get_thread_local_allocator(), getattr(_scoped, "pool", None)
    memory._set_thread_local_allocator(pool.malloc)
    _scoped.pool = pool
    try:
        yield pool
    finally:
        memory._set_thread_local_allocator(prev)
        _scoped.pool = prev_pool
