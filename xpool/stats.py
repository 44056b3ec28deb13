"""Exact statistics: counters per device, cheap snapshots and their differences."""
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


def pandas(what: str):
    """pandas, imported only where a DataFrame is asked for (the allocator itself needs none)."""
    try:
        return importlib.import_module("pandas")
    except ImportError as e:
        raise ImportError(f"xpool: {what} returns a pandas DataFrame; install pandas "
                          f"(Pool.snapshot() and _core.stats() need none)") from e


@dataclass(frozen=True)
class Snapshot:
    """Counters of every device at one moment; ``later - earlier`` gives the activity between.

    Counters (``COUNTERS``) are differenced, gauges (``GAUGES``) keep the later value; either is
    read summed over the devices as an attribute (``snap.device_mallocs``) or with ``total(name)``.
    """

    per_device: dict = field(default_factory=dict)   # device -> {name: int}

    def __sub__(self, earlier: "Snapshot") -> "Snapshot":
        out = {}
        for dev, now in self.per_device.items():
            before = earlier.per_device.get(dev, {})
            out[dev] = {k: (now[k] - before.get(k, 0) if k in COUNTERS else now[k])
                        for k in now if k != "device"}
        return Snapshot(out)

    def total(self, name: str) -> int:
        """Sum of one counter or gauge over the devices."""
        return sum(d[name] for d in self.per_device.values())

    def __getattr__(self, name):
        if name in COUNTERS or name in GAUGES:
            return self.total(name)
        raise AttributeError(name)


def frame(rows: list[dict]):
    """One row per device, in a fixed column order."""
    pd = pandas("stats()")
    return pd.DataFrame(rows, columns=list(COLUMNS))
