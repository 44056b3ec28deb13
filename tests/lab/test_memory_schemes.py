"""The scheme study: replays through each scheme, CuPy's pool modelled, NumPy traces recorded on the CPU."""
import numpy as np
import pytest

import xpool
from xlab import memory_study
from xlab import numpy_traces as recorder
from xlab.memory_study import SCHEME_ALLOCATORS, AddressSpaceBackend, CupyPoolModel, replay_allocator

KiB, MiB = 1 << 10, 1 << 20


def _record(seed=0, n=3000, **pool_kw):
    """Random GPT-like allocs and frees on 2 devices x 2 streams through a pool; (timeline, its stats)."""
    pool = xpool.Pool(AddressSpaceBackend(), limit=0, debug=False, timeline=100_000, **pool_kw)
    rng = np.random.default_rng(seed)
    sizes = [100, 4096, 70_000, MiB, MiB + 1, 3 * MiB, 5_000_000, 12_582_912, 50_331_649]
    live = []
    for i in range(n):
        if live and rng.random() < 0.47:
            live.pop(int(rng.integers(len(live))))
        else:
            live.append(pool.allocate(int(rng.choice(sizes)) + int(rng.integers(0, 3000)),
                                      device=int(rng.integers(2)), stream=int(rng.choice([0, 7]))))
    tl = pool.timeline()
    tl["step"] = np.arange(len(tl)) * 3 // len(tl) - 1
    stats = pool.stats()
    del live
    return tl, stats


@pytest.mark.parametrize("allocator,pool_kw", [("xpool", {}), ("xpool_seed", dict(scheme="seed"))])
def test_replay_reproduces_each_scheme_exactly(allocator, pool_kw):
    trace, _ = _record()                       # recorded under scheme xpool ...
    _, truth = _record(**pool_kw)              # ... the same program run under `allocator`
    got = replay_allocator(trace, allocator)
    for name in ("peak_bytes_reserved", "peak_bytes_requested", "device_mallocs", "requests"):
        assert got[name] == truth[name], name
    assert got["unmatched_frees"] == 0


def test_replay_names_a_bad_allocator():
    with pytest.raises(ValueError, match="allocator"):
        memory_study.replay_pool("arena")


def test_cupy_model_splits_best_fits_and_merges():
    m = CupyPoolModel()
    x = m.allocate(4096)
    m.free_chunk(x)
    y = m.allocate(1000)                       # cut from x's chunk: 1024 B, the rest stays free
    z = m.allocate(3000)
    assert (y[1], z[1]) == (x[1], x[1] + 1024) and m.device_mallocs[0] == 1
    m.free_chunk(y)
    m.free_chunk(z)                            # merged back: 4096 B serve without a malloc
    assert m.allocate(4096)[1] == x[1] and m.device_mallocs[0] == 1
    big = m.allocate(8192)
    small = m.allocate(4096)
    m.free_chunk(big)
    m.free_chunk(small)
    assert m.allocate(3000)[1] == small[1]     # best fit: the 4 KiB chunk, not the 8 KiB one
    assert m.allocate(100, stream=5)[1] not in (big[1], small[1])   # another stream: its own arena
    assert m.peak_reserved[0] == 4096 + 8192 + 4096 + 512


def test_numpy_recorder_sees_every_array_and_restores_numpys_allocator():
    import numpy as np
    before = np._core.multiarray.get_handler_name()
    with recorder.NumpyRecorder() as rec:
        a = np.ones(1000)
        b = a * 2
        ptr = a.ctypes.data
        del a
    assert np._core.multiarray.get_handler_name() == before
    allocs = [(p, n) for is_alloc, p, n in rec.events if is_alloc]
    assert (ptr, 8000) in allocs and (b.ctypes.data, 8000) in allocs
    assert (0, ptr, 8000) in rec.events        # a's free, with its size
    del b


def test_numpy_timeline_records_setup_and_each_step():
    cfg = dict(n_layer=1, n_head=2, n_embd=32, n_ffn=64, block_size=16, batch_size=2)
    tl = recorder.record_numpy_timeline(batch=2, block_sizes=(16, 8), config=cfg)
    assert list(tl.columns) == memory_study.TIMELINE_COLUMNS and set(tl["step"]) == {-1, 0, 1}
    r = replay_allocator(tl, "xpool")
    assert r["unmatched_frees"] == 0 and r["peak_bytes_requested"] > 0
    with pytest.raises(ValueError, match="block_sizes"):
        recorder.record_numpy_timeline(batch=2, block_sizes=(17,), config=cfg)


def test_recorded_traces_are_written_where_the_study_reads_them(tmp_path):
    assert set(recorder.NUMPY_TRACES) <= set(memory_study.TRACES)
    cfg = dict(n_layer=1, n_head=2, n_embd=32, n_ffn=64, block_size=16, batch_size=2)
    tl = recorder.record_numpy_timeline(batch=2, block_sizes=(16,), config=cfg)
    recorder.write_numpy_trace(tl, "gpt_b4_cupy_path_numpy", tmp_path)
    back = memory_study.load_traces(tmp_path)["gpt_b4_cupy_path_numpy"]
    assert list(back["ptr"]) == list(tl["ptr"]) and set(back["fused_ops"]) == {"cupy_path"}
    assert (back["batch"] == 4).all()          # the settings of NUMPY_TRACES, on every row


def test_cupy_path_timeline_drops_the_numpy_formulas_temporaries_and_restores_the_ops():
    from tapegpt import fused, kernels
    cfg = dict(n_layer=1, n_head=2, n_embd=32, n_ffn=64, block_size=16, batch_size=2)
    ops = fused._on_host, kernels.kernel
    plain = recorder.record_numpy_timeline(batch=2, block_sizes=(16, 16), config=cfg)
    gpu = recorder.record_numpy_timeline(batch=2, block_sizes=(16, 16), config=cfg, cupy_path=True)
    assert (fused._on_host, kernels.kernel) == ops
    n_plain, n_gpu = (((t["event"] != "free") & (t["step"] == 1)).sum() for t in (plain, gpu))
    assert 0 < n_gpu < n_plain             # each fused op allocates its outputs only
    assert replay_allocator(gpu, "xpool")["unmatched_frees"] == 0


def test_scheme_study_rows_carry_costs_and_provenance():
    trace, _ = _record(n=800)
    df = memory_study.scheme_study({"random": trace}, repeats=1)
    assert list(df["allocator"]) == list(SCHEME_ALLOCATORS)
    assert {"gpu", "commit", "date", "trace_recorded_on"} <= set(df.columns)
    by = df.set_index("allocator")
    assert np.isnan(by.loc["cupy_pool_model", "ns_per_pair"]) and by.loc["xpool", "timed_pairs"] > 0
    assert (by["reserved_over_requested"] >= 1).all()
    from xlab import plots
    plots.memory_schemes(df)                   # draws from the CSV's columns alone


def test_committed_traces_meet_the_waste_targets():
    """As measured by replay: scheme segments places blocks as CuPy's pool does (best fit, split, merged) and, with
    its one rule, gives nothing back on a miss, as CuPy's pool: on every recorded trace it holds within 1.1% of CuPy's
    pool model (at most 5% over requested at batch 32 on the GPU's trace and the CuPy path's: 6.1% on NumPy's, as
    CuPy's model), and where steps repeat their shapes, the steps after the
    experiments' 5 warm-up steps make no device malloc and no device free.

    Per-parameter AdamW is the exception: its moments walk through memory (late misses on the CuPy-path trace, with
    any policy), and on the NumPy trace 1.042 against the CuPy model's 1.033. It is held to the batch-32 target,
    1.05."""
    traces = memory_study.load_traces()
    assert {"gpt_b32_gpu", "gpt_b4_numpy", "gpt_b32_numpy", "gpt_b4_cupy_path_numpy", "gpt_b32_cupy_path_numpy",
            "gpt_varlen_cupy_path_numpy"} <= set(traces)
    for name, tl in traces.items():
        ours, cupy = replay_allocator(tl, "xpool"), replay_allocator(tl, "cupy_pool_model")
        if "perparam" in name:
            assert ours["reserved_over_requested"] <= 1.05, name
        else:
            assert ours["reserved_over_requested"] <= 1.011 * cupy["reserved_over_requested"], name
        if tl["step"].max() >= memory_study.WARMUP_STEPS and "varlen" not in name and "perparam" not in name:
            assert (ours["device_mallocs_warm"], ours["device_frees_warm"]) == (0, 0), name
    for name in ("gpt_b32_gpu", "gpt_b32_cupy_path_numpy"):
        assert replay_allocator(traces[name], "xpool")["reserved_over_requested"] <= 1.05, name


def test_fused_gpt_at_batch_4_makes_no_device_call_once_warm():
    """The H200's churn at batch 4 (test_gpu_segments [4-True] at d2ee10ffdb25: a miss at the high-water mark gave
    back segments freed moments before, which the step then made again), replayed on the trace of the fused ops'
    CuPy path: a miss gives nothing back now, and the warm steps make no device call."""
    tl = memory_study.load_traces(names=["gpt_b4_cupy_path_numpy"])["gpt_b4_cupy_path_numpy"]
    steps = memory_study.replay_steps(tl, "xpool")
    warm = steps[steps.step >= memory_study.WARMUP_STEPS]
    assert len(warm) == 5 and (warm.device_mallocs.sum(), warm.device_frees.sum()) == (0, 0), steps
    r, cupy = replay_allocator(tl, "xpool"), replay_allocator(tl, "cupy_pool_model")
    assert r["reserved_over_requested"] < cupy["reserved_over_requested"]


def test_per_parameter_adamw_on_numpy_makes_no_device_malloc_once_warm():
    """On the NumPy trace, where the high-water rule alone made a device malloc at steps 5 and 8, giving nothing
    back on a miss converges at step 1 (it keeps every segment it makes)."""
    tl = memory_study.load_traces(names=["gpt_b32_perparam_numpy"])["gpt_b32_perparam_numpy"]
    r = replay_allocator(tl, "xpool")
    assert (r["device_mallocs_warm"], r["device_frees_warm"]) == (0, 0)


@pytest.mark.xfail(strict=True, reason="#14: per-parameter AdamW's moments, remade every step, walk through memory; "
                                       "even never giving back misses at step 6")
def test_per_parameter_adamw_makes_no_device_malloc_once_warm():
    """The CPU twin of the GPU test's xfail (test_gpu_segments, batch 32, per-parameter AdamW), on the CuPy-path
    trace: replayed, steps 6 and 9 each make a device malloc and give idle segments back (19, 13); with
    release_on_miss=0 step 6 still misses, the CuPy model's step 5. Strict: it fails loudly once a policy fixes it."""
    tl = memory_study.load_traces(names=["gpt_b32_perparam_cupy_path_numpy"])["gpt_b32_perparam_cupy_path_numpy"]
    r = replay_allocator(tl, "xpool")
    assert (r["device_mallocs_warm"], r["device_frees_warm"]) == (0, 0)


def test_trace_labels_are_short_and_say_where_the_trace_was_recorded():
    from xlab import plots
    assert plots.trace_label("gpt_b32_perparam_numpy") == "b32 perparam\n(NumPy)"
    assert plots.trace_label("gpt_b32_gpu") == "b32\n(GPU)" and plots.trace_label("random") == "random"
    assert plots.trace_label("gpt_varlen_cupy_path_numpy") == "varlen\n(CuPy path)"

