"""Scheme xpool (segments) under CuPy on a real GPU (marked: skipped where no GPU is visible)."""
import numpy as np
import pytest

import xpool

cp = pytest.importorskip("cupy")
MiB = 1 << 20


@pytest.mark.gpu
def test_training_is_bit_identical_under_both_schemes_and_debug_mode():
    from xlab import correctness
    df = correctness.transparency_gate(steps=20, allocators=("raw", "xpool", "xpool_seed", "xpool_debug"))
    assert df.identical_to_raw.all(), "\n" + df.to_string()     # debug mode found nothing, too


@pytest.mark.gpu
@pytest.mark.parametrize("batch,foreach", [
    (4, True),
    (32, True),
    # The per-parameter update remakes every moment array each step, so where a warm step's arrays land depends on
    # cudaMalloc's addresses (#14). Under the product's one rule, `never` (decision 0001), it passed on an H200 at
    # f7709ef (an xpass) and failed on an H100 at db0b678: device (mallocs, frees) per step [(117, 0), (0, 0),
    # (0, 0), (0, 0), (1, 0), (0, 0), (0, 0), (0, 0), (1, 0), (0, 0)] (runs/2026-12-07_db0b678_h100/tests.log).
    # A known defect of the segments scheme on this update, then, not fixed by the rule: an xfail that may pass.
    pytest.param(32, False, marks=pytest.mark.xfail(reason="a late device malloc on some GPUs: moments remade every "
                                                           "step land by cudaMalloc's addresses (#14)", strict=False)),
])
def test_training_makes_no_device_mallocs_once_warm(pool, batch, foreach):
    from tapegpt import GPT, AdamW, GPTConfig, get_batch, load_corpus
    cfg = GPTConfig(batch_size=batch)
    data = load_corpus()
    model = GPT(cfg, xp=cp)
    opt = AdamW(model.params, lr=1e-3, foreach=foreach)

    def step(i):
        x, y = get_batch(data, cfg.batch_size, cfg.block_size, i, xp=cp)
        loss, grads = model.loss_and_grads(x, y)
        opt.step(grads)

    per_step = []                          # (device mallocs, device frees) of each step, for the message
    for i in range(10):                    # 5 warm-up steps, as the experiments run, then 5 warm ones
        if i == 5:
            before = pool.stats()
        last = pool.stats()
        step(i)
        cp.cuda.Device().synchronize()
        d = pool.stats() - last
        per_step.append((int(d.device_mallocs), int(d.device_frees)))
    delta = pool.stats() - before
    assert delta.requests > 100, per_step
    assert delta.device_mallocs == 0 and delta.device_frees == 0, f"device (mallocs, frees) per step: {per_step}"
    s = pool.stats(0)
    assert s.bytes_reserved == s.bytes_in_use + s.bytes_cached


def test_ranges_of_one_segment_and_streams(mem):
    mem.pool()
    a = mem.empty(1000)
    b = mem.empty(1000)
    assert b.ptr == a.ptr + 1024                       # cut one after the other from one segment
    pa = a.ptr
    s1 = mem.stream()
    with s1:
        c = mem.empty(3 * MiB)
        pc = c.ptr
        del c
    d = mem.empty(3 * MiB)                             # the default stream: not s1's free range
    assert d.ptr != pc
    with s1:
        assert mem.empty(MiB).ptr == pc
    del a
    assert mem.empty(512).ptr == pa


@pytest.mark.gpu
def test_overrun_of_a_split_block_is_caught():
    prev = cp.cuda.get_allocator()
    p = xpool.MemoryPool(debug="raise")
    cp.cuda.set_allocator(p.malloc)
    try:
        a = cp.zeros(100, dtype=cp.uint8)
        b = cp.zeros(100, dtype=cp.uint8)              # its neighbour in the same segment
        assert b.data.ptr == a.data.ptr + 512              # 100 B + the 64 B canary: one 512 B range
        wide = cp.ndarray((101,), cp.uint8, memptr=cp.cuda.MemoryPointer(
            cp.cuda.UnownedMemory(a.data.ptr, 101, None, 0), 0))
        wide[100] = 7                                  # one byte past a: its canary, not b
        cp.cuda.runtime.deviceSynchronize()
        assert int(b.sum()) == 0
        del a, wide
        with pytest.raises(xpool.CorruptionError, match="requested 100 B"):
            cp.empty(8, dtype=cp.uint8)
        p.check()
    finally:
        cp.cuda.set_allocator(prev)


def test_empty_cache_gives_whole_segments_back_to_the_device(mem):
    pool = mem.pool()
    keep = mem.empty(MiB)                              # its segment stays: partly in use
    a = mem.empty(256 * MiB)
    del a
    free_before = mem.free()
    assert pool.empty_cache() == 256 * MiB
    assert mem.free() - free_before >= 200 * MiB
    s = pool.stats(0)
    assert s.bytes_reserved == 2 * MiB and s.bytes_in_use == MiB and keep.nbytes == MiB


def test_a_miss_only_adds_and_empty_cache_gives_the_whole_free_segments_back(mem):
    """The one release rule (docs/decisions/0001-one-release-rule-per-scheme.md): a miss that fits no free range
    makes a segment and gives none back, however long the others have idled; empty_cache gives back every whole free
    segment, and no segment a block still uses."""
    pool = mem.pool()
    keep = mem.empty(512)                              # a 2 MiB segment, shared by later small blocks
    a = mem.empty(64 * MiB)
    del a
    b = mem.empty(128 * MiB)                           # fits no free range: a segment of its own
    for _ in range(64):                                # cut from keep's segment: 64 MiB's idles
        mem.empty(512)
    del b
    c = mem.empty(256 * MiB)                           # a miss again: it adds, and gives nothing back
    s = pool.stats(0)
    assert (s.device_mallocs, s.device_frees, s.bytes_reserved) == (4, 0, (2 + 64 + 128 + 256) * MiB)
    assert pool.empty_cache() == (64 + 128) * MiB
    s = pool.stats(0)
    assert (s.device_frees, s.bytes_reserved) == (2, (2 + 256) * MiB)
    assert c.nbytes == 256 * MiB and keep.nbytes == 512
    if mem.kind == "cupy":
        assert np.isfinite(float(cp.ones(4, cp.float32).sum()))


@pytest.mark.gpu
def test_varying_length_training_run_measures_each_allocators_peaks(tmp_path):
    """The memory stage's varying-length run (issue #14): one row per allocator with exact peaks."""
    from xlab import memory_study
    df = memory_study.measure_varlen(block_sizes=(64, 16, 48, 32, 64, 24, 40))
    assert list(df["allocator"]) == list(memory_study.VARLEN_ALLOCATORS)
    assert set(memory_study.VARLEN_COLUMNS) <= set(df.columns) and {"gpu", "commit", "date"} <= set(df.columns)
    assert (df["peak_bytes_reserved"] >= df["peak_bytes_requested"]).all()
    assert (df["reserved_over_requested"] >= 1).all() and (df["device_mallocs"] > 0).all()
    by = df.set_index("allocator")
    # the two counters agree on what the program asked for: the same requests under every allocator
    assert by.loc["xpool", "peak_bytes_requested"] == by.loc["xpool_seed", "peak_bytes_requested"]
    assert by.loc["xpool", "reserved_over_requested"] < by.loc["xpool_seed", "reserved_over_requested"]
    assert (df["block_sizes"] == "64 16 48 32 64 24 40").all() and (df["adamw"] == "foreach").all()
