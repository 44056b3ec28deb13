"""Exact statistics: a pool's counters per device, as a Snapshot; the difference of two is what happened between."""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field

# Counters only grow; a difference of two snapshots is what happened in between.
# device_maps / device_unmaps: scheme expandable's page maps and unmaps (ops calls), its device calls
COUNTERS = ("requests", "hits", "misses", "device_mallocs", "device_frees", "frees",
            "oom_recoveries", "oom_errors", "device_maps", "device_unmaps")
# Gauges are levels; a difference keeps the later value.
GAUGES = ("blocks_in_use", "blocks_cached", "bytes_in_use", "bytes_requested", "bytes_cached",
          "bytes_reserved", "peak_bytes_in_use", "peak_bytes_requested", "peak_bytes_reserved",
          "limit", "bytes_in_use_cupy", "bytes_in_use_torch", "bytes_in_use_python")
COLUMNS = ("device",) + COUNTERS + GAUGES
_SHOWN = ("requests", "hits", "device_mallocs", "device_frees", "device_maps", "device_unmaps", "bytes_in_use",
          "bytes_cached", "bytes_reserved", "peak_bytes_reserved")


def pandas(what: str):
    """pandas, imported only where a DataFrame is asked for (the allocator itself needs none)."""
    try:
        return importlib.import_module("pandas")
    except ImportError as e:
        raise ImportError(f"xpool: {what} returns a pandas DataFrame; pip install pandas") from e


@dataclass(frozen=True)
class Snapshot:
    """A pool's counters on every device it has served, at one moment (``xpool.stats()``, ``Pool.stats()``).

    ``snap.device_mallocs`` or ``snap["device_mallocs"]`` (any of ``COUNTERS`` or ``GAUGES``) is the sum over the
    devices; ``snap[device]`` one device's dict; ``later - earlier`` the activity between (counters differenced, gauges the later value);
    ``snap.frame()`` a pandas DataFrame, one row per device. Needs no pandas otherwise.

    Attributes:
        per_device (dict): device -> {name: int}.
        note (str): why it is empty, when it is (no pool in use).
    """

    per_device: dict = field(default_factory=dict)
    note: str = ""

    def __sub__(self, earlier: "Snapshot") -> "Snapshot":
        if not isinstance(earlier, Snapshot):
            return NotImplemented    # Python's TypeError: unsupported operand type(s) for -
        out = {}
        for dev, now in self.per_device.items():
            before = earlier.per_device.get(dev, {})
            out[dev] = {k: (now[k] - before.get(k, 0) if k in COUNTERS else now[k]) for k in now}
        return Snapshot(out)

    def __getitem__(self, key):
        """``snap[device]``: one device's dict; ``snap["bytes_cached"]``: a counter summed over the devices."""
        return self.total(key) if isinstance(key, str) else self.per_device[key]

    def __iter__(self):
        return iter(self.per_device)

    def __len__(self) -> int:
        return len(self.per_device)

    def total(self, name: str) -> int:
        """Sum of one counter or gauge over the devices."""
        if name not in COUNTERS and name not in GAUGES:
            raise ValueError(f"name must be a counter or gauge of xpool.counters.COLUMNS, got {name!r}")
        return sum(d[name] for d in self.per_device.values())

    def __getattr__(self, name):
        if name in COUNTERS or name in GAUGES:
            return self.total(name)
        raise AttributeError(f"'Snapshot' has no attribute {name!r} (the counters: xpool.counters.COLUMNS)")

    def frame(self):
        """One row per device, the columns of ``COLUMNS`` (needs pandas)."""
        pd = pandas("Snapshot.frame()")
        return pd.DataFrame([{"device": d, **c} for d, c in self.per_device.items()], columns=list(COLUMNS))

    def __repr__(self):
        if not self.per_device:
            return f"<xpool Snapshot: {self.note or 'no device served yet'}>"
        head = ["device", *_SHOWN]
        rows = [[str(d), *(f"{c.get(k, 0):,}" for k in _SHOWN)] for d, c in self.per_device.items()]
        widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
        return "\n".join("  ".join(v.rjust(w) for v, w in zip(r, widths)) for r in [head, *rows])
