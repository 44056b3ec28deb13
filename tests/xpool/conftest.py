"""Fixtures shared by the allocator's tests."""
import gc

import pytest


@pytest.fixture
def frozen_gc():
    """The objects made before the test, frozen (gc.freeze) while it runs.  The recovery ladder's gc.collect() walks
    every object the process holds, after the rest of the suite many times a test's own: a state machine that runs
    out of memory at many of its steps then spends its time there.  Frozen, a collection costs what the test's own
    objects do; its own garbage is collected as ever."""
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture
def seed_scheme(monkeypatch):
    """A test that spells out the bytes of the design's size classes runs under scheme seed (the default, segments,
    has its own in tests/xpool/test_segments.py)."""
    monkeypatch.setenv("XPOOL_SCHEME", "seed")
