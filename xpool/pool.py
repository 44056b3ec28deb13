"""Pool: the Python face of the C core, over any backend (host memory in tests, CuPy on a GPU)."""
from __future__ import annotations

import numbers
import operator
import os
import re
import weakref

from . import _core
from .debug import DEFAULT_TAIL, DebugHook
from .errors import make_error
from .sizeclass import MAX_REQUEST, check_classes_per_doubling, check_nbytes
from .stats import Snapshot, frame
from .timeline import events_frame

ENV_LIMIT = "XPOOL_MEMORY_LIMIT"              # "8GiB", "123456789", "50%" (of the device)
ENV_DEBUG = "XPOOL_DEBUG"                     # "raise", "warn", "1" (= raise), "0"
ENV_CLASSES = "XPOOL_CLASSES_PER_DOUBLING"    # "1" (default of scheme seed), "4", ...; alone, selects seed
ENV_SCHEME = "XPOOL_SCHEME"                   # "xpool" (default) or "seed"
SCHEMES = ("xpool", "seed")   # segments (best fit, split, merge), or the design's size classes
ENV_TIMELINE = "XPOOL_TIMELINE"               # events to keep, e.g. "100000"

# every C allocator alive, for the fork handler; the cores, not the Pool wrappers: CuPy may hold a pool's
# malloc (and so its core) after the wrapper is gone
_live_cores: "weakref.WeakSet[_core.Allocator]" = weakref.WeakSet()
BACKEND_METHODS = ("malloc", "free", "fill", "read", "current_device", "current_stream",   # of Backend
                   "device_count", "total_memory")
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4,
          "tb": 1000**4, "tib": 1024**4}


def parse_limit(text: str, name: str = ENV_LIMIT):
    """Parse a memory limit written as bytes or as a share of the device.

    Args:
        text: ``"8GiB"``, ``"500MB"``, ``"1073741824"`` or ``"50%"``.
        name: what to call the value in an error (the argument or variable it came from).

    Returns:
        ``("bytes", n)`` or ``("fraction", f)`` with ``0 <= f <= 1``.

    Raises:
        ValueError: the text is neither, naming ``name``.
    """
    s = text.strip().lower()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*%", s)
    if m:
        frac = float(m.group(1)) / 100
        if not 0 <= frac <= 1:
            raise ValueError(f"{name}={text!r}: a fraction must be between 0% and 100%")
        return "fraction", frac
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]*)", s)
    if not m or m.group(2) not in _UNITS:
        raise ValueError(f"{name}={text!r}: expected bytes like '8GiB', '500MB', "
                         f"'1073741824' or a fraction like '50%'")
    n = int(float(m.group(1)) * _UNITS[m.group(2)])
    if n > MAX_REQUEST:
        raise ValueError(f"{name}={text!r} is larger than any device (max {MAX_REQUEST} B)")
    return "bytes", n


def _limit_setting(limit):
    """Pool's `limit=` argument, else $XPOOL_MEMORY_LIMIT, as ("bytes", n) / ("fraction", f) / None."""
    if limit is None:
        text = os.environ.get(ENV_LIMIT)
        return parse_limit(text) if text else None
    if isinstance(limit, str):
        return parse_limit(limit, "limit")
    return "bytes", check_nbytes(limit, "limit")


def _int_from_env(name: str, default: int) -> int:
    text = os.environ.get(name)
    if text is None or not text.strip():
        return default
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name}={text!r}: expected a whole number") from None


def _scheme(scheme, classes_per_doubling):
    """(scheme, k), k None under scheme xpool.  classes_per_doubling without a scheme selects seed."""
    from_env = scheme is None
    if from_env:
        scheme = os.environ.get(ENV_SCHEME, "").strip() or None
    if classes_per_doubling is None and scheme != "xpool" and os.environ.get(ENV_CLASSES, "").strip():
        classes_per_doubling = _int_from_env(ENV_CLASSES, 1)
        try:
            check_classes_per_doubling(classes_per_doubling)
        except ValueError as e:
            raise ValueError(f"{ENV_CLASSES}: {e}") from None
    if scheme is None:
        scheme = "xpool" if classes_per_doubling is None else "seed"
    if scheme not in SCHEMES:
        raise ValueError(f"{ENV_SCHEME if from_env else 'scheme'} must be one of {SCHEMES}, got {scheme!r}")
    if scheme == "seed":
        return scheme, check_classes_per_doubling(1 if classes_per_doubling is None else classes_per_doubling)
    if classes_per_doubling is not None:
        raise ValueError(f"classes_per_doubling={classes_per_doubling!r} applies to scheme='seed' only; "
                         f"scheme='xpool' cuts blocks from segments to the request")
    return scheme, None


def _debug_mode(debug):
    if debug is None:
        debug = os.environ.get(ENV_DEBUG, "0")
    if debug in (False, 0, "0", "", "off", "false"):
        return None
    if debug in (True, 1, "1", "on", "true"):
        return "raise"
    return debug   # "warn" / "raise", checked by DebugHook


class Pool:
    """A per-device caching allocator over a raw backend.

    Freed blocks stay in per-device, per-stream, size-classed free lists and are
    handed out again; the backend is called only on a miss, when the cache is
    given back, and on out-of-memory recovery.  Every method may be called from
    any thread.

    Args:
        backend: the raw allocate/free functions, an ``xpool.backends.Backend``
            (``HostBackend()`` in tests, ``CupyBackend()`` on a GPU).
        classes_per_doubling (int): scheme seed's size classes between p and
            2p above 1 MiB (1: powers of two).  Given without a scheme (here
            or in ``$XPOOL_CLASSES_PER_DOUBLING``), it selects scheme seed.
        scheme (str): ``"xpool"`` (the default; ``$XPOOL_SCHEME``): every
            block is the request rounded up to 512 B, cut by best fit from a
            segment of its device and stream and merged with its free
            neighbours when freed; a miss first gives that stream's wholly
            free segments back.  ``"seed"``: the design's size classes, one
            device allocation per block.
        limit (int or str): bytes each device may hold for this pool (in use,
            cached, and in flight), for every device, including those first
            used later: an int, ``"8GiB"``, or ``"50%"`` of each device's
            memory.  None reads ``$XPOOL_MEMORY_LIMIT``; 0 or unset: no limit.
        debug: ``"raise"``, ``"warn"``, True (= ``"raise"``) or False.  None
            reads ``$XPOOL_DEBUG``.  See ``xpool.debug``.
        timeline (int): events to keep in the allocation timeline (0: off).
            None reads ``$XPOOL_TIMELINE``.

    Raises:
        TypeError: ``backend`` lacks one of the methods of ``Backend``.
        ValueError: a bad setting, naming the argument or variable.
    """

    def __init__(self, backend, classes_per_doubling: int | None = None, *, scheme: str | None = None,
                 limit=None, debug=None, timeline: int | None = None, _stream_fn: int = 0,
                 _segments: dict | None = None):
        self.scheme, self.classes_per_doubling = _scheme(scheme, classes_per_doubling)
        missing = [m for m in BACKEND_METHODS if not callable(getattr(backend, m, None))]
        if missing:
            raise TypeError(f"backend must provide {', '.join(BACKEND_METHODS)}; "
                            f"{type(backend).__name__} lacks {', '.join(missing)}")
        limit_setting = _limit_setting(limit)
        if timeline is None:
            timeline = _int_from_env(ENV_TIMELINE, 0)
            if timeline < 0:
                raise ValueError(f"{ENV_TIMELINE}={timeline}: expected a number of events >= 0")
        self.backend = backend
        self._n_devices = min(backend.device_count(), _core.MAX_DEVICES)   # asked once, not per call
        # _segments: segment_round, small_segment, release_on_miss (0 never, 1 above the high-water mark: the
        # default, 2 always; the memory study compares them), release_idle (with 1: requests a segment stays
        # whole and free before a miss may give it back; default 64)
        self._core = _core.Allocator(backend, make_error, self.classes_per_doubling or 1, 0,
                                     _stream_fn, scheme=self.scheme, **(_segments or {}))
        self._hook = None
        self.set_debug(_debug_mode(debug))
        if limit_setting is not None:
            kind, value = limit_setting
            if kind == "fraction":
                self._core.set_default_limit(0, value)
            else:
                self._core.set_default_limit(value, 0.0)
        if timeline:
            self.enable_timeline(timeline)
        _live_cores.add(self._core)

    # --- allocation (the CuPy adapter has its own C-level path)
    def allocate(self, nbytes: int, device: int | None = None, stream: int | None = None):
        """A block of at least ``nbytes`` bytes.

        Args:
            nbytes (int): bytes wanted (0 gives the smallest class).
            device (int): the device; None: the backend's current device.
            stream (int): the stream handle the block is used on; it is reused
                only there.  None: the backend's current stream.

        Returns:
            xpool._core.Allocation: ``.ptr``, ``.size`` (its class),
            ``.requested``, ``.device``, ``.stream``; the block goes back to
            the pool when ``.release()`` is called or the object dies.

        Raises:
            ValueError: bad ``nbytes``, ``device`` or ``stream``.
            xpool.OutOfMemoryError: the device or the limit refused the block
                after the cache was freed and garbage collected
                (``RequestTooLargeError`` if larger than the whole device).
            xpool.CorruptionError: debug mode found damage (see ``check``).
        """
        n = check_nbytes(nbytes)
        return self._core.allocate(n, self._device(device), self._stream(stream))

    def _device(self, device):
        if device is None:
            return self.backend.current_device()
        n = self._n_devices
        if isinstance(device, bool) or not isinstance(device, numbers.Integral) or not 0 <= device < n:
            raise ValueError(f"device must be an int in [0, {n}) on this machine, got {device!r}")
        return int(device)

    def _stream(self, stream):
        if stream is None:
            return self.backend.current_stream()
        if isinstance(stream, bool):
            raise ValueError(f"stream must be an int stream handle, got {stream!r}")
        try:
            s = operator.index(stream)
        except TypeError:
            raise ValueError(f"stream must be an int stream handle, got {type(stream).__name__} "
                             f"{stream!r}") from None
        if not -(1 << 63) <= s < (1 << 63):
            raise ValueError(f"stream must fit in 64 bits, got {s}")
        return s

    def _devices(self, device):
        return self.devices() if device is None else [self._device(device)]

    # --- statistics
    def devices(self) -> list[int]:
        """Devices this pool has served, in order.

        Returns:
            list[int]: every device with a pool (served, or asked about).
        """
        return self._core.devices()

    def stats(self, device: int | None = None):
        """Exact counters, one row per device.

        Args:
            device (int): one device; None: every device served.

        Returns:
            pandas.DataFrame: columns ``xpool.stats.COLUMNS`` (requests, hits,
            device_mallocs, bytes_in_use, bytes_cached, bytes_reserved, peaks,
            limit, ...).

        Raises:
            ValueError: bad ``device``.
        """
        return frame([self._core.stats(d) for d in self._devices(device)])

    def snapshot(self) -> Snapshot:
        """Cheap copy of every device's counters; subtract two to get per-step activity.

        Returns:
            xpool.Snapshot: ``(after - before).device_mallocs`` and the like.
        """
        return Snapshot({d: self._core.stats(d) for d in self._core.devices()})

    def reset_peak_stats(self, device: int | None = None) -> None:
        """Set the peak gauges to the current levels.

        Args:
            device (int): one device; None: every device served.

        Raises:
            ValueError: bad ``device``.
        """
        for d in self._devices(device):
            self._core.reset_peaks(d)

    # --- giving memory back
    def empty_cache(self, device: int | None = None) -> int:
        """Give every cached block back to the device(s).

        Args:
            device (int): one device; None: every device served.

        Returns:
            int: bytes given back.

        Raises:
            ValueError: bad ``device``.
            Exception: the first error of ``backend.free``; every cached block
                is still tried, and a block whose free failed stays cached
                (counted, retried by the next call).
        """
        return self._release(self._devices(device), 0)

    def trim(self, keep_bytes: int, device: int | None = None) -> int:
        """Give cached blocks back until at most ``keep_bytes`` stay cached per device.

        Args:
            keep_bytes (int): cached bytes to keep on each device.
            device (int): one device; None: every device served.

        Returns:
            int: bytes given back.

        Raises:
            ValueError: bad ``keep_bytes`` or ``device``.
            Exception: as ``empty_cache``.
        """
        keep = check_nbytes(keep_bytes, "keep_bytes")
        return self._release(self._devices(device), keep)

    def _release(self, devices, keep: int) -> int:
        # every device is tried even if a backend free fails on one; then the first failure is raised
        released, first = 0, None
        for d in devices:
            try:
                released += self._core.release(d, keep=keep)
            except Exception as e:  # noqa: BLE001 - re-raised below
                first = first or e
        if first is not None:
            raise first
        return released

    # --- limits
    def set_limit(self, size: int | None = None, fraction: float | None = None,
                  device: int | None = None) -> None:
        """Cap the bytes one device may hold for this pool (in use + cached + in flight).

        The cap holds with threads sharing the device: bytes are counted
        against it before the backend is asked, and cached bytes being given
        back count until the backend has freed them.  Lowering it below what
        is in use frees nothing in use; allocations fail until enough is
        released.

        Args:
            size (int): bytes; None or 0 removes the limit.
            fraction (float): instead of ``size``, a share of the device's
                memory in [0, 1]; any positive share is at least 1 byte.
            device (int): the device; None: the current device (as CuPy's
                ``set_limit``).  ``Pool(limit=...)`` sets every device's.

        Raises:
            ValueError: bad ``size``, ``fraction`` or ``device``, or both given.
        """
        if size is not None and fraction is not None:
            raise ValueError("give size or fraction, not both")
        d = self._device(device)
        if fraction is not None:
            if (isinstance(fraction, bool) or not isinstance(fraction, numbers.Real)
                    or not 0 <= fraction <= 1):
                raise ValueError(f"fraction must be a number in [0, 1], got {fraction!r}")
            total = self.backend.total_memory(d)
            size = max(1, int(fraction * total)) if fraction > 0 else 0
        self._core.set_limit(d, check_nbytes(size or 0, "size"))

    def get_limit(self, device: int | None = None) -> int:
        """The limit of one device.

        Args:
            device (int): the device; None: the current device.

        Returns:
            int: bytes, 0 when there is none.
        """
        return self._core.stats(self._device(device))["limit"]

    # --- diagnostics
    def set_debug(self, mode) -> None:
        """Turn debug mode on or off (see ``xpool.debug``).

        Blocks that already exist are checked only for what debug mode did to
        them: a block handed out before gets no canary check, a block cached
        before gets no poison check.

        Args:
            mode: ``"raise"``, ``"warn"``, True (= ``"raise"``), or None/False: off.

        Raises:
            ValueError: an unknown mode.
        """
        mode = _debug_mode(mode) if mode is not None else None
        if mode is None:
            self._hook = None
            self._core.set_debug(None, 0)
        else:
            self._hook = DebugHook(self.backend, mode)
            self._core.set_debug(self._hook, DEFAULT_TAIL)

    @property
    def debug(self):
        """The debug mode: ``"raise"``, ``"warn"`` or None."""
        return self._hook.mode if self._hook else None

    def check(self) -> None:
        """In debug mode, report damage found so far and scan live blocks' canaries.

        Safe while other threads allocate and free: a block is scanned only
        once its canary is written and until it is freed.

        Raises:
            xpool.CorruptionError: a write past a block's end or after its free.
        """
        hook = self._hook
        if not hook:
            return
        from .errors import CorruptionError
        problems = [str(e) for e in hook.take_pending()]
        for d in self.devices():
            def still_live(damaged, d=d):   # other threads may free blocks while their canaries are read
                return {(b["ptr"], b["serial"]) for b in self._core.live_blocks(d)}
            problems += hook.check_live(self._core.live_blocks(d), still_live)
        if problems:
            raise CorruptionError("\n".join(problems))

    def enable_timeline(self, capacity: int = 1_000_000) -> None:
        """Record every malloc/free into a ring of ``capacity`` events.

        Args:
            capacity (int): events kept (0 turns recording off and drops them).

        Raises:
            ValueError: ``capacity`` is not an int >= 0.
        """
        if isinstance(capacity, bool) or not isinstance(capacity, numbers.Integral) or capacity < 0:
            raise ValueError(f"capacity must be an int >= 0, got {capacity!r}")
        self._core.timeline_enable(int(capacity))

    def timeline(self):
        """The recorded events.

        Returns:
            pandas.DataFrame: one row per event (``xpool.timeline``);
            ``attrs["dropped"]``: events lost to the ring.
        """
        return events_frame(*self._core.timeline_events())

    def live_blocks(self, device: int | None = None) -> list[dict]:
        """The blocks handed out on one device.

        Args:
            device (int): the device; None: the current device.

        Returns:
            list[dict]: ``device, ptr, size, requested, stream, serial,
            guarded, poisoned`` per block.
        """
        return self._core.live_blocks(self._device(device))

    def __repr__(self):
        k = f" classes_per_doubling={self.classes_per_doubling}" if self.scheme == "seed" else ""
        return (f"<{type(self).__name__} scheme={self.scheme}{k} "
                f"devices={self.devices()} debug={self.debug}>")


def _after_fork_in_child() -> None:
    # The parent's device memory is not the child's: forget it, never free or reuse it.
    for core in list(_live_cores):
        core.forget_after_fork()
        reset = getattr(core.debug_hook, "after_fork_in_child", None)   # a user's own hook may have none
        if reset is not None:
            reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
