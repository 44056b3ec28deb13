"""Fused ops on the CPU: the fused model equals the unfused one, the CUDA kernels (run by an emulator) equal the
NumPy formulas, the switch works, and a step dispatches fewer ops. (Finite differences: test_gpt_ops; torch:
test_gpt_torch; the kernels on a real GPU: test_gpt_gpu.)"""
import contextlib
import dataclasses
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cuda_emu
from tapegpt import GPT, AdamW, bench, checks, fused, get_batch, kernels, load_corpus, profile, tape
from tapegpt.tape import Tensor


@contextlib.contextmanager
def emulated_kernels(kernel=cuda_emu.kernel):
    """Run the fused ops' CuPy path on NumPy arrays, each kernel launch executed by the CPU emulator."""
    on_host, real = fused._on_host, kernels.kernel
    fused._on_host, kernels.kernel = (lambda a: False), kernel
    try:
        yield
    finally:
        fused._on_host, kernels.kernel = on_host, real


def _mutate(monkeypatch, old, new):
    """The kernels' source with `old` replaced by `new` (which must occur), freshly built for the emulator."""
    bad = kernels.SOURCE.replace(old, new)
    assert bad != kernels.SOURCE
    monkeypatch.setattr(kernels, "SOURCE", bad)
    monkeypatch.setattr(cuda_emu, "_libs", {})
    monkeypatch.setattr(cuda_emu, "_kernels", {})


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
    _mutate(monkeypatch, "const i64 last = row % Tq + (Tk - Tq);  // the last visible key",
            "const i64 last = row % Tq + (Tk - Tq) + 1;")
    df = checks.fused_kernel_parity(np, "float64", on_device=emulated_kernels)
    failed = set(df.check[~df.passed])
    assert "fused causal_softmax float64 vs NumPy" in failed


def test_emulator_rejects_divergent_shuffles(monkeypatch):
    # A warp whose lanes shuffle different numbers of times is undefined on a GPU; the emulator must say so.
    _mutate(monkeypatch, "    ROW_PROLOGUE\n    const T* xr = x + row * C;",
            "    ROW_PROLOGUE\n    if (lane == 3) return;\n    const T* xr = x + row * C;")
    x = np.ones((3, 40))
    with emulated_kernels(), pytest.raises(RuntimeError, match="ln_fwd"):
        fused.layer_norm_fwd(x, np.ones(40), np.zeros(40), 1e-5)


def test_emulator_rejects_out_of_bounds_access(monkeypatch):
    # Every pointer is checked: a kernel that writes one element past its output must fail, not pass silently.
    _mutate(monkeypatch, "ELEM_LOOP { y[i] = x[i] + (a[i] + b[i % C]); }",
            "ELEM_LOOP { y[i + 1] = x[i] + (a[i] + b[i % C]); }")
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


def test_fused_step_launch_count_does_not_grow_back():
    # 561 launches before one-pass column sums, the 2-launch layer-norm backward, the bias gradient inside the
    # GELU backward, the layer norm inside the residual add (and the residual's bias gradient inside the norm's
    # backward) and the one-kernel AdamW; a change that adds launches back must say so here.
    counts = profile.reference_counts(fused_model=True, foreach=True)
    ops = counts["by_op"]
    assert counts["launches"] <= 413, ops
    assert ops["fused.residual_layer_norm_fwd"] == 24 and ops["fused.layer_norm_fwd"] == 1   # all but ln_1 of h.0
    assert "fused.bias_residual" not in ops
    assert ops["fused.colsum"] == 12 + 1              # the attention's input bias, and wpe
    assert ops["fused.layer_norm_bwd_sum"] == 2 * 24 and ops["fused.layer_norm_bwd"] == 2
    assert ops["fused.bias_gelu_bwd"] == 12
    assert ops["fused.adamw"] == 1 and ops["concatenate"] == 1
    assert not any(k in ops for k in ("multiply", "sqrt", "subtract", "setitem"))    # AdamW's array ops are gone


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


@settings(max_examples=8, deadline=None)
@given(rows=st.integers(1, 700), cols=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_emulated_column_kernels_any_shape(rows, cols, seed):
    # Column kernels: row counts that leave row groups idle or uneven, and column counts that leave a block partial.
    rng = np.random.default_rng(seed)
    x, w, g, a, b = (rng.standard_normal(s) for s in ((rows, cols), cols, (rows, cols), (rows, cols), cols))
    _, mean, rstd = fused.layer_norm_fwd(x, w, b, 1e-5)
    ref = (fused.colsum(g),) + fused.layer_norm_bwd_sum(g, x, w, mean, rstd, a)[1:] + fused.bias_gelu_bwd(g, a, b)
    with emulated_kernels():
        out = (fused.colsum(g),) + fused.layer_norm_bwd_sum(g, x, w, mean, rstd, a)[1:] + \
            fused.bias_gelu_bwd(g, a, b)
    for o, r in zip(out, ref):
        np.testing.assert_allclose(o, r, rtol=1e-12, atol=1e-12)


def test_column_grid_covers_every_column_with_whole_warps():
    for n_rows in (0, 1, 16, 17, 100, 1024, 8192, 10**6):
        for c in (1, 7, 8, 384, 1536, 98304):
            (grid,), (cx, ry) = kernels.col_grid(n_rows, c)
            assert grid * cx >= c > (grid - 1) * cx
            assert ry & (ry - 1) == 0 and ry <= kernels.COL_MAX_RY and cx >= 8 and (cx * ry) % 32 == 0
            assert cx * ry <= 1024 and (ry == kernels.COL_MAX_RY or ry * kernels.COL_ROWS >= n_rows)
    assert kernels.col_grid(8192, 1536) == ((192,), (8, 128)) and kernels.col_grid(4, 98304) == ((384,), (256, 1))


def test_emulated_parity_catches_a_broken_column_tree(monkeypatch):
    # A tree that starts at a quarter of the row groups drops half of the partial sums.
    _mutate(monkeypatch, "for (int h = blockDim.y >> 1; h > 0; h >>= 1)",
            "for (int h = blockDim.y >> 2; h > 0; h >>= 1)")
    df = checks.fused_kernel_parity(np, "float64", on_device=emulated_kernels)
    failed = set(df.check[~df.passed])
    assert "fused colsum, 300 rows float64 vs NumPy" in failed and "fused layer_norm_bwd float64 vs NumPy" in failed


def test_emulator_rejects_divergent_syncthreads(monkeypatch):
    # __syncthreads reached by only some threads of a block is undefined on a GPU; the emulator must say so.
    _mutate(monkeypatch, "        if (y < h) sh[y * X + x] += sh[(y + h) * X + x];\n        __syncthreads();",
            "        if (y < h) { sh[y * X + x] += sh[(y + h) * X + x]; __syncthreads(); }")
    with emulated_kernels(), pytest.raises(RuntimeError, match="colsum: the threads of a block passed __syncthreads"):
        fused.colsum(np.ones((100, 3)))


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_emulated_adamw_kernel_is_bit_identical_to_numpy(dtype):
    _assert_all_passed(checks.adamw_bitwise(np, dtype, on_device=emulated_kernels))


def test_adamw_bitwise_check_catches_a_reordered_update(monkeypatch):
    # Dividing by bc2 as a multiplication by its reciprocal is the same math, other bits: the check must see it.
    _mutate(monkeypatch, "rn_div(rn_sqrt(vi), bc2)", "rn_mul(rn_sqrt(vi), (T)1 / bc2)")
    df = checks.adamw_bitwise(np, "float32", on_device=emulated_kernels)
    assert not df.passed.any() and df.measured[0] > 0


def _train_adamw(foreach, on_device, steps=3):
    cfg = checks.small_config()
    model = GPT(cfg, seed=0)
    opt = AdamW(model.params, lr=1e-2, foreach=foreach, fused=True)
    data, losses = load_corpus(), []
    for i in range(steps):
        loss, grads = model.loss_and_grads(*get_batch(data, cfg.batch_size, cfg.block_size, i))
        with on_device():
            opt.step(grads)
        losses.append(float(loss))
    return losses, checks.params_sha256(model.params), opt


def test_foreach_adamw_on_the_emulated_kernel_trains_like_per_parameter():
    # The optimizer's call of the kernel (argument order, the decayed slice, the step's bias corrections).
    l1, h1, _ = _train_adamw(False, contextlib.nullcontext)
    l2, h2, opt = _train_adamw(True, emulated_kernels)
    assert l1 == l2 and h1 == h2
    state = opt.state_dict()
    before = {k: a.copy() for k, a in state["m"].items()}
    with emulated_kernels():    # the kernel updates the moments in place: a state taken earlier must not change
        opt.step({k: np.ones_like(p) for k, p in opt.params.items()})
    assert all(np.array_equal(state["m"][k], before[k]) for k in before)


def test_kernel_lookup_compiles_once_per_device_and_dtype(monkeypatch):
    # The launch path's cache: a built kernel is a dict hit, but never another device's or dtype's kernel.
    compiled, device = [], [0]

    class FakeModule:
        def __init__(self, code):
            compiled.append(code.splitlines()[0])

        def get_function(self, name):
            return (name, len(compiled))

    runtime = types.SimpleNamespace(getDevice=lambda: device[0])
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(RawModule=FakeModule,
                                                                   cuda=types.SimpleNamespace(runtime=runtime)))
    monkeypatch.setattr(kernels, "_modules", {})
    monkeypatch.setattr(kernels, "_functions", {})
    monkeypatch.setattr(kernels, "_get_device", None)
    f32 = np.dtype(np.float32)
    first = kernels.kernel("colsum", f32)
    assert kernels.kernel("colsum", f32) is first and kernels.kernel("ln_param", f32).function == ("ln_param", 1)
    assert compiled == ["typedef float T;"] and first.codes == "PPqq"     # launched by tapegpt.launch
    assert kernels.kernel("colsum", np.float64).function == ("colsum", 2) and compiled[1] == "typedef double T;"
    device[0] = 1
    assert kernels.kernel("colsum", f32).function == ("colsum", 3) and len(compiled) == 3
    device[0] = 0
    assert kernels.kernel("colsum", f32) is first and len(compiled) == 3


@pytest.mark.parametrize("norm_last", [True, False])
def test_residual_bias_gradient_with_and_without_the_norms_handoff(monkeypatch, norm_last):
    # The layer norm's backward hands the residual add its gradient's column sums (b's gradient) only when it
    # wrote that whole gradient. Another reader of the add's result whose backward runs after the norm's adds
    # to the gradient, and the add must then sum it itself: both orders give the separate ops' gradients.
    def leaves():
        return [Tensor(np.random.default_rng(i).standard_normal(s), True)
                for i, s in enumerate([(5, 4), (5, 3), (3, 4), (4,), (4,), (4,)])]

    c = Tensor(np.random.default_rng(9).standard_normal((5, 4)))

    def loss_of(out, hn):
        u, v = tape.mul(hn, c), tape.mul(out, c)
        return tape.add(u, v) if norm_last else tape.add(v, u)

    ref = leaves()
    out = fused.linear_residual(*ref[:4])
    loss_of(out, fused.layer_norm(out, ref[4], ref[5])).backward(np.ones((5, 4)))
    got = leaves()
    calls = []
    real = fused.colsum
    monkeypatch.setattr(fused, "colsum", lambda a: calls.append(a.shape) or real(a))
    loss_of(*fused.linear_residual(*got[:4], (got[4], got[5], 1e-5))).backward(np.ones((5, 4)))
    for r, t in zip(ref, got):
        np.testing.assert_allclose(t.grad, r.grad, rtol=1e-12, atol=1e-12)
    assert calls == ([] if norm_last else [(5, 4)])     # the handoff, or the add's own column sum
