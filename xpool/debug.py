"""Debug mode: poison freed blocks, guard the tail with a canary, remember where blocks came from.

CuPy's, PyTorch's and RMM's pools reuse memory silently; in debug mode a freed block is filled with 0xFF bytes (NaN in
every float dtype, -1 in signed ints), so a use-after-free read shows at once; the poison is checked on reuse, so a
write after free is caught; every request gets `tail` extra bytes of canary, checked when the block comes back, so a
write past the requested length is caught.  The C core calls on_alloc / on_reuse / on_free / on_segment outside its
locks, on a block no other thread can reach: on_alloc / on_reuse before the block is listed by `live_blocks()` (so
`Pool.check()` never reads a canary not yet written), on_free after it left that list and before it is cached; a
block's info says what debug mode did to it (`guarded`, `poisoned`).
"""
from __future__ import annotations

import threading
import traceback
import warnings

import numpy as np   # here, not in _first_mismatch: a block freed at interpreter exit can import nothing

from .errors import CorruptionError, CorruptionWarning

POISON = 0xFF
CANARY = 0xA5
DEFAULT_TAIL = 64
MODES = ("warn", "raise")


class DebugHook:
    """Implements debug mode for one pool over its backend's fill/read.

    Args:
        backend: the pool's backend (``fill`` and ``read`` are used).
        mode (str): ``"raise"`` or ``"warn"``.
        tail (int): canary bytes the core adds past each request.
        check_reuse (bool): check the poison of a cached block when it is reused.
        trace_depth (int): frames of the allocation site to keep per block.

    Raises:
        ValueError: an unknown ``mode``.
    """

    def __init__(self, backend, mode: str = "raise", tail: int = DEFAULT_TAIL,
                 check_reuse: bool = True, trace_depth: int = 12):
        if mode not in MODES:
            raise ValueError(f"debug mode must be one of {MODES} (or False/None to turn it off), got {mode!r}")
        self.backend, self.mode, self.tail = backend, mode, tail
        self.check_reuse, self.trace_depth = check_reuse, trace_depth
        self.where: dict[tuple[int, int], list] = {}   # (device, ptr) -> allocation site (frames)
        self._pending_lock = threading.Lock()      # guards pending: filled in destructors, taken by any thread
        self.pending: list[CorruptionError] = []   # found in a destructor, raised at the next allocation
        self.found: list[str] = []                  # every report, for tests and notebooks

    # hooks called by the C core
    def on_alloc(self, b: dict) -> None:
        self._raise_pending()
        self._arm(b)

    def on_reuse(self, b: dict) -> None:
        self._raise_pending()
        if self.check_reuse and b.get("poisoned", True):
            data = self.backend.read(b["device"], b["ptr"], b["size"])
            bad = _first_mismatch(data, POISON)
            if bad is not None:
                self.backend.fill(b["device"], b["ptr"], b["size"], POISON)   # report once
                msg = (f"xpool debug: block 0x{b['ptr']:x} ({b['size']} B, device {b['device']}, "
                       f"stream 0x{b['stream']:x}) was written after it was freed: byte {bad} is "
                       f"0x{data[bad]:02x}, not poison 0x{POISON:02x}")
                self._report(msg, can_raise=True)
        self._arm(b)

    def on_segment(self, b: dict) -> None:
        """A new segment (scheme segments): its rest is cached from the start, so it is poisoned as a freed
        block would be; its first range is armed by on_alloc next."""
        self.backend.fill(b["device"], b["ptr"], b["size"], POISON)

    def on_free(self, b: dict) -> None:
        key = (b["device"], b["ptr"])
        n, size = b["requested"], b["size"]
        guarded = b.get("guarded", True) and size > n
        tail = self.backend.read(b["device"], b["ptr"] + n, size - n) if guarded else b""
        # poison before reporting: a warning turned into an error must not leave the block unpoisoned
        self.backend.fill(b["device"], b["ptr"], size, POISON)
        site = self.where.pop(key, None)
        bad = _first_mismatch(tail, CANARY)
        if bad is not None:
            where = "".join(traceback.format_list(site)) if site else "  (not recorded)\n"
            msg = (f"xpool debug: write past the end of block 0x{b['ptr']:x} on device {b['device']}: "
                   f"requested {n} B (class {size} B), byte {n + bad} (+{bad} past the end) is "
                   f"0x{tail[bad]:02x}, not canary 0x{CANARY:02x}. Allocated at:\n{where}")
            self._report(msg, can_raise=False)

    # helpers
    def _arm(self, b: dict) -> None:
        n, size = b["requested"], b["size"]
        if size > n:
            self.backend.fill(b["device"], b["ptr"] + n, size - n, CANARY)
        self.where[(b["device"], b["ptr"])] = traceback.extract_stack(limit=self.trace_depth)[:-1]

    def check_live(self, blocks: list[dict], still_live=None) -> list[str]:
        """Canary check of blocks in use; returns the problems found.

        Args:
            blocks: the blocks' infos (``Pool.live_blocks``), a snapshot.
            still_live: optional ``f(damaged) -> set of (ptr, serial)`` of those still in use now.
                A block freed (and poisoned) after the snapshot was taken is no damage; a block
                still in use with the same serial was in use throughout, so its damage is real.
        """
        damaged = []
        for b in blocks:
            n, size = b["requested"], b["size"]
            if not b.get("guarded", True):   # handed out before debug mode was on: no canary
                continue
            tail = self.backend.read(b["device"], b["ptr"] + n, size - n) if size > n else b""
            bad = _first_mismatch(tail, CANARY)
            if bad is not None:
                damaged.append((b, f"xpool debug: live block 0x{b['ptr']:x} on device {b['device']} "
                                   f"(requested {n} B) has byte +{bad} past its end overwritten"))
        if damaged and still_live is not None:
            alive = still_live([b for b, _ in damaged])
            damaged = [(b, msg) for b, msg in damaged if (b["ptr"], b["serial"]) in alive]
        return [msg for _, msg in damaged]

    def _report(self, msg: str, can_raise: bool) -> None:
        self.found.append(msg)
        if self.mode == "warn":
            warnings.warn(msg, CorruptionWarning, stacklevel=3)
        elif can_raise:
            raise CorruptionError(msg)
        else:   # a destructor cannot raise: the next allocation will
            with self._pending_lock:
                self.pending.append(CorruptionError(msg))

    def take_pending(self) -> list[CorruptionError]:
        """The damage found in destructors and not yet raised; forgets it."""
        with self._pending_lock:
            errors, self.pending = self.pending, []
        return errors

    def _raise_pending(self) -> None:
        if self.pending:
            errors = self.take_pending()
            if errors:
                raise errors[0] if len(errors) == 1 else CorruptionError(
                    f"{len(errors)} corruptions found:\n" + "\n".join(str(e) for e in errors))

    def after_fork_in_child(self) -> None:
        """In a fork()ed child: the parent's blocks and reports are not the child's."""
        self._pending_lock = threading.Lock()   # a parent thread may have held it
        self.where.clear()
        self.pending = []


def _first_mismatch(data: bytes, byte: int):
    """Index of the first byte that is not `byte`, or None."""
    bad = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) != byte)
    return int(bad[0]) if bad.size else None
