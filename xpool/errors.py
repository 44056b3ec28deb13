"""xpool's exceptions and warnings."""
from __future__ import annotations

import importlib.util


def _cupy_oom_base():
    """CuPy's OutOfMemoryError when CuPy is installed, so `except` clauses written for CuPy catch ours."""
    if importlib.util.find_spec("cupy") is None:
        return MemoryError
    try:
        from cupy.cuda.memory import OutOfMemoryError as CupyOOM
    except Exception:  # a broken CuPy install must not break the allocator core
        return MemoryError
    return CupyOOM



def human(nbytes: int) -> str:
    """1536 -> '1.50 KiB'."""
    x = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(x) < 1024:
            return f"{int(x)} B" if unit == "B" else f"{x:.2f} {unit}"
        x /= 1024
    return f"{x:.2f} TiB"


class OutOfMemoryError(_cupy_oom_base()):
    """The device (or the limit) refused an allocation even after the cache was freed.

    A subclass of CuPy's ``OutOfMemoryError`` when CuPy is installed (else of ``MemoryError``), so code written for
    CuPy's pool catches it.  Its ``__cause__`` is the backend's last ``MemoryError``.

    Attributes:
        device, requested (int): the device; the bytes asked for.
        capacity (int): the device's total bytes as the pool knows them (0: not asked); scheme (str): the pool's.
        size (int): the bytes refused: the block's, or, under scheme expandable, the whole pages its map needed.
        bytes_in_use, bytes_cached, limit (int): the device's counters when it was raised; its limit (0: none).
        reason (str): ``"device"`` or ``"limit"`` (refused after the cache was freed and the request retried),
            ``"limit_too_small"`` (the limit is smaller than the request needs: nothing was freed), ``"too_large"``
            (larger than the whole device: ``RequestTooLargeError``), ``"device_capturing"`` / ``"limit_capturing"``
            (refused while a stream of the device captures a CUDA graph, or may: nothing was freed, since cudaFree
            would end the capture).
    """

    def __init__(self, device, requested, size, bytes_in_use, bytes_cached, limit, reason="device",
                 capacity=0, scheme=None):
        self.device, self.requested, self.size = device, requested, size
        self.bytes_in_use, self.bytes_cached, self.limit, self.reason = (
            bytes_in_use, bytes_cached, limit, reason)
        self.capacity, self.scheme = capacity, scheme
        # CuPy's own OutOfMemoryError keeps these three for pickling
        self._size, self._total, self._limit = requested, bytes_in_use, limit
        levels = (f"in use {human(bytes_in_use)}, cached {human(bytes_cached)}, "
                  f"limit {human(limit) if limit else 'none'}")
        if reason == "too_large":
            seed = ", its size class under scheme 'seed' (classes_per_doubling)" if scheme == "seed" else ""
            msg = (f"xpool: nbytes={requested:,} needs a block of {human(size)} ({size:,} B{seed}), larger than "
                   f"device {device}, which has {human(capacity)} ({capacity:,} B) in all; no freeing can make it fit")
        elif reason == "limit_too_small":
            msg = (f"xpool: out of memory on device {device}: the xpool limit ({human(limit)}) is smaller than the "
                   f"{human(size)} this request of {requested:,} B needs; nothing was freed, no freeing can make it "
                   f"fit: raise the limit ({levels})")
        else:
            capturing = reason.endswith("_capturing")
            what = "the xpool limit" if reason.startswith("limit") else f"device {device}"
            cached = ("nothing was freed: a stream of the device is capturing a CUDA graph (or may be: another "
                      "thread's per-thread stream), which a cudaFree would end; capture with a private pool warmed by "
                      "one run first" if capturing else "the cache was freed and the request retried")
            msg = (f"xpool: out of memory on device {device}: {what} refused {human(size)} for a request of "
                   f"{requested:,} B; {cached} ({levels})")
        MemoryError.__init__(self, msg)

    def __reduce__(self):
        return (type(self), (self.device, self.requested, self.size, self.bytes_in_use,
                             self.bytes_cached, self.limit, self.reason, self.capacity, self.scheme))

    def __str__(self):
        return self.args[0]


class RequestTooLargeError(OutOfMemoryError, ValueError):
    """A request larger than the whole device: bad input (ValueError) that CuPy code sees as OOM too."""


def make_error(device, requested, size, bytes_in_use, bytes_cached, limit, reason, capacity=0, scheme=None):
    """The C core's error factory (capacity: the device's bytes, 0 unknown; scheme: the pool's)."""
    cls = RequestTooLargeError if reason == "too_large" else OutOfMemoryError
    return cls(device, requested, size, bytes_in_use, bytes_cached, limit, reason, capacity, scheme)


class IpcUnsupportedError(RuntimeError):
    """A block that CUDA IPC cannot share: the expandable scheme's pages are made by ``cuMemCreate`` with no
    shareable handle, and ``cudaIpcGetMemHandle`` refuses memory of CUDA's virtual memory management.

    Attributes:
        device (int), ptr (int): the block. base (int), nbytes (int): the reserved address range holding it.
    """

    def __init__(self, device, ptr, base, nbytes):
        self.device, self.ptr, self.base, self.nbytes = device, ptr, base, nbytes
        super().__init__(
            f"xpool: block 0x{ptr:x} on device {device} lies in the expandable scheme's virtual memory (address range "
            f"0x{base:x}, {human(nbytes)}), which CUDA IPC cannot share: cudaIpcGetMemHandle refuses memory mapped "
            f"by cuMemMap. Allocate what other processes open from a pool of scheme 'segments' (or 'seed'): "
            f"xpool.install(scheme=\"segments\") or MemoryPool(scheme=\"segments\"), or XPOOL_SCHEME=segments in "
            f"the environment.")

    def __reduce__(self):
        return (type(self), (self.device, self.ptr, self.base, self.nbytes))


class CorruptionError(RuntimeError):
    """Debug mode found a block written after it was freed, or past its requested length."""


class CorruptionWarning(RuntimeWarning):
    """The warning form of CorruptionError (debug='warn')."""
