"""xlab.builds: another build of xpool loaded beside this one (how a change to the core is timed against the build
before it, interleaved in one process: xlab.bench.alloc --xpool-path)."""
import shutil

import pytest

import xpool
import xpool_twin
from xlab.builds import load_xpool

MiB = 1 << 20


@pytest.fixture(scope="module")
def other(tmp_path_factory):
    """A copy of this build (its C core a file of its own, so a library of its own), loaded as xpool_before."""
    root = tmp_path_factory.mktemp("other")
    src = xpool.__spec__.submodule_search_locations[0]
    shutil.copytree(src, root / "xpool", ignore=shutil.ignore_patterns("__pycache__"))
    return load_xpool(root, "xpool_before")


def test_the_other_build_runs_beside_this_one(other):
    assert other._core is not xpool._core and other.Settings is not xpool.Settings
    mine, theirs = xpool.Pool(xpool_twin.HostBackend()), other.Pool(xpool_twin.HostBackend(), scheme="seed")
    a, b = mine.allocate(MiB), theirs.allocate(MiB)
    assert (mine.stats().device_mallocs, theirs.stats().device_mallocs) == (1, 1)
    assert mine.settings.scheme == "segments" and theirs.settings.scheme == "seed"
    del a, b
    with pytest.raises(TypeError, match="of the package that loaded this core"):
        xpool._core.Allocator(xpool_twin.HostBackend(), None, other.Settings())   # each core trusts its own


def test_loading_is_idempotent_and_refuses_this_build_and_taken_names(other, tmp_path):
    root = other.__spec__.submodule_search_locations[0] + "/.."
    assert load_xpool(root, "xpool_before") is other
    with pytest.raises(ValueError, match="holds the xpool imported as xpool_before"):
        load_xpool(root, "xpool_again")
    with pytest.raises(ValueError, match="holds the xpool imported as xpool"):
        load_xpool(xpool.__spec__.submodule_search_locations[0] + "/..", "xpool_again")
    with pytest.raises(ValueError, match="must not be 'xpool'"):
        load_xpool(tmp_path, "xpool")
    with pytest.raises(FileNotFoundError, match="no xpool package"):
        load_xpool(tmp_path, "xpool_none")


def test_the_benchmarks_other_build_arms_use_its_memory_pool(other, monkeypatch):
    from xlab.bench import alloc
    made = []

    class Recorded:
        def __init__(self, **settings):
            made.append(settings)

    monkeypatch.setattr(alloc, "OTHER_BUILD", {})
    monkeypatch.setattr(other, "MemoryPool", Recorded)
    root = other.__spec__.submodule_search_locations[0] + "/.."
    assert alloc.other_build_arms(root) == ("xpool_before", "xpool_seed_before")
    arms = {name: make() for name, make in alloc.OTHER_BUILD.items()}
    assert [a.name for a in arms.values()] == ["xpool_before", "xpool_seed_before"]
    assert made == [dict(scheme="segments", debug=False), dict(scheme="seed", debug=False)]
    arms["xpool_before"].graph_pool()
    assert made[-1] == dict(scheme="segments", debug=False)


def test_the_other_builds_table_pairs_its_arms_by_trial():
    import pandas as pd

    from xlab.bench import alloc
    rows = pd.DataFrame([dict(allocator=a, sweep="size", size_bytes=4096, trial=t, us_per_pair=us * (1 + t / 100))
                         for t in range(5) for a, us in (("xpool", 2.0), ("xpool_before", 2.2),
                                                         ("xpool_seed", 1.0), ("xpool_seed_before", 1.0))])
    text = alloc.other_build_table(rows)
    assert "xpool_before / xpool" in text and "4 KiB 1.100 [1.100, 1.100]" in text
    assert "xpool_seed_before / xpool_seed" in text and "4 KiB 1.000" in text
    assert alloc.other_build_table(rows[rows.allocator == "xpool"]) == ""
