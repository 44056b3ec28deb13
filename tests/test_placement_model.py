"""scripts/placement_variants.py's model of the expandable range: its best fit is the pool's (so its other
placements can be believed), and its range merges and grows as the pool's does."""
import pathlib
import sys

import pandas as pd
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))
import placement_variants as pv  # noqa: E402

DATA = pathlib.Path(__file__).resolve().parents[1] / "data"


def test_range_merges_free_neighbours_and_grows_from_the_last_free_range():
    r = pv.Range()
    assert r.grow(3 << 20) == 0 and r.top == 4 << 20 and r.starts == [3 << 20]     # the rest of the page is free
    assert r.grow(2 << 20) == 3 << 20 and r.top == 6 << 20 and r.starts == [5 << 20]
    r.put(0, 1 << 20)
    r.put(1 << 20, 3 << 20)                                 # merges with the range below
    assert r.starts == [0, 5 << 20] and r.end[0] == 3 << 20
    r.put(3 << 20, 5 << 20)                                 # and with both
    assert r.starts == [0] and r.end[0] == 6 << 20 and r.maps == 2


@pytest.mark.parametrize("placement,first", [("best", 0), ("best_high", 3 << 20)])
def test_a_placement_chooses_the_end_of_the_range_it_cuts(placement, first):
    model = pv.Model(placement)
    a = model.alloc(4 << 20, 1)                   # a miss: pages 0-1
    model.free(a, 2)
    assert model.alloc(1 << 20, 3) == first       # a hit in the free [0, 4 MiB): its low or high end


@pytest.mark.parametrize("name", ["dyn_cupy_mix", "dyn_gpt_b4", "dyn_test_b4"])
def test_the_models_best_fit_is_the_pools(name):
    tl = pd.read_csv(DATA / f"memory_trace_{name}.csv.gz")
    r = pv.model_replay(tl, "best")
    assert r["peak_bytes_mapped"] == pv.pool_peak(tl)
    assert r["touched_pages_over_requested"] <= r["reserved_over_requested"]


def test_the_committed_table_is_what_the_model_gives():
    df = pd.read_csv(DATA / "placement_variants.csv")
    assert set(df["placement"]) == set(pv.PLACEMENTS)
    row = df[(df["trace"] == "dyn_cupy_mix") & (df["placement"] == "lifetime")].iloc[0]
    r = pv.model_replay(pd.read_csv(DATA / "memory_trace_dyn_cupy_mix.csv.gz"), "lifetime")
    assert r["reserved_over_requested"] == pytest.approx(row["reserved_over_requested"])
    assert r["maps_after_warmup"] == row["maps_after_warmup"]
