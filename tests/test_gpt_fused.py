"""Fused ops on the CPU: the fused model equals the unfused one, the CUDA kernels (run by an emulator) equal the
NumPy formulas, the switch works, and a step dispatches fewer ops. (Finite differences: test_gpt_ops; torch:
test_gpt_torch; the kernels on a real GPU: test_gpt_gpu.)"""
import contextlib
import dataclasses
import shutil
import subprocess

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cuda_emu
from tapegpt import GPT, bench, checks, fused, get_batch, kernels, load_corpus, profile


@contextlib.contextmanager
def emulated_kernels(kernel=cuda_emu.kernel):
    """Run the fused ops' CuPy path on NumPy arrays, each kernel launch executed by the CPU emulator."""
    on_host, real = fused._on_host, kernels.kernel
    fused._on_host, kernels.kernel = (lambda a: False), kernel
    try:
        yield
    finally:
        fused._on_host, kernels.kernel = on_host, real


def _assert_all_passed(df):
    assert df.passed.all(), "\n" + df[~df.passed].to_string()


def _loss_and_grads(dtype, fused_model, batch=None):
    cfg = checks.small_config(dtype=dtype)
    x, y = get_batch(load_corpus(), batch or cfg.batch_size, cfg.block_size, 0)
    return GPT(cfg, seed=0, fused=fused_model).loss_and_grads(x, y)


@pytest.mark.parametrize("dtype,tol", [("float64", 1e-13), ("float32", 1e-5)])
def test_fused_model_equals_unfused(dtype, tol):
    l0, g0 = _loss_and_grads(dtype, False)
    l1, g1 = _loss_and_grads(dtype, True)
    assert checks._rel_err(l1, l0) <= tol
    assert list(g1) == list(g0)
    for k in g0:
        assert g1[k].shape == g0[k].shape and g1[k].dtype == g0[k].dtype
        assert checks._rel_err(g1[k], g0[k]) <= tol, k


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_emulated_kernels_match_numpy(dtype):
    _assert_all_passed(checks.fused_kernel_parity(np, dtype, on_device=emulated_kernels))


@pytest.mark.parametrize("dtype,tol", [("float64", 1e-13), ("float32", 1e-5)])
def test_model_on_emulated_kernels_matches_numpy(dtype, tol):
    # The whole fused step through the CuPy code path (kernel launches, contiguity, shapes), on NumPy arrays.
    l0, g0 = _loss_and_grads(dtype, True, batch=2)
    with emulated_kernels():
        l1, g1 = _loss_and_grads(dtype, True, batch=2)
    assert checks._rel_err(l1, l0) <= tol
    assert max(checks._rel_err(g1[k], g0[k]) for k in g0) <= tol


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_kernels_compile_with_nvcc(tmp_path, dtype):
    # The GPU compiles them with NVRTC at first use; nvcc (same front end) catches a syntax error here first.
    src = tmp_path / "k.cu"
    src.write_text(kernels.source(dtype))
    r = subprocess.run(["nvcc", "-ptx", "-arch=compute_90", "-Werror", "all-warnings", str(src),
                        "-o", str(tmp_path / "k.ptx")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    ptx = (tmp_path / "k.ptx").read_text()
    assert all(f".entry {name}(" in ptx for name in kernels.KERNEL_NAMES)


def test_emulated_parity_catches_a_broken_kernel(monkeypatch):
    # The check must be able to fail: a softmax that lets each query see one key too many.
    bad = kernels.SOURCE.replace("const i64 last = row % Tq + (Tk - Tq);  // the last visible key",
                                 "const i64 last = row % Tq + (Tk - Tq) + 1;")
    assert bad != kernels.SOURCE
    monkeypatch.setattr(kernels, "SOURCE", bad)
    monkeypatch.setattr(cuda_emu, "_libs", {})
    monkeypatch.setattr(cuda_emu, "_kernels", {})
    df = checks.fused_kernel_parity(np, "float64", on_device=emulated_kernels)
    failed = set(df.check[~df.passed])
    assert "fused causal_softmax float64 vs NumPy" in failed


def test_emulator_rejects_divergent_shuffles(monkeypatch):
    # A warp whose lanes shuffle different numbers of times is undefined on a GPU; the emulator must say so.
    bad = kernels.SOURCE.replace("    ROW_PROLOGUE\n    const T* xr = x + row * C;",
                                 "    ROW_PROLOGUE\n    if (lane == 3) return;\n    const T* xr = x + row * C;")
    assert bad != kernels.SOURCE
    monkeypatch.setattr(kernels, "SOURCE", bad)
    monkeypatch.setattr(cuda_emu, "_libs", {})
    monkeypatch.setattr(cuda_emu, "_kernels", {})
    x = np.ones((3, 40))
    with emulated_kernels(), pytest.raises(RuntimeError, match="ln_fwd"):
        fused.layer_norm_fwd(x, np.ones(40), np.zeros(40), 1e-5)


def test_emulator_rejects_out_of_bounds_access(monkeypatch):
    # Every pointer is checked: a kernel that writes one element past its output must fail, not pass silently.
    bad = kernels.SOURCE.replace("ELEM_LOOP { y[i] = x[i] + (a[i] + b[i % C]); }",
                                 "ELEM_LOOP { y[i + 1] = x[i] + (a[i] + b[i % C]); }")
    assert bad != kernels.SOURCE
    monkeypatch.setattr(kernels, "SOURCE", bad)
    monkeypatch.setattr(cuda_emu, "_libs", {})
    monkeypatch.setattr(cuda_emu, "_kernels", {})
    x = np.ones((3, 5))
    with emulated_kernels(), pytest.raises(IndexError, match=r"bias_residual: y\[15\] outside 0..15"):
        fused.bias_residual(x, x, np.ones(5))


def test_emulator_rejects_arguments_of_the_wrong_width():
    # CuPy passes a NumPy scalar with its own width, so an int32 where the kernel takes long long is a bug.
    k = cuda_emu.kernel("bias_residual", np.float64)
    x = np.ones(4)
    k((1,), (32,), (x, x, x, x, np.int64(4), np.int64(4)))
    with pytest.raises(AssertionError):
        k((1,), (32,), (x, x, x, x, np.int32(4), np.int64(4)))
    with pytest.raises(AssertionError):
        k((1,), (32,), (x, x, x.astype(np.float32), x, np.int64(4), np.int64(4)))


def test_switch_selects_the_form(monkeypatch):
    cfg = checks.small_config()
    assert GPT(cfg, fused=True).fused and not GPT(cfg, fused=False).fused
    monkeypatch.setattr(fused, "enabled", False)
    assert not GPT(cfg).fused
    monkeypatch.setattr(fused, "enabled", True)
    assert GPT(cfg).fused


@pytest.mark.parametrize("value,expected", [("0", False), ("1", True)])
def test_environment_switch(monkeypatch, value, expected):
    monkeypatch.setenv(fused.FUSED_ENV, value)
    assert fused._enabled_from_env() is expected


def test_environment_switch_rejects_other_values(monkeypatch):
    monkeypatch.setenv(fused.FUSED_ENV, "yes")
    with pytest.raises(ValueError, match="TAPEGPT_FUSED"):
        fused._enabled_from_env()


def test_unfused_model_makes_no_fused_op():
    counts = profile.reference_counts(dataclasses.replace(checks.small_config(), n_layer=1), fused_model=False)
    assert not any(k.startswith("fused.") for k in counts["by_op"])


def test_fused_step_dispatches_far_fewer_ops():
    # The reference depth (12 layers, 12 heads): counts do not depend on the widths or the batch.
    unfused = profile.reference_counts(fused_model=False, foreach=True)
    fused_ = profile.reference_counts(fused_model=True, foreach=True)
    per_param = profile.reference_counts(fused_model=True, foreach=False)
    assert fused_["tape_nodes"] <= 6 * 12 + 4 < unfused["tape_nodes"]
    assert fused_["launches"] * 2.5 < unfused["launches"]
    assert fused_["launches"] < per_param["launches"]
    assert fused_["fused"] and not unfused["fused"] and per_param["adamw"] == "per_param"


def test_op_counts_see_every_kind_of_op():
    # The counter must not be blind: a tiny program with one of each counted op.
    rec = profile._Recorder()
    profile._rec = rec
    try:
        a = np.ones((2, 3)).view(profile.Counted)
        b = (a + 1).sum(axis=0)                      # add, add.reduce
        c = a.T.reshape(6)                           # a copying reshape
        np.take(a, [0], axis=0)                      # an array function
        d = a.astype(np.float32)                     # astype
        d[0] = 2                                     # setitem
        a.reshape(3, 2)                              # a view: free
        a.T @ a                                      # 2-D: CuPy passes a transpose to cuBLAS as is
        m = np.ones((2, 3, 3)).view(profile.Counted)
        m @ m.swapaxes(-1, -2)                       # batched: CuPy copies the transposed operand
    finally:
        profile._rec = None
    assert rec.ops == {"add": 1, "add.reduce": 1, "reshape (copy)": 1, "take": 1, "astype": 1, "setitem": 1,
                       "matmul": 2, "matmul operand copy": 1}
    assert b.shape == (3,) and c.shape == (6,)


def test_loss_curve_drift_is_rounding_only():
    df = checks.loss_curve_drift(np, checks.small_config(), steps=3, lr=1e-3)
    assert list(df.step) == [0, 1, 2]
    assert (df.rel_diff < 1e-5).all() and (df.rel_diff >= 0).all()
    _assert_all_passed(checks.fused_vs_unfused(np, steps=3))


def test_step_profile_on_numpy():
    r = bench.step_profile(np, checks.small_config(), steps=2, warmup=1, fused=True)
    assert r["host_ms"] > 0 and np.isnan(r["gpu_ms"]) and r["bound"] == "host" and r["ms_per_step"] > 0
    assert r["fused"] and r["adamw"] == "foreach" and r["launches"] > 0 and r["tape_nodes"] == 6 * 2 + 4  # embed, 6 per layer, ln_f, lm_head, loss


def test_bench_profile_command_prints_both_forms(capsys):
    rows = bench.main(["--cpu", "--profile", "--steps", "1", "--warmup", "1"])
    assert [r["fused"] for r in rows] == [False, True]
    assert "launches" in capsys.readouterr().out


def test_bench_drift_command(tmp_path, capsys):
    df = bench.main(["--cpu", "--drift", "2", "--out", str(tmp_path / "drift.csv")])
    assert len(df) == 2 and (tmp_path / "drift.csv").exists()
    assert "max relative loss difference" in capsys.readouterr().out


@settings(max_examples=12, deadline=None)
@given(rows=st.integers(1, 20), cols=st.integers(1, 70), seed=st.integers(0, 2**16))
def test_emulated_row_kernels_any_row_length(rows, cols, seed):
    # Rows shorter than a warp, and lengths that are not multiples of 32, leave some lanes idle in some passes.
    rng = np.random.default_rng(seed)
    x, w, b, g = rng.standard_normal((rows, cols)), rng.standard_normal(cols), rng.standard_normal(cols), \
        rng.standard_normal((rows, cols))
    ref = fused.layer_norm_fwd(x, w, b, 1e-5)
    ref_bwd = fused.layer_norm_bwd(g, x, w, ref[1], ref[2], None)
    s = rng.standard_normal((2, rows, cols + rows))      # at least as many keys as queries
    ref_p = fused.causal_softmax(s.copy(), 0.3)
    with emulated_kernels():
        out = fused.layer_norm_fwd(x, w, b, 1e-5)
        out_bwd = fused.layer_norm_bwd(g, x, w, ref[1], ref[2], None)
        out_p = fused.causal_softmax(s.copy(), 0.3)
        out_sum = fused.colsum(g)
    for o, r in zip(out + out_bwd + (out_p, out_sum), ref + ref_bwd + (ref_p, g.sum(axis=0))):
        np.testing.assert_allclose(o, r, rtol=1e-12, atol=1e-12)
