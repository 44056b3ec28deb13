"""Benchmarks anyone can run: each prints a short table and writes a CSV (`python -m xlab.bench.alloc`)."""
from __future__ import annotations

import argparse
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


def at_least(low, kind=int):
    """An argparse type: `kind` of the text, an error of the command line below `low` (0.0 for a float: above it)."""
    def parse(text: str):
        value = kind(text)
        if value < low or (kind is float and value <= low):
            raise argparse.ArgumentTypeError(f"must be {'>' if kind is float else '>='} {low}, got {text}")
        return value
    parse.__name__ = kind.__name__          # argparse's message: invalid int value: 'x'
    return parse
