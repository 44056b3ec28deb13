"""Debug mode: poison freed blocks, guard the tail with a canary, remember where blocks came from.

CuPy's, PyTorch's and RMM's pools reuse memory silently; here, in debug mode,
- a freed block is filled with 0xFF bytes, which read as NaN in every float
  dtype (and -1 in signed ints), so a use-after-free read shows up at once;
- on reuse the poison is checked, so a write after free is caught;
- every request gets `tail` extra bytes, filled with a canary checked when the
  block comes back, so a write past the requested length is caught.
The C core calls on_alloc / on_reuse / on_free outside its locks.
"""
from __future__ import annotations

import traceback
import warnings

from .errors import CorruptionError, CorruptionWarning

POISON = 0xFF
CANARY = 0xA5
DEFAULT_TAIL = 64
MODES = ("warn", "raise")


class DebugHook:
    """Implements debug mode for one pool over its backend's fill/read."""

    def __init__(self, backend, mode: str = "raise", tail: int = DEFAULT_TAIL,
                 check_reuse: bool = True, trace_depth: int = 12):
        if mode not in MODES:
            raise ValueError(f"debug mode must be one of {MODES} (or False/None to turn it off), got {mode!r}")
        self.backend, self.mode, self.tail = backend, mode, tail
        self.check_reuse, self.trace_depth = check_reuse, trace_depth
        self.where: dict[tuple[int, int], list] = {}   # (device, ptr) -> allocation site (frames)
        self.pending: list[CorruptionError] = []   # found in a destructor, raised at the next allocation
        self.found: list[str] = []                  # every report, for tests and notebooks

    # hooks called by the C core
    def on_alloc(self, b: dict) -> None:
        self._raise_pending()
        self._arm(b)

    def on_reuse(self, b: dict) -> None:
        self._raise_pending()
        if self.check_reuse:
            data = self.backend.read(b["device"], b["ptr"], b["size"])
            bad = _first_mismatch(data, POISON)
            if bad is not None:
                self.backend.fill(b["device"], b["ptr"], b["size"], POISON)   # report once
                msg = (f"xpool debug: block 0x{b['ptr']:x} ({b['size']} B, device {b['device']}, "
                       f"stream 0x{b['stream']:x}) was written after it was freed: byte {bad} is "
                       f"0x{data[bad]:02x}, not poison 0x{POISON:02x}")
                self._report(msg, can_raise=True)
        self._arm(b)

    def on_free(self, b: dict) -> None:
        key = (b["device"], b["ptr"])
        n, size = b["requested"], b["size"]
        tail = self.backend.read(b["device"], b["ptr"] + n, size - n) if size > n else b""
        bad = _first_mismatch(tail, CANARY)
        if bad is not None:
            site = self.where.get(key)
            where = "".join(traceback.format_list(site)) if site else "  (not recorded)\n"
            msg = (f"xpool debug: write past the end of block 0x{b['ptr']:x} on device {b['device']}: "
                   f"requested {n} B (class {size} B), byte {n + bad} (+{bad} past the end) is "
                   f"0x{tail[bad]:02x}, not canary 0x{CANARY:02x}. Allocated at:\n{where}")
            self._report(msg, can_raise=False)
        self.where.pop(key, None)
        self.backend.fill(b["device"], b["ptr"], size, POISON)

    # helpers
    def _arm(self, b: dict) -> None:
        n, size = b["requested"], b["size"]
        if size > n:
            self.backend.fill(b["device"], b["ptr"] + n, size - n, CANARY)
        self.where[(b["device"], b["ptr"])] = traceback.extract_stack(limit=self.trace_depth)[:-1]

    def check_live(self, blocks: list[dict]) -> list[str]:
        """Canary check of blocks still in use; returns the problems found."""
        out = []
        for b in blocks:
            n, size = b["requested"], b["size"]
            tail = self.backend.read(b["device"], b["ptr"] + n, size - n) if size > n else b""
            bad = _first_mismatch(tail, CANARY)
            if bad is not None:
                out.append(f"xpool debug: live block 0x{b['ptr']:x} on device {b['device']} "
                           f"(requested {n} B) has byte +{bad} past its end overwritten")
        return out

    def _report(self, msg: str, can_raise: bool) -> None:
        self.found.append(msg)
        if self.mode == "warn":
            warnings.warn(msg, CorruptionWarning, stacklevel=3)
        elif can_raise:
            raise CorruptionError(msg)
        else:   # a destructor cannot raise: the next allocation will
            self.pending.append(CorruptionError(msg))

    def _raise_pending(self) -> None:
        if self.pending:
            errors, self.pending = self.pending, []
            raise errors[0] if len(errors) == 1 else CorruptionError(
                f"{len(errors)} corruptions found:\n" + "\n".join(str(e) for e in errors))


def _first_mismatch(data: bytes, byte: int):
    """Index of the first byte that is not `byte`, or None."""
    import numpy as np
    bad = np.flatnonzero(np.frombuffer(data, dtype=np.uint8) != byte)
    return int(bad[0]) if bad.size else None
