"""One pool for CuPy and PyTorch: PyTorch's CUDA tensors through xpool.

    import torch, xpool
    pool = xpool.enable_torch()        # first thing, before PyTorch's first CUDA allocation
    ...                                # cupy and torch now draw from one pool
    pool.stats().bytes_in_use_torch

PyTorch's `CUDAPluggableAllocator` loads two C functions by name from xpool's core (`xpool._core`):
`xpool_torch_malloc(size, device, stream)` and `xpool_torch_free(ptr, size, device, stream)`. They serve from the
Allocator CuPy uses, so a block one framework frees is reused by the other (same device and stream); Note [PyTorch's
entry points] in xpool/_torch.c.  Importing xpool does not import torch; this module imports it only in `enable()`.
The pool `enable()` makes (none given, none installed for CuPy) is scheme expandable unless a scheme is set, as
PyTorch's own expandable segments (docs/decisions/0003).
"""
from __future__ import annotations

import os
import threading
import warnings

from . import _core
from .settings import Settings

ALLOC_FN = "xpool_torch_malloc"
FREE_FN = "xpool_torch_free"

_lock = threading.Lock()     # guards _enabled; never held across `import torch`
_enabled = None              # (MemoryPool, torch's CUDAPluggableAllocator) once enable() succeeded
_backend = None              # the backend of the pool enable() makes (tests); None: CuPy's (CupyBackend)
# in a fork()ed child: a parent thread may have held the lock (inside enable()), and is not there to release it
os.register_at_fork(after_in_child=lambda: globals().update(_lock=threading.Lock()))

TOO_LATE = ("PyTorch's CUDA allocator is already initialised in this process (something ran on CUDA "
            "through PyTorch before xpool.enable_torch()), and PyTorch cannot change allocators after "
            "that. Call xpool.enable_torch() right after `import torch`, before any CUDA tensor, "
            "torch.cuda call or model.cuda(), or start a fresh process.")


def library_path() -> str:
    """The shared library that exports xpool_torch_malloc / xpool_torch_free: the C core, where it was loaded from
    (the extension's own file, which PyTorch dlopen()s again; not a path into the repository)."""
    return _core.__spec__.origin


def enabled():
    """The pool PyTorch allocates from, or None."""
    return _enabled[0] if _enabled else None


def enable(pool=None, **settings):
    """Serve PyTorch's CUDA allocations from xpool's pool (CuPy's, installed here if it is not yet): ``pool``, else the
    installed one, else a new one from ``settings`` (``MemoryPool``'s), scheme ``"expandable"`` unless one is set
    (``"segments"``, with a warning, where the driver or device has no virtual memory management).  Must run before
    PyTorch's first CUDA allocation; it holds for the life of the process; calling it again returns the same pool.

    Returns:
        MemoryPool: the pool PyTorch and CuPy now allocate from.

    Raises:
        RuntimeError: PyTorch already allocated on CUDA, or is a CPU-only build, or xpool runs another pool for CuPy
            or PyTorch, or there is no GPU (``install()``'s words).
        ImportError: PyTorch or CuPy (``install()``'s words) is not installed.
    """
    global _enabled
    made = None
    if _enabled is None:                 # outside the lock: an import, and CUDA's first call, may take seconds
        from .cupy_adapter import _cupy, installed
        _cupy(), _import_torch()         # without CuPy, install()'s words
        made = _new_pool(settings) if pool is None and installed() is None else None
    with _lock:
        if _enabled is not None:
            if (pool is not None and pool is not _enabled[0]) or settings:
                raise RuntimeError("xpool.enable_torch() already ran with another pool; PyTorch keeps "
                                   "its allocator for the life of the process")
            return _enabled[0]
        torch = _import_torch()          # imported: the checks again, cheap
        from .cupy_adapter import install, installed
        current = installed()
        if current is not None and (pool is not None and pool is not current or settings):
            raise RuntimeError("xpool is already installed for CuPy with another pool; call "
                               "xpool.enable_torch() without arguments to share that one, or "
                               "xpool.uninstall() first")
        new = current is None
        if not new:
            pool = current
        else:                            # a pool and settings both given: install() refuses them
            pool = install(made or _new_pool(settings)) if pool is None else install(pool, **settings)
        try:
            pool._core.bind_torch()
            allocator = torch.cuda.memory.CUDAPluggableAllocator(library_path(), ALLOC_FN, FREE_FN)
            try:
                torch.cuda.memory.change_current_allocator(allocator)
            except RuntimeError as e:   # "Can't swap an already initialized allocator"
                if "initialized" in str(e):
                    raise RuntimeError(TOO_LATE) from e
                raise
        except BaseException:
            if new:
                from .cupy_adapter import uninstall
                uninstall()
            raise
        _enabled = (pool, allocator)     # keeps torch's allocator object alive with the pool
        return pool


def _new_pool(settings: dict):
    """The pool enable() makes: ``settings`` over the torch front end's defaults (scheme expandable), or over
    xpool's where a given ``settings=`` Settings already holds them, or where the driver has no virtual memory
    management (then with a warning saying so; a device without it fails its first map, naming the device)."""
    from .backends import CupyBackend
    from .cupy_adapter import MemoryPool
    from ._core import VmmError
    backend = _backend() if _backend is not None else None
    if backend is None:                  # no GPU: install()'s words, before the virtual memory is probed
        from .cupy_adapter import gpu_count
        gpu_count(CupyBackend())
    if "settings" in settings:
        return MemoryPool(backend=backend, **settings)
    resolved = Settings(frontend="torch", **settings)
    if resolved.source("scheme") == "default (torch)":
        try:
            (backend or CupyBackend()).vmm()
        except VmmError as e:
            resolved = Settings(**settings)
            warnings.warn(f"xpool.enable_torch(): scheme 'expandable' (its default) needs CUDA's virtual memory "
                          f"management, which this driver or device lacks ({e}); using scheme "
                          f"{resolved.scheme!r}", RuntimeWarning, stacklevel=3)
    return MemoryPool(resolved, backend=backend)


def _import_torch():
    """torch, checked to be a CUDA build whose CUDA allocator is still unused."""
    try:
        import torch
    except ImportError as e:
        raise ImportError("xpool.enable_torch() needs PyTorch (a CUDA build): pip install torch") from e
    memory = getattr(getattr(torch, "cuda", None), "memory", None)
    if memory is None or not hasattr(memory, "CUDAPluggableAllocator"):
        raise RuntimeError(f"PyTorch {getattr(torch, '__version__', '?')} has no "
                           "torch.cuda.memory.CUDAPluggableAllocator (PyTorch >= 2.0 needed)")
    if not hasattr(torch._C, "_cuda_customAllocator"):
        raise RuntimeError(f"PyTorch {torch.__version__} is built without CUDA: "
                           "xpool.enable_torch() needs a CUDA build of PyTorch")
    if torch.cuda.is_initialized():
        raise RuntimeError(TOO_LATE)
    return torch
