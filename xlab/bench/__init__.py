"""Benchmarks anyone can run: each prints a short table and writes a CSV (`python -m xlab.bench.alloc`)."""
from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def gc_paused():
    """Python's collector off inside, on again after if it was: a collection (every 700 new objects) would land in
    some timed windows, not others."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()
