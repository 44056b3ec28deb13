"""Pool: the Python face of the C core, over any backend (host memory in tests, CuPy on a GPU)."""
from __future__ import annotations

import os
import re
import weakref

from . import _core
from .debug import DEFAULT_TAIL, DebugHook
from .errors import make_error
from .sizeclass import check_classes_per_doubling, check_nbytes
from .stats import Snapshot, frame
from .timeline import events_frame

ENV_LIMIT = "XPOOL_MEMORY_LIMIT"              # "8GiB", "123456789", "50%" (of the device)
ENV_DEBUG = "XPOOL_DEBUG"                     # "raise", "warn", "1" (= raise), "0"
ENV_CLASSES = "XPOOL_CLASSES_PER_DOUBLING"    # "1" (default), "4", ...
ENV_TIMELINE = "XPOOL_TIMELINE"               # events to keep, e.g. "100000"

# every C allocator alive, for the fork handler; the cores, not the Pool wrappers: CuPy may hold a pool's
# malloc (and so its core) after the wrapper is gone
_live_cores: "weakref.WeakSet[_core.Allocator]" = weakref.WeakSet()
BACKEND_METHODS = ("malloc", "free", "fill", "read", "current_device", "current_stream", "device_count",
                   "total_memory")
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4,
          "tb": 1000**4, "tib": 1024**4}


def parse_limit(text: str):
    """'8GiB' -> ('bytes', 8589934592); '50%' -> ('fraction', 0.5)."""
    s = text.strip().lower()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*%", s)
    if m:
        frac = float(m.group(1)) / 100
        if not 0 <= frac <= 1:
            raise ValueError(f"{ENV_LIMIT}={text!r}: a fraction must be between 0% and 100%")
        return "fraction", frac
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]*)", s)
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"{ENV_LIMIT}={text!r}: expected bytes like '8GiB', '500MB', "
                         f"'1073741824' or a fraction like '50%'")
    return "bytes", int(float(m.group(1)) * _UNITS[m.group(2)])


def _debug_mode(debug):
    if debug is None:
        debug = os.environ.get(ENV_DEBUG, "0")
    if debug in (False, 0, "0", "", "off", "false"):
        return None
    if debug in (True, 1, "1", "on", "true"):
        return "raise"
    return debug   # "warn" / "raise", checked by DebugHook


class Pool:
    """A per-device caching allocator over `backend`.

    Args:
        backend: raw allocate/free functions (see xpool.backends).
        classes_per_doubling: size classes between p and 2p above 1 MiB (1: powers of two).
        limit: bytes each device may reserve (int), or None for $XPOOL_MEMORY_LIMIT / none.
        debug: "raise", "warn", True (= "raise") or False; None reads $XPOOL_DEBUG.
        timeline: events to keep in the allocation timeline (0: off); None reads $XPOOL_TIMELINE.
    """

    def __init__(self, backend, classes_per_doubling: int | None = None, *, limit=None,
                 debug=None, timeline: int | None = None, _stream_fn: int = 0):
        if classes_per_doubling is None:
            classes_per_doubling = int(os.environ.get(ENV_CLASSES, "1"))
        self.classes_per_doubling = check_classes_per_doubling(classes_per_doubling)
        missing = [m for m in BACKEND_METHODS if not callable(getattr(backend, m, None))]
        if missing:
            raise TypeError(f"backend must provide {', '.join(BACKEND_METHODS)}; "
                            f"{type(backend).__name__} lacks {', '.join(missing)}")
        self.backend = backend
        self._n_devices = min(backend.device_count(), _core.MAX_DEVICES)   # asked once, not per call
        self._core = _core.Allocator(backend, make_error, self.classes_per_doubling, 0,
                                     _stream_fn)
        self._hook = None
        self.set_debug(_debug_mode(debug))
        if limit is None and os.environ.get(ENV_LIMIT):
            kind, value = parse_limit(os.environ[ENV_LIMIT])
            if kind == "fraction":
                self.set_limit(fraction=value)
            else:
                self.set_limit(size=value)
        elif limit is not None:
            self.set_limit(size=limit)
        if timeline is None:
            timeline = int(os.environ.get(ENV_TIMELINE, "0"))
        if timeline:
            self.enable_timeline(timeline)
        _live_cores.add(self._core)

    # --- allocation (the CuPy adapter has its own C-level path)
    def allocate(self, nbytes: int, device: int | None = None, stream: int | None = None):
        """A block of at least nbytes; it goes back to its pool when the last reference dies."""
        n = check_nbytes(nbytes)
        return self._core.allocate(n, self._device(device), self._stream(stream))

    def _device(self, device):
        if device is None:
            return self.backend.current_device()
        n = self._n_devices
        if isinstance(device, bool) or not isinstance(device, int) or not 0 <= device < n:
            raise ValueError(f"device must be an int in [0, {n}) on this machine, got {device!r}")
        return device

    def _stream(self, stream):
        return self.backend.current_stream() if stream is None else int(stream)

    # --- statistics
    def devices(self) -> list[int]:
        """Devices this pool has served."""
        return self._core.devices()

    def stats(self, device: int | None = None):
        """Exact counters as a DataFrame, one row per device (every device served when None)."""
        devices = self.devices() if device is None else [self._device(device)]
        return frame([self._core.stats(d) for d in devices])

    def snapshot(self) -> Snapshot:
        """Cheap copy of every device's counters; subtract two to get per-step activity."""
        return Snapshot({d: self._core.stats(d) for d in self._core.devices()})

    def reset_peak_stats(self, device: int | None = None) -> None:
        for d in (self.devices() if device is None else [self._device(device)]):
            self._core.reset_peaks(d)

    # --- giving memory back
    def empty_cache(self, device: int | None = None) -> int:
        """Return every cached block to the device(s); bytes released."""
        devices = self.devices() if device is None else [self._device(device)]
        return sum(self._core.release(d) for d in devices)

    def trim(self, keep_bytes: int, device: int | None = None) -> int:
        """Release cached blocks until at most keep_bytes stay cached per device; bytes released."""
        keep = check_nbytes(keep_bytes, "keep_bytes")
        devices = self.devices() if device is None else [self._device(device)]
        return sum(self._core.release(d, keep=keep) for d in devices)

    # --- limits
    def set_limit(self, size: int | None = None, fraction: float | None = None,
                  device: int | None = None) -> None:
        """Cap the bytes a device may reserve (in use + cached). No argument or 0 removes it."""
        if size is not None and fraction is not None:
            raise ValueError("give size or fraction, not both")
        d = self._device(device)
        if fraction is not None:
            if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
                raise ValueError(f"fraction must be in [0, 1], got {fraction!r}")
            size = int(fraction * self.backend.total_memory(d))
        self._core.set_limit(d, check_nbytes(size or 0, "size"))

    def get_limit(self, device: int | None = None) -> int:
        return self._core.stats(self._device(device))["limit"]

    # --- diagnostics
    def set_debug(self, mode) -> None:
        """Debug mode: "raise", "warn", or None/False to turn it off (see xpool.debug)."""
        mode = _debug_mode(mode) if mode is not None else None
        if mode is None:
            self._hook = None
            self._core.set_debug(None, 0)
        else:
            self._hook = DebugHook(self.backend, mode)
            self._core.set_debug(self._hook, DEFAULT_TAIL)

    @property
    def debug(self):
        return self._hook.mode if self._hook else None

    def check(self) -> None:
        """Debug mode: raise CorruptionError for damage found so far or in live blocks' canaries."""
        if not self._hook:
            return
        from .errors import CorruptionError
        problems = [str(e) for e in self._hook.pending]
        self._hook.pending = []
        for d in self.devices():
            problems += self._hook.check_live(self._core.live_blocks(d))
        if problems:
            raise CorruptionError("\n".join(problems))

    def enable_timeline(self, capacity: int = 1_000_000) -> None:
        """Record every malloc/free into a ring of `capacity` events (0 turns it off)."""
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"capacity must be an int >= 0, got {capacity!r}")
        self._core.timeline_enable(capacity)

    def timeline(self):
        """The recorded events as a DataFrame (attrs['dropped']: events lost to the ring)."""
        return events_frame(*self._core.timeline_events())

    def live_blocks(self, device: int | None = None) -> list[dict]:
        return self._core.live_blocks(self._device(device))

    def __repr__(self):
        return (f"<{type(self).__name__} classes_per_doubling={self.classes_per_doubling} "
                f"devices={self.devices()} debug={self.debug}>")


def _after_fork_in_child() -> None:
    # The parent's device memory is not the child's: forget it, never free or reuse it.
    for core in list(_live_cores):
        core.forget_after_fork()
        hook = core.debug_hook
        if hook is not None:
            hook.where.clear()
            hook.pending.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
