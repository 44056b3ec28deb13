"""The allocation timeline: a bounded ring of events recorded by the C core."""
from __future__ import annotations

import numpy as np

from . import _core
from .counters import pandas

EVENT_DTYPE = np.dtype([
    ("t_ns", "<i8"), ("device", "<i4"), ("event", "<i4"), ("stream", "<i8"), ("ptr", "<u8"),
    ("requested", "<u8"), ("size", "<u8"), ("bytes_in_use", "<u8"), ("bytes_cached", "<u8"),
    ("origin", "<i4"), ("unused", "<i4"),
])
assert EVENT_DTYPE.itemsize == _core.EVENT_SIZE, "timeline layout out of step with _core.h"

# map / unmap (scheme expandable): pages mapped or unmapped, `ptr` and `size` the run's, no origin
EVENT_NAMES = {1: "alloc_hit", 2: "alloc_miss", 3: "free", 4: "release", 5: "oom", 6: "map", 7: "unmap"}
ORIGIN_NAMES = {0: "cupy", 1: "torch", 2: "python", -1: ""}   # who the block was handed to ("" for oom)


def events_frame(raw: bytes, dropped: int):
    """Raw event bytes -> tidy DataFrame (t_s from the first event kept)."""
    pd = pandas("timeline()")
    ev = np.frombuffer(raw, dtype=EVENT_DTYPE)
    df = pd.DataFrame({name: ev[name] for name in EVENT_DTYPE.names if name != "unused"})
    df["event"] = df["event"].map(EVENT_NAMES)
    df["origin"] = df["origin"].map(ORIGIN_NAMES)
    df["t_s"] = (df["t_ns"] - (df["t_ns"].iloc[0] if len(df) else 0)) / 1e9
    df["bytes_reserved"] = df["bytes_in_use"] + df["bytes_cached"]
    df.attrs["dropped"] = dropped
    return df
