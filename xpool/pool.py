"""Pool: the Python face of the C core, over any backend (host memory in tests, CuPy on a GPU)."""
from __future__ import annotations

import inspect
import math
import numbers
import operator
import os
import weakref

from . import _core
from .debug import DEFAULT_TAIL, DebugHook
from .errors import make_error
from .settings import ENV, Settings, resolve
from .sizeclass import MAX_REQUEST, check_nbytes
from .counters import COUNTERS, GAUGES, Snapshot
from .timeline import events_frame

# every C allocator alive, for the fork handler; the cores, not the Pool wrappers: CuPy may hold a pool's
# malloc (and so its core) after the wrapper is gone
_live_cores: "weakref.WeakSet[_core.Allocator]" = weakref.WeakSet()
BACKEND_METHODS = ("malloc", "free", "fill", "read", "current_device", "current_stream",   # of Backend
                   "device_count", "total_memory")


def _stream_handle(stream, what: str) -> int:
    """A stream handle as the core keys it: an int in [0, 2**63) (negative keys are the core's per-thread ones);
    a ValueError starting with `what` otherwise."""
    if not isinstance(stream, bool):
        try:
            s = operator.index(stream)
        except TypeError:
            s = None
        if s is not None and 0 <= s < (1 << 63):
            return s
    raise ValueError(f"{what} a stream handle, an int in [0, 2**63), got {type(stream).__name__} {stream!r}")


def settings_signature(init, positional=("settings",), keywords=()):
    """Gives init the signature help() and inspect show: `positional`, then `keywords` and every setting as
    keyword-only arguments (it takes the settings as **fields)."""
    P = inspect.Parameter
    params = [P("self", P.POSITIONAL_OR_KEYWORD)]
    params += [P(name, P.POSITIONAL_OR_KEYWORD, default=None if name == "settings" else P.empty)
               for name in positional]
    params += [P(name, P.KEYWORD_ONLY, default=None) for name in (*keywords, *ENV)]
    init.__signature__ = inspect.Signature(params)


class Pool:
    """A per-device caching allocator over a raw backend.

    Freed blocks stay cached per device and stream and are handed out again; the backend is called only on a miss,
    when the cache is given back, and on out-of-memory recovery.  Every method may be called from any thread.

    Args:
        backend: the raw allocate/free functions, an ``xpool.backends.Backend`` (``xpool.backends.CupyBackend()``
            on a GPU; the tests' host doubles on a CPU).
        settings (xpool.Settings): how the pool works; None: from the keywords, the ``XPOOL_*`` variables and the
            defaults.
        **fields: settings as keywords, over ``settings`` (see ``xpool.Settings``).

    Raises:
        TypeError: ``backend`` lacks one of the methods of ``Backend``, or a keyword is no setting.
        ValueError: a bad setting, naming the argument or variable.
    """

    def __init__(self, backend, settings: Settings | None = None, **fields):
        self._start(backend, resolve(settings, fields, type(self).__name__), 0)

    def _start(self, backend, settings: Settings, stream_lookup: int) -> None:
        """Sets the pool up; stream_lookup: 0, or the address of `intptr_t fn(int device)` giving a device's
        current stream (MemoryPool's CuPy lookup; the tests' pool_with_stream_lookup)."""
        missing = [m for m in BACKEND_METHODS if not callable(getattr(backend, m, None))]
        if missing:
            raise TypeError(f"backend must provide {', '.join(BACKEND_METHODS)}; "
                            f"{type(backend).__name__} lacks {', '.join(missing)}")
        self._backend = backend
        self.settings = settings
        count = backend.device_count()   # asked once, not per call
        if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 0:
            raise ValueError(f"backend.device_count() must return an int >= 0, got {count!r}")
        self._n_devices = min(int(count), _core.MAX_DEVICES)
        self._core = _core.Allocator(backend, make_error, settings, stream_lookup, self._n_devices)
        self._hook = None
        if settings.debug:
            self._hook = DebugHook(backend, settings.debug)
            self._core.set_debug(self._hook, DEFAULT_TAIL)
        _live_cores.add(self._core)

    # --- allocation (the CuPy adapter has its own C-level path)
    def allocate(self, nbytes: int, device: int | None = None, stream: int | None = None):
        """A block of at least ``nbytes`` bytes (0: the smallest) on ``device`` (None: the backend's current one), for
        use on ``stream`` (a handle; None: the backend's current stream): it is reused only there.

        Returns:
            xpool._core.Allocation: ``.ptr``, ``.size``, ``.requested``, ``.device``, ``.stream``; the block goes back
            to the pool on ``.release()`` or when the object dies.

        Raises:
            ValueError: bad ``nbytes``, ``device`` or ``stream``.
            xpool.OutOfMemoryError: the device or the limit refused the block after the cache was freed and garbage
                collected (``xpool.errors.RequestTooLargeError``: larger than the whole device).
            xpool.CorruptionError: debug mode found damage (see ``check``).
        """
        return self._core.allocate(nbytes, self._device(device), self._stream(stream))   # nbytes checked there

    def _device(self, device):
        if device is None:
            return self._current_device()
        n = self._n_devices
        if isinstance(device, bool) or not isinstance(device, numbers.Integral) or not 0 <= device < n:
            raise ValueError(f"device must be an int in [0, {n}) on this machine, got {device!r}")
        return int(device)

    def _current_device(self) -> int:
        """The backend's current device, checked: a bad answer is named, not passed on."""
        d = self._backend.current_device()
        if isinstance(d, bool) or not isinstance(d, numbers.Integral) or not 0 <= d < self._n_devices:
            raise ValueError(f"backend.current_device() must return an int in [0, {self._n_devices}) "
                             f"(backend.device_count()), got {d!r}")
        return int(d)

    def _stream(self, stream):
        if stream is None:
            return _stream_handle(self._backend.current_stream(), "backend.current_stream() must return")
        return _stream_handle(stream, "stream must be")

    def _devices(self, device):
        return self._core.devices() if device is None else [self._device(device)]

    def _gauges(self, d: int) -> dict:
        """Device d's counters, read without side effects: a device never served answers zeros and the limit its
        pool would start with (a share: backend.total_memory, which CupyBackend asks without a context)."""
        if d in self._core.devices():
            return self._core.stats(d)
        limit = self.settings.limit
        limit = max(1, int(limit * self._total_memory(d))) if isinstance(limit, float) and limit else limit
        return {**dict.fromkeys((*COUNTERS, *GAUGES, "bytes_pending", "bytes_releasing"), 0), "device": d,
                "limit": limit}

    def _total_memory(self, d: int) -> int:
        """backend.total_memory(d), checked: a bad answer is named, not passed on."""
        n = self._backend.total_memory(d)
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or not 1 <= n <= MAX_REQUEST:
            raise ValueError(f"backend.total_memory({d}) must return the device's bytes, an int in [1, 2**48], "
                             f"got {type(n).__name__} {n!r}")
        return int(n)

    # --- statistics
    def stats(self, device: int | None = None) -> Snapshot:
        """Exact counters of one ``device`` or (None) every device served, as they stand: cheap, no pandas needed.
        A read: a device never served answers zeros, and no device pool is made there.

        Returns:
            xpool.counters.Snapshot: ``snap.device_mallocs`` (summed over devices), ``snap[device]["bytes_cached"]``,
            ``(after - before).device_mallocs`` for what happened between two, ``snap.frame()`` a DataFrame.

        Raises:
            ValueError: bad ``device``.
        """
        return Snapshot({d: self._gauges(d) for d in self._devices(device)})

    def reset_peak_stats(self, device: int | None = None) -> None:
        """Set the peak gauges of one ``device`` (None: every device served) to the current levels.

        Raises:
            ValueError: bad ``device``.
        """
        for d in self._devices(device):
            self._core.reset_peaks(d)

    # --- giving memory back
    def empty_cache(self, device: int | None = None) -> int:
        """Give every cached block of one ``device`` (None: every device served) back to it.

        Returns:
            int: bytes given back.

        Raises:
            ValueError: bad ``device``.
            Exception: the first error of ``backend.free``; every cached block is still tried, and a block whose free
                failed stays cached (counted, retried by the next call).
        """
        return self._release(self._devices(device), 0)

    def trim(self, keep_bytes: int, device: int | None = None) -> int:
        """Give cached blocks back until at most ``keep_bytes`` stay cached on one ``device`` (None: each served).

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
        """Cap the bytes one device may hold for this pool (in use + cached + in flight), with threads sharing it:
        bytes count before the backend is asked, and until it has freed them.  Lowering it frees nothing in use.

        Args:
            size (int or float): bytes; None or 0 removes the limit.  A float is taken as CuPy's ``set_limit`` takes
                it, ``int(size)`` (``2.5e9``: 2500000000 B); a bool, text or any other type is refused.
            fraction (float): instead of ``size``, a share of the device's memory in [0, 1] (a positive one is at least
                1 byte).
            device (int): the device; None: the current device (as CuPy's ``set_limit``; the ``limit`` setting sets
                every device's).

        Raises:
            ValueError: bad ``size``, ``fraction`` or ``device``, or both given, or a bad ``backend.total_memory``.
        """
        if size is not None and fraction is not None:
            raise ValueError("give size or fraction, not both")
        d = self._device(device)
        if fraction is not None:
            if (isinstance(fraction, bool) or not isinstance(fraction, numbers.Real)
                    or not 0 <= fraction <= 1):
                raise ValueError(f"fraction must be a number in [0, 1], got {fraction!r}")
            size = max(1, int(fraction * self._total_memory(d))) if fraction > 0 else 0
        self._core.set_limit(d, _limit_bytes(size))

    def get_limit(self, device: int | None = None) -> int:
        """The limit of one ``device`` (None: the current one); a read, as ``stats``.

        Returns:
            int: bytes, 0 when there is none.
        """
        return self._gauges(self._device(device))["limit"]

    # --- diagnostics
    def check(self) -> None:
        """In debug mode, report damage found so far and scan live blocks' canaries (safe while other threads allocate
        and free: a block is scanned once its canary is written and until it is freed).

        Raises:
            xpool.CorruptionError: a write past a block's end or after its free.
        """
        hook = self._hook
        if not hook:
            return
        from .errors import CorruptionError
        problems = [str(e) for e in hook.take_pending()]
        self._core.pin_pages(True)   # a block freed meanwhile keeps its pages mapped (scheme expandable)
        try:
            for d in self._core.devices():
                def still_live(damaged, d=d):   # other threads may free blocks while their canaries are read
                    return {(b["ptr"], b["serial"]) for b in self._core.live_blocks(d)}
                problems += hook.check_live(self._core.live_blocks(d), still_live)
        finally:
            self._core.pin_pages(False)
        if problems:
            raise CorruptionError("\n".join(problems))

    def timeline(self):
        """The events recorded so far (the ``timeline`` setting: how many the ring keeps; 0 records none).

        Returns:
            pandas.DataFrame: one row per event (``xpool.timeline``); ``attrs["dropped"]``: events lost to the ring.
        """
        return events_frame(*self._core.timeline_events())

    def check_ipc(self, ptr: int, device: int | None = None) -> None:
        """Raise if CUDA IPC cannot share the block at ``ptr`` (an address in a block of the pool, on ``device``; None:
        the current one): call it before ``cudaIpcGetMemHandle``. The expandable scheme's pages are made with no shareable
        handle, and ``cudaIpcGetMemHandle`` refuses them; the other schemes' blocks are ``cudaMalloc``'s.

        Raises:
            xpool.errors.IpcUnsupportedError: the block is in the expandable scheme's virtual memory.
            ValueError: bad ``ptr`` or ``device``.
        """
        from .errors import IpcUnsupportedError
        if isinstance(ptr, bool) or not isinstance(ptr, numbers.Integral) or not 0 <= ptr < (1 << 64):
            raise ValueError(f"ptr must be a device address, an int in [0, 2**64), got {type(ptr).__name__} {ptr!r}")
        d = self._device(device)
        found = self._core.vm_range(d, int(ptr))
        if found is not None:
            raise IpcUnsupportedError(d, ptr, *found)

    def live_blocks(self, device: int | None = None) -> list[dict]:
        """The blocks handed out on one ``device`` (None: the current one).

        Returns:
            list[dict]: ``device, ptr, size, requested, stream, serial, guarded, poisoned`` per block.
        """
        return self._core.live_blocks(self._device(device))

    def __repr__(self):
        return f"<{type(self).__name__} {self.settings!r} devices={self._core.devices()}>"


settings_signature(Pool.__init__, ("backend", "settings"))


def _limit_bytes(size) -> int:
    """set_limit's size: None -> 0 (none); an int; a finite float >= 0 as int(size) (CuPy's); a ValueError naming
    it for anything else (a bool, text, a list: never "no limit")."""
    if isinstance(size, numbers.Real) and not isinstance(size, numbers.Integral) and math.isfinite(size) \
            and size >= 0:   # a float, numpy's among them
        size = int(size)
    return check_nbytes(0 if size is None else size, "size")


def _after_fork_in_child() -> None:
    # The parent's device memory is not the child's: forget it, never free or reuse it.
    for core in list(_live_cores):
        core.forget_after_fork()
        reset = getattr(core.debug_hook, "after_fork_in_child", None)   # a user's own hook may have none
        if reset is not None:
            reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
