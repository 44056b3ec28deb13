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

    A subclass of CuPy's ``OutOfMemoryError`` when CuPy is installed (else of ``MemoryError``), so
    code written for CuPy's pool catches it.  Its ``__cause__`` is the backend's last ``MemoryError``.

    Attributes:
        device (int): the device.
        requested (int): bytes asked for.
        size (int): the size class that was refused.
        bytes_in_use (int), bytes_cached (int): the device's counters when it was raised.
        limit (int): the device's limit (0: none).
        reason (str): ``"device"`` (the backend refused), ``"limit"`` (xpool's limit),
            ``"too_large"`` (larger than the whole device: ``RequestTooLargeError``), or ``"device_capturing"``
            / ``"limit_capturing"`` (refused while a stream of the device was, or may have been, captured into
            a CUDA graph: the cache was not freed, since cudaFree would end the capture).
    """

    def __init__(self, device, requested, size, bytes_in_use, bytes_cached, limit, reason="device"):
        self.device, self.requested, self.size = device, requested, size
        self.bytes_in_use, self.bytes_cached, self.limit, self.reason = (
            bytes_in_use, bytes_cached, limit, reason)
        # CuPy's own OutOfMemoryError keeps these three for pickling
        self._size, self._total, self._limit = requested, bytes_in_use, limit
        if reason == "too_large":
            msg = (f"xpool: nbytes={requested:,} (class {size:,} B) is larger than device {device} "
                   f"({human(bytes_in_use + bytes_cached)} in use or cached); no freeing can make it fit")
        else:
            capturing = reason.endswith("_capturing")
            what = "the xpool limit" if reason.startswith("limit") else f"device {device}"
            cached = ("kept: a stream of the device is capturing a CUDA graph (or may be: another thread's "
                      "per-thread stream), which a cudaFree would end; capture with a private pool warmed by one "
                      "run first" if capturing else "freed and retried")
            msg = (f"xpool: out of memory on device {device}: {what} refused {human(size)} "
                   f"(request {requested:,} B, class {size:,} B); in use {human(bytes_in_use)}, "
                   f"cached {human(bytes_cached)} ({cached}), "
                   f"limit {human(limit) if limit else 'none'}")
        MemoryError.__init__(self, msg)

    def __reduce__(self):
        return (type(self), (self.device, self.requested, self.size, self.bytes_in_use,
                             self.bytes_cached, self.limit, self.reason))

    def __str__(self):
        return self.args[0]


class RequestTooLargeError(OutOfMemoryError, ValueError):
    """A request larger than the whole device: bad input (ValueError) that CuPy code sees as OOM too."""


def make_error(device, requested, size, bytes_in_use, bytes_cached, limit, reason):
    """The C core's error factory."""
    cls = RequestTooLargeError if reason == "too_large" else OutOfMemoryError
    return cls(device, requested, size, bytes_in_use, bytes_cached, limit, reason)


class IpcUnsupportedError(RuntimeError):
    """A block that CUDA IPC cannot share: the expandable scheme's pages are made by ``cuMemCreate`` with no
    shareable handle, and ``cudaIpcGetMemHandle`` refuses memory of CUDA's virtual memory management.

    Attributes:
        device (int), ptr (int): the block.
        base (int), nbytes (int): the reserved address range holding it.
    """

    def __init__(self, device, ptr, base, nbytes):
        self.device, self.ptr, self.base, self.nbytes = device, ptr, base, nbytes
        super().__init__(
            f"xpool: block 0x{ptr:x} on device {device} lies in the expandable scheme's virtual memory (address range "
            f"0x{base:x}, {human(nbytes)}), which CUDA IPC cannot share: cudaIpcGetMemHandle refuses memory mapped "
            f"by cuMemMap. Allocate what other processes open from a pool of scheme 'segments' (or 'seed').")

    def __reduce__(self):
        return (type(self), (self.device, self.ptr, self.base, self.nbytes))


class CorruptionError(RuntimeError):
    """Debug mode found a block written after it was freed, or past its requested length."""


class CorruptionWarning(RuntimeWarning):
    """The warning form of CorruptionError (debug='warn')."""
