"""Raw allocate/free backends: the only code that touches device memory.

The C core calls a backend on a miss (`malloc`), when it trims or recovers
from OOM (`free`), and the debug hook uses `fill`/`read`.  A backend raises a
MemoryError subclass when the device is out of memory; the core then frees its
cache and retries.
"""
from __future__ import annotations

import ctypes
import threading


class DeviceOutOfMemory(MemoryError):
    """A backend's raw allocation failed for lack of memory."""


class HostBackend:
    """Real host memory standing in for devices, so the whole core runs on a CPU.

    `capacity` bytes per "device" (None: unbounded) models a device that
    refuses allocations past its size.  The current device and stream are
    per thread, like CUDA's.
    """

    def __init__(self, capacity: int | None = None, n_devices: int = 8):
        self.capacity = capacity
        self.n_devices = n_devices
        self._libc = ctypes.CDLL(None)
        self._libc.posix_memalign.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t,
                                              ctypes.c_size_t]
        self._libc.free.argtypes = [ctypes.c_void_p]
        self._lock = threading.Lock()        # guards _live and _used
        self._live: dict[int, tuple[int, int]] = {}   # ptr -> (device, nbytes)
        self._used = [0] * n_devices
        self._local = threading.local()
        self.mallocs = 0                     # raw calls, to check the core's counters against
        self.frees = 0

    # the current device and stream, per thread
    def current_device(self) -> int:
        return getattr(self._local, "device", 0)

    def set_device(self, device: int) -> None:
        self._check_device(device)
        self._local.device = device

    def current_stream(self) -> int:
        return getattr(self._local, "stream", 0)

    def set_stream(self, stream: int) -> None:
        self._local.stream = stream

    def device_count(self) -> int:
        return self.n_devices

    def total_memory(self, device: int) -> int:
        self._check_device(device)
        return self.capacity if self.capacity is not None else 1 << 40

    def _check_device(self, device: int) -> None:
        if not 0 <= device < self.n_devices:
            raise ValueError(f"device must be in [0, {self.n_devices}), got {device}")

    def malloc(self, device: int, nbytes: int) -> int:
        self._check_device(device)
        with self._lock:
            if self.capacity is not None and self._used[device] + nbytes > self.capacity:
                raise DeviceOutOfMemory(
                    f"host device {device}: {nbytes} B requested, "
                    f"{self.capacity - self._used[device]} B free")
            self._used[device] += nbytes
        out = ctypes.c_void_p()
        if self._libc.posix_memalign(ctypes.byref(out), 512, max(nbytes, 1)) != 0:
            with self._lock:
                self._used[device] -= nbytes
            raise DeviceOutOfMemory(f"posix_memalign refused {nbytes} B")
        with self._lock:
            self._live[out.value] = (device, nbytes)
            self.mallocs += 1
        return out.value

    def free(self, device: int, ptr: int, nbytes: int) -> None:
        with self._lock:
            owner = self._live.pop(ptr, None)
            if owner != (device, nbytes):
                if owner is not None:
                    self._live[ptr] = owner
                raise ValueError(f"host backend: free of unknown block 0x{ptr:x} "
                                 f"({nbytes} B on device {device}); it holds {owner}")
            self._used[device] -= nbytes
            self.frees += 1
        self._libc.free(ptr)

    def fill(self, device: int, ptr: int, nbytes: int, byte: int) -> None:
        ctypes.memset(ptr, byte, nbytes)

    def read(self, device: int, ptr: int, nbytes: int) -> bytes:
        return ctypes.string_at(ptr, nbytes)

    def used(self, device: int) -> int:
        with self._lock:
            return self._used[device]


class CupyBackend:
    """cudaMalloc/cudaFree through CuPy's runtime bindings (works with CUDA 12 and 13 builds)."""

    def __init__(self):
        from cupy.cuda import runtime
        self._rt = runtime
        self._oom_status = getattr(runtime, "errorMemoryAllocation", 2)

    def current_device(self) -> int:
        return self._rt.getDevice()

    def current_stream(self) -> int:
        import cupy
        return cupy.cuda.get_current_stream().ptr

    def device_count(self) -> int:
        return self._rt.getDeviceCount()

    def total_memory(self, device: int) -> int:
        with _on_device(self._rt, device):
            return self._rt.memGetInfo()[1]

    def malloc(self, device: int, nbytes: int) -> int:
        with _on_device(self._rt, device):
            try:
                return self._rt.malloc(nbytes)
            except self._rt.CUDARuntimeError as e:
                if e.status == self._oom_status:
                    raise DeviceOutOfMemory(str(e)) from e
                raise

    def free(self, device: int, ptr: int, nbytes: int) -> None:
        with _on_device(self._rt, device):
            self._rt.free(ptr)

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
