"""The GPT checks on CuPy, plus the allocator transparency gate (raw cudaMalloc vs CuPy's pool vs xpool)."""
import warnings

import numpy as np
import pytest

from tapegpt import AdamW, GPT, checks, get_batch, load_corpus
from xlab import correctness

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")


def _assert_all_passed(df):
    assert df.passed.all(), "\n" + df[~df.passed].to_string()


@pytest.fixture(autouse=True)
def _restore_allocator():
    previous = cupy.cuda.get_allocator()
    yield
    cupy.cuda.set_allocator(previous)


def test_gpu_grad_check_all_float64():
    _assert_all_passed(checks.grad_check_all(cupy))


def test_gpu_matmul_float32_vs_float64_reference():
    _assert_all_passed(checks.matmul_reference(cupy, dtype="float32", tol=1e-5))


def test_gpu_float32_vs_numpy_float64():
    # CuPy float32 against the NumPy float64 model on the same weights: logits 1e-4, gradients 1e-3 relative.
    _assert_all_passed(checks.fp32_vs_fp64(cupy))


def test_gpu_overfit():
    _assert_all_passed(checks.overfit(cupy, steps=150, threshold=0.1))


def test_gpu_checkpoint_round_trip_and_resume():
    _assert_all_passed(checks.checkpoint_roundtrip(cupy))


def test_gpu_batch_consistency():
    _assert_all_passed(checks.batch_consistency(cupy))


def test_gpu_closed_loop():
    df = checks.closed_loop(cupy)
    _assert_all_passed(df)
    assert df.min_top2_margin[0] > 1e-4


def test_gpu_get_batch():
    _assert_all_passed(checks.get_batch_checks(cupy))


def test_gpu_step_has_no_host_synchronisation():
    # Best effort: CuPy's sync detector raises on the synchronising calls it knows (.get(), float(), ...).
    import cupyx
    cfg = checks.small_config()
    model = GPT(cfg, xp=cupy, seed=0)
    opt = AdamW(model.params)
    x, y = get_batch(load_corpus(), cfg.batch_size, cfg.block_size, 0, xp=cupy)
    model.loss_and_grads(x, y)  # first call compiles kernels outside the guarded region
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with cupyx.allow_synchronize(False):
            loss, grads = model.loss_and_grads(x, y)
            opt.step(grads)
            model.generate(x[:, :4], 3)
    assert np.isfinite(float(loss))


def test_gpu_training_is_run_to_run_deterministic():
    cfg = correctness.transparency_config()
    df = correctness.transparency_gate(steps=10, cfg=cfg, allocators=("cupy_pool", "cupy_pool"))
    assert df.identical_to_cupy_pool.all(), df


def test_transparency_gate_raw_cupy_xpool():
    # 50 steps, n_layer=2, n_embd=64, batch 8, block 64: losses at every step and final params bit-identical.
    before = cupy.cuda.get_allocator()
    df = correctness.transparency_gate(steps=50)
    assert list(df.allocator) == list(correctness.GATE_ALLOCATORS)
    assert np.isfinite(df.final_loss).all() and (df.debug_error == "").all()
    assert df.identical_to_raw.all(), "\n" + df.to_string()
    assert cupy.cuda.get_allocator() == before  # restored, not left on the last allocator tried


def test_bench_runs_on_gpu_with_small_step_count():
    from tapegpt import bench
    rows = bench.bench_gpu(correctness.transparency_config(), steps=2, warmup=1)
    assert len(rows) == 1 and rows[0]["tokens_per_s"] > 0 and np.isfinite(rows[0]["final_loss"])


def test_gpu_foreach_adamw_is_bit_identical_to_per_parameter():
    cfg = correctness.transparency_config()
    data = load_corpus()
    result = {}
    for foreach in (False, True):
        model = GPT(cfg, xp=cupy, seed=0)
        opt = AdamW(model.params, lr=1e-3, foreach=foreach)
        losses = checks.train(model, opt, data, 5)
        result[foreach] = (cupy.stack(losses).get().tobytes(), checks.params_sha256(model.params))
    assert result[True] == result[False]


# --- fused kernels (tapegpt.fused): each CuPy kernel against its NumPy formulas, then the model


@pytest.mark.parametrize("large", [False, True], ids=["odd-shapes", "reference-rows"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gpu_fused_kernels_match_numpy(dtype, large):
    # Forward and backward of every kernel; T = 37 and 300 (not multiples of 32), C = 10/384, vocab rows of 300.
    _assert_all_passed(checks.fused_kernel_parity(cupy, dtype, large=large))


@pytest.mark.parametrize("dtype,loss_tol,grad_tol", [("float64", 1e-12, 1e-10), ("float32", 1e-5, 1e-3)])
def test_gpu_fused_model_matches_unfused_and_numpy(dtype, loss_tol, grad_tol):
    # float32 gradients: 1e-3 relative, as fp32_vs_fp64 allows; a wrong kernel is off by order 1.
    cfg = checks.small_config(dtype=dtype)
    x, y = get_batch(load_corpus(), cfg.batch_size, cfg.block_size, 0)
    results = {}
    for name, xp, fused in (("numpy", np, True), ("unfused", cupy, False), ("fused", cupy, True)):
        model = GPT(cfg, xp=xp, seed=0, fused=fused)
        results[name] = model.loss_and_grads(xp.asarray(x), xp.asarray(y))
    ref_loss, ref_grads = results["numpy"]
    for name in ("unfused", "fused"):
        loss, grads = results[name]
        assert checks._rel_err(loss, ref_loss) <= loss_tol, name
        worst = max(checks._rel_err(grads[k], ref_grads[k]) for k in ref_grads)
        assert worst <= grad_tol, (name, worst)


def test_gpu_fused_training_is_bitwise_identical_across_allocators():
    # The fused kernels use no atomics: raw cudaMalloc, CuPy's pool and xpool give the same bits.
    cfg = correctness.transparency_config()
    df = correctness.transparency_gate(steps=5, cfg=cfg, allocators=("raw", "cupy_pool", "xpool_k1"))
    assert df.identical_to_raw.all(), df


def test_gpu_fused_is_the_default_and_unfused_still_trains():
    from tapegpt import fused
    cfg = checks.small_config()
    assert GPT(cfg, xp=cupy).fused == fused.enabled
    model = GPT(cfg, xp=cupy, seed=0, fused=False)
    losses = checks.train(model, AdamW(model.params, lr=1e-3), load_corpus(), 3)
    assert np.isfinite(float(losses[-1]))


def test_gpu_loss_curve_drift_fused_vs_unfused():
    df = checks.loss_curve_drift(cupy, correctness.transparency_config(), steps=10, lr=1e-3)
    assert (df.rel_diff < 1e-4).all(), df


def test_gpu_step_profile_reports_host_and_gpu_time():
    from tapegpt import bench
    r = bench.step_profile(cupy, correctness.transparency_config(), steps=3, warmup=1)
    assert r["host_ms"] > 0 and r["gpu_ms"] > 0 and r["ms_per_step"] > 0 and r["bound"] in ("host", "gpu")
    assert r["fused"] and r["launches"] > 0 and np.isfinite(r["final_loss"])


@pytest.mark.parametrize("large", [False, True], ids=["777", "2M"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gpu_adamw_kernel_is_bit_identical_to_numpy(dtype, large):
    # No FMA contraction, IEEE division and sqrt: the kernel's update has NumPy's bits, element for element.
    _assert_all_passed(checks.adamw_bitwise(cupy, dtype, large=large))


@pytest.mark.parametrize("rows,cols", [(8192, 384), (8192, 1152), (8192, 1536), (1024, 384), (4100, 37), (1, 37)])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gpu_column_kernels_match_numpy_and_repeat_bitwise(dtype, rows, cols):
    # The model's shapes (batch 32 and 4 at T = 256) and odd ones; a second launch gives the same bits.
    from tapegpt import fused
    rng = np.random.default_rng(rows + cols)
    g, x, a = (rng.standard_normal((rows, cols)).astype(dtype) for _ in range(3))
    w, b = (rng.standard_normal(cols).astype(dtype) for _ in range(2))
    _, mean, rstd = fused.layer_norm_fwd(x, w, b, 1e-5)
    inputs = (g, x, w, mean, rstd, a, b)

    def run(v):
        return (fused.colsum(v[0]),) + fused.layer_norm_bwd_sum(*v[:6])[1:] + fused.bias_gelu_bwd(v[0], v[5], v[6])

    ref = run([v.astype(np.float64) for v in inputs])    # NumPy in float64: the float32 sums' own error only
    d = [cupy.asarray(v) for v in inputs]
    first, second = run(d), run(d)
    tol = {"float32": 1e-4, "float64": 1e-12}[dtype]
    for name, o, o2, r in zip(("colsum", "ln dw", "ln db", "ln dx sums", "gelu du", "gelu db"), first, second, ref):
        assert checks._rel_err(o, r) <= tol, name
        assert o.get().tobytes() == o2.get().tobytes(), name
