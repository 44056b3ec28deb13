"""xlab.torch_expandable_model (lab): PyTorch's expandable segments modelled on the host. Small traces whose answers
follow from c10/cuda/CUDACachingAllocator.cpp's rules by hand; the model's peaks against the GPU's runs of PyTorch's
allocator; the product's scheme expandable as one setting of it; the study's candidate and variants."""
import pathlib

import pandas as pd
import pytest

from xlab import cupy_default_study as cds
from xlab import memory_study as ms
from xlab import rule_study
from xlab import torch_expandable_model as tem

ROOT = pathlib.Path(__file__).resolve().parents[2]
DATA = ROOT / "data"
MIB = 1 << 20


def offset(model, handle):
    """A block's offset in its segment."""
    return handle[2] - handle[1].base


def test_rounding_and_the_two_pools():
    m = tem.ExpandableModel()
    a = m.allocate(1)                         # 512 B, the small pool: one 2 MiB page
    b = m.allocate(MIB)                       # 1 MiB is still small: same page
    c = m.allocate(MIB + 1)                   # rounds to 1 MiB + 512 B: the large pool, one 20 MiB page
    assert (a[3], b[3], c[3]) == (512, MIB, MIB + 512)
    assert a[1] is b[1] and c[1] is not a[1]
    assert (offset(m, a), offset(m, b)) == (0, 512)
    assert m.peak_reserved[0] == 22 * MIB and m.device_mallocs[0] == 2
    assert m.peak_requested[0] == 1 + MIB + MIB + 1            # requested bytes are the requests' own
    assert m.allocate(0) is None and m.device_mallocs[0] == 2  # no block for 0 bytes
    assert tem.round_size(513) == 1024 and tem.round_size(0) == 512


def test_a_miss_grows_the_segment_from_its_free_tail_by_whole_pages():
    m = tem.ExpandableModel()
    a = m.allocate(15 * MIB)                  # maps 20 MiB; 5 MiB free at the top
    b = m.allocate(10 * MIB)                  # misses: starts at the tail (15 MiB), maps 20 MiB more
    assert offset(m, b) == 15 * MIB and m.peak_reserved[0] == 40 * MIB and m.device_mallocs[0] == 2
    c = m.allocate(15 * MIB)                  # the 15 MiB left at the top fit: a hit
    assert offset(m, c) == 25 * MIB and m.device_mallocs[0] == 2
    for h in (a, b, c):
        m.free_chunk(h)
    d = m.allocate(40 * MIB)                  # everything merged back into one free block: no map
    assert offset(m, d) == 0 and m.peak_reserved[0] == 40 * MIB and m.device_mallocs[0] == 2


def test_the_free_tail_is_taken_last_and_the_product_takes_it_as_any_block():
    def state(model):
        a = model.allocate(4 * MIB)           # [0, 4)
        b = model.allocate(8 * MIB)           # [4, 12)
        c = model.allocate(4 * MIB)           # [12, 16); the tail [16, 20) stays free in a 20 MiB page
        model.free_chunk(b)                   # free: [4, 12) of 8 MiB, and the 4 MiB tail
        return a, c
    torch = tem.ExpandableModel()
    state(torch)
    # best fit for 3 MiB is the tail (4 MiB), but its expandable size is 4 MiB + the unmapped range: the next
    # block in (size, address) order, the 8 MiB one, is taken
    assert offset(torch, torch.allocate(3 * MIB)) == 4 * MIB
    # free now: [7, 12) of 5 MiB and the 4 MiB tail; 5 MiB is the best fit, not the tail
    assert offset(torch, torch.allocate(5 * MIB)) == 7 * MIB and torch.device_mallocs[0] == 1
    # with no other block that fits, the tail serves
    assert offset(torch, torch.allocate(4 * MIB)) == 16 * MIB and torch.device_mallocs[0] == 1
    # with 2 MiB pages (the product's), a tail of 1.5 MiB: [0, 4), [4, 12) freed, [12, 16.5) in use, top 18 MiB
    for name, at in (("expandable_model", 16.5 * MIB), ("expandable_tail_last", 4 * MIB)):
        m = tem.ExpandableModel(**tem.VARIANTS[name])
        a, b, c = m.allocate(4 * MIB), m.allocate(8 * MIB), m.allocate(9 * MIB // 2)
        m.free_chunk(b)
        assert m.peak_reserved[0] == 18 * MIB
        # the product's placement: the least (size, address) free range, the tail included; the variant's, last
        assert offset(m, m.allocate(3 * MIB // 2)) == at, name


def test_a_block_is_split_whenever_512_bytes_would_remain_and_frees_merge_with_free_neighbours():
    m = tem.ExpandableModel()
    a = m.allocate(1024)
    m.free_chunk(a)                           # [0, 2 MiB) free again
    b = m.allocate(512)                       # at 0, the rest split off
    c = m.allocate(512)                       # the next 512 B
    assert (offset(m, b), offset(m, c)) == (0, 512)
    m.free_chunk(b)
    m.free_chunk(c)                           # merges with [0, 512) and [1024, 2 MiB): one free 2 MiB block
    seg = m.segments[(0, 0, True)]
    assert seg.by_size == [(2 * MIB, seg.base)] and m.device_mallocs[0] == 1 and m.peak_reserved[0] == 2 * MIB


def test_each_stream_has_its_own_segments():
    m = tem.ExpandableModel()
    a = m.allocate(MIB, stream=0)
    m.free_chunk(a)
    b = m.allocate(MIB, stream=7)             # the free block of stream 0 is not reused
    assert b[1] is not a[1] and m.device_mallocs[0] == 2 and m.peak_reserved[0] == 4 * MIB


def replay_model(name, **settings):
    tl = rule_study.load_trace(name) if name not in cds.HOST else cds.load_trace(name)
    model = tem.ExpandableModel(**settings)
    ms._drive(model, ms._rows(ms._replay_events(tl)))
    return model, tl


@pytest.mark.parametrize("name", ["gpt_b4", "gpt_varlen_s3", "cupy_mix_s2", "torch_varlen_b32_s1", "resnet_varres"])
def test_the_models_peak_is_the_gpus_peak_of_pytorchs_expandable_segments(name):
    """dynamic_shapes.csv / dynamic_heldout.csv: PyTorch 2.11's allocator with expandable_segments:True on the H200,
    trial t on seed t (cupy_torch_expandable serving CuPy; torch_expandable for the PyTorch programs)."""
    model, tl = replay_model(name)
    info = rule_study.trace_info(name, tl)
    gpu = pd.concat([pd.read_csv(DATA / "dynamic_shapes.csv"), pd.read_csv(DATA / "dynamic_heldout.csv")])
    gpu = gpu[gpu.allocator.isin(["cupy_torch_expandable", "torch_expandable"]) & (gpu.workload == info["workload"])
              & (gpu.seed == info["seed"])]
    assert len(gpu) >= 1
    assert set(gpu.peak_reserved_bytes) == {model.peak_reserved[0]}
    assert set(gpu.peak_requested_bytes) == {model.peak_requested[0]}


@pytest.mark.parametrize("name", ["gpt_b4", "cupy_mix_s2", "host_cupy_fill"])
def test_the_products_settings_give_the_products_replay(name):
    model, tl = replay_model(name, **tem.VARIANTS["expandable_model"])
    info = rule_study.trace_info(name, tl)
    product = cds.replay(tl, "expandable", info["warmup"], info["steps"])
    assert (model.peak_reserved[0], model.device_mallocs[0]) == (product["peak_bytes_reserved"],
                                                                product["device_calls"])


def test_the_study_has_the_model_as_a_candidate_checked_against_the_gpu():
    assert "torch_expandable_model" in cds.CANDIDATES and cds.ARM["torch_expandable_model"] == "cupy_torch_expandable"
    rows = pd.read_csv(DATA / "cupy_default_replays.csv")
    t = rows[(rows.candidate == "torch_expandable_model") & (rows.requests == "gpu") & rows.measured_arm_ratio.notna()]
    assert len(t) >= 10
    assert (t.reserved_over_requested - t.measured_arm_ratio).abs().max() < 1e-9
    assert set(rows.loc[rows.candidate == "torch_expandable_model", "pool"]) == {"model"}


def test_the_variants_csv_holds_every_variant_and_the_products_setting_is_the_product():
    rows = pd.read_csv(DATA / "cupy_default_variants.csv")
    assert set(rows.candidate) == set(cds.VARIANTS)
    assert set(rows.experiment) == {"cupy_default_variants"}
    key = ["trace", "scale"]
    a = rows[rows.candidate == "expandable"].set_index(key)
    b = rows[rows.candidate == "expandable_model"].set_index(key).loc[a.index]
    assert (a.peak_bytes_reserved == b.peak_bytes_reserved).all() and (a.device_calls == b.device_calls).all()
    assert not set(cds.VARIANTS) - set(cds.CANDIDATES) & set(pd.read_csv(DATA / "cupy_default_replays.csv").candidate)


def test_a_variant_is_refused_by_name_unless_known():
    assert isinstance(cds.make_pool("expandable_small_pool"), tem.ExpandableModel)
    with pytest.raises(ValueError, match="candidate must be one of"):
        cds.make_pool("expandable_everything")
