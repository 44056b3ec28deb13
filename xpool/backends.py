"""Raw allocate/free backends: the only code that touches device memory.

`Backend` is the contract (a `typing.Protocol`); `CupyBackend` (cudaMalloc/cudaFree through CuPy, and CUDA's virtual
memory) implements it.  The tests' host backends (twin/: xpool_twin.HostBackend, TwinBackend) run
a pool over host memory.
"""
from __future__ import annotations

import ctypes
import weakref
from typing import Protocol, runtime_checkable


class DeviceOutOfMemory(MemoryError):
    """A backend's raw allocation failed for lack of memory."""


@runtime_checkable
class Backend(Protocol):
    """The raw device memory under a `Pool`: write these eight methods for any device.

    Units: bytes; addresses as ints; devices as ints in ``[0, device_count())``; streams as opaque int handles.
    The pool calls ``malloc`` only on a miss, ``free`` only when it gives cached blocks back (``empty_cache``,
    ``trim``, the out-of-memory ladder, its end), ``fill``/``read`` only in debug mode, never for memory it did not
    get from ``malloc``; from any thread, with the GIL and none of its locks held, so a method may block or release
    the GIL. The limit counts a block's bytes from before ``malloc`` until ``free`` returns.

    - Out of memory: ``malloc`` raises a ``MemoryError`` (``DeviceOutOfMemory`` is one) when the device has no room;
      that alone starts the recovery ladder (free the cache, retry; collect garbage, free, retry; raise
      ``xpool.OutOfMemoryError`` chained to it). Any other exception reaches the caller at once, nothing counted.
    - A ``free`` either frees the whole block or raises and frees nothing: the block then stays cached and counted,
      and is tried again by the next release.
    - CUDA graphs (optional): ``capturing(device, stream) -> bool``. Before giving anything back on a device the pool
      asks the legacy stream (0), the request's and every stream it holds memory for (``stream_alive(device,
      stream)``, when present, vouches a stream may be asked); while any captures nothing goes back there.
    - Fork: in a ``fork()``ed child the pool starts empty and never frees the parent's blocks.
    - Virtual memory (optional): ``vmm() -> PyCapsule`` named ``"xpool.vmm"`` of the C ops table in
      ``xpool/_vmm.h`` (reserve a range, map and unmap pages, give it back) holds the expandable scheme; the pool
      calls it from C, without the GIL. ``CupyBackend`` has CUDA's.
    """

    def malloc(self, device: int, nbytes: int) -> int:
        """``nbytes`` (> 0, a multiple of 512) on ``device``: the address, > 0, aligned to 512 B at least."""

    def free(self, device: int, ptr: int, nbytes: int) -> None:
        """Free what ``malloc(device, nbytes)`` returned as ``ptr``; raise (freeing nothing) on failure."""

    def fill(self, device: int, ptr: int, nbytes: int, byte: int) -> None:
        """Set ``nbytes`` bytes from ``ptr`` to ``byte`` (debug mode), finished on return."""

    def read(self, device: int, ptr: int, nbytes: int) -> bytes:
        """Copy ``nbytes`` bytes from ``ptr`` to the host (debug mode), after pending writes."""

    def current_device(self) -> int:
        """The calling thread's current device."""

    def current_stream(self) -> int:
        """The calling thread's current stream handle."""

    def device_count(self) -> int:
        """How many devices there are."""

    def total_memory(self, device: int) -> int:
        """The device's total bytes (for ``fraction`` limits and too-large requests)."""


class CupyBackend:
    """cudaMalloc/cudaFree through CuPy's runtime bindings (works with CUDA 12 and 13 builds).

    ``malloc`` raises ``DeviceOutOfMemory`` for ``cudaErrorMemoryAllocation``
    and CuPy's ``CUDARuntimeError`` for anything else.
    """

    def __init__(self):
        from cupy.cuda import runtime
        self._rt = runtime
        self._oom_status = getattr(runtime, "errorMemoryAllocation", 2)
        self._streams: dict[int, weakref.ref] = {}   # handle -> the CuPy stream current at a request on it

    def current_device(self) -> int:
        return self._rt.getDevice()

    def current_stream(self) -> int:
        import cupy
        return self._seen(cupy.cuda.get_current_stream()).ptr

    def _seen(self, stream):
        """Remember a CuPy stream weakly, so `stream_alive` can vouch for its handle while the object lives."""
        ptr = stream.ptr
        if ptr in (0, 1, 2):
            return stream
        ref = self._streams.get(ptr)
        if ref is None or ref() is not stream:
            self._streams[ptr] = weakref.ref(stream, lambda r, k=ptr: self._forget(k, r))
        return stream

    def _forget(self, ptr, ref):
        if self._streams.get(ptr) is ref:
            self._streams.pop(ptr, None)

    def stream_alive(self, device: int, stream: int) -> bool:
        """Whether `stream`'s capture state may be asked: the legacy and per-thread streams, this thread's current
        stream, or a stream whose CuPy object, seen at a request, still lives (asking a destroyed one is undefined:
        Note [Capture: every stream of a device] in xpool/_pool.c)."""
        if stream in (0, 1, 2):
            return True
        import cupy
        if cupy.cuda.get_current_stream(device).ptr == stream:
            return True
        ref = self._streams.get(stream)
        s = ref() if ref is not None else None
        return s is not None and s.ptr == stream

    def device_count(self) -> int:
        return self._rt.getDeviceCount()

    def total_memory(self, device: int) -> int:
        """The device's bytes from its properties (cudaGetDeviceProperties): a read that neither makes the device
        current nor creates a context on it, as cudaMemGetInfo would."""
        return int(self._rt.getDeviceProperties(device)["totalGlobalMem"])

    def malloc(self, device: int, nbytes: int) -> int:
        with _on_device(self._rt, device):
            import cupy
            self._seen(cupy.cuda.get_current_stream())   # a miss: the stream it serves gets a segment
            try:
                return self._rt.malloc(nbytes)
            except self._rt.CUDARuntimeError as e:
                if e.status == self._oom_status:
                    raise DeviceOutOfMemory(str(e)) from e
                raise

    def free(self, device: int, ptr: int, nbytes: int) -> None:
        with _on_device(self._rt, device):
            self._rt.free(ptr)

    def capturing(self, device: int, stream: int) -> bool:
        """True while `stream` is being captured into a CUDA graph (cudaStreamIsCapturing), or, for the legacy
        stream (0), while some stream of the device captures in global mode: the pool then gives nothing back on
        the device, since cudaFree would end the capture. Asked before give-backs only."""
        with _on_device(self._rt, device):
            try:
                return self._rt.streamIsCapturing(stream) != self._rt.streamCaptureStatusNone
            except self._rt.CUDARuntimeError as e:
                if e.status == 906:      # cudaErrorStreamCaptureImplicit: the legacy stream beside a capture
                    return True
                raise

    def vmm(self):
        """CUDA's virtual memory management for the expandable scheme: a PyCapsule ``"xpool.vmm"`` of the
        driver's cuMemAddressReserve/cuMemCreate/cuMemMap/cuMemSetAccess/cuMemUnmap, called from C in each
        device's primary context (CuPy's).  Raises ``xpool._core.VmmError`` when the driver or device cannot."""
        from . import _core
        return _core.cuda_vmm()

    def fill(self, device: int, ptr: int, nbytes: int, byte: int) -> None:
        with _on_device(self._rt, device):
            self._rt.memset(ptr, byte, nbytes)   # synchronous w.r.t. the host: debug mode only

    def read(self, device: int, ptr: int, nbytes: int) -> bytes:
        buf = ctypes.create_string_buffer(nbytes)
        with _on_device(self._rt, device):
            self._rt.deviceSynchronize()         # let queued kernels finish writing first
            self._rt.memcpy(ctypes.addressof(buf), ptr, nbytes, self._rt.memcpyDeviceToHost)
        return buf.raw


class _on_device:
    """Make `device` current for a block of code, and restore the previous one."""

    def __init__(self, rt, device: int):
        self.rt, self.device, self.prev = rt, device, None

    def __enter__(self):
        prev = self.rt.getDevice()
        if prev != self.device:
            self.prev = prev
            self.rt.setDevice(self.device)

    def __exit__(self, *exc):
        if self.prev is not None:
            self.rt.setDevice(self.prev)
