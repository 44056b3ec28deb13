"""Tape ops: float64 finite differences for every op, matmul accuracy, tape bookkeeping."""
import numpy as np
import pytest

from tapegpt import checks, tape
from tapegpt.tape import Tensor

CASES = checks._op_cases(np)
FD_TOL = 1e-6  # central differences in float64 with eps=1e-6: measured errors are ~1e-10 to 1e-9


@pytest.mark.parametrize("name,build,inputs", CASES, ids=[c[0] for c in CASES])
def test_op_gradient_matches_finite_differences(name, build, inputs):
    err = checks._fd_max_rel_err(np, build, [np.asarray(a, dtype=np.float64) for a in inputs])
    assert err < FD_TOL, f"{name}: max relative error {err:.3g}"


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_model_loss_gradient_matches_finite_differences(fused):
    # 3 random entries of every parameter of the float64 small model.
    err = checks.model_grad_check(np, fused=fused)
    assert err < FD_TOL, err


def test_grad_check_all_frame_shape_and_pass():
    df = checks.grad_check_all(np)
    assert list(df.columns[:4]) == ["check", "max_rel_err", "tol", "passed"]
    assert len(df) == len(CASES) + 2  # and the model, unfused and fused
    assert df.passed.all(), df[~df.passed]


def test_finite_difference_check_catches_a_wrong_backward():
    # The checker itself must be able to fail: an op whose backward drops the factor 2 of d(x^2)/dx.
    def bad_square(x):
        out = x.data * x.data
        return tape._make(out, (x,), lambda g: tape._accumulate(x, g * x.data))

    err = checks._fd_max_rel_err(np, bad_square, [np.random.default_rng(0).standard_normal((3, 4))])
    assert err > 0.4


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("float64", 1e-13)])
def test_matmul_matches_float64_reference(dtype, tol):
    df = checks.matmul_reference(np, dtype=dtype, tol=tol)
    assert df.passed.all(), df


def test_batched_matmul_equals_per_matrix_products():
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((3, 2, 5, 4)), rng.standard_normal((3, 2, 4, 6))
    out = tape.matmul(Tensor(a), Tensor(b)).data
    ref = np.stack([np.stack([a[i, j] @ b[i, j] for j in range(2)]) for i in range(3)])
    np.testing.assert_allclose(out, ref, rtol=1e-13, atol=1e-13)


def test_unbroadcast_restores_input_shapes():
    g = np.ones((2, 3, 4))
    assert tape._unbroadcast(g, (4,)).shape == (4,)
    assert tape._unbroadcast(g, (3, 1)).shape == (3, 1)
    assert tape._unbroadcast(g, (2, 1, 4)).shape == (2, 1, 4)
    np.testing.assert_array_equal(tape._unbroadcast(g, (3, 1)), np.full((3, 1), 8.0))


def test_no_tape_is_recorded_without_requires_grad():
    out = tape.gelu(tape.add(Tensor(np.ones(3)), Tensor(np.ones(3))))
    assert not out.requires_grad and out._parents == () and out._backward is None


def test_backward_frees_interior_nodes_and_keeps_leaf_grads():
    x, w = Tensor(np.ones((2, 3)), True), Tensor(np.ones((3, 2)), True)
    h = tape.matmul(x, w)
    y = tape.gelu(h)
    loss = tape.cross_entropy(y, np.array([0, 1]))
    loss.backward()
    assert x.grad is not None and w.grad is not None
    for node in (h, y, loss):
        assert node.grad is None and node._backward is None and node._parents == ()


def test_embedding_gradient_sums_repeated_rows_exactly():
    rng = np.random.default_rng(0)
    w = Tensor(rng.standard_normal((7, 3)), True)
    idx = np.array([[1, 1, 4], [6, 1, 0]])
    g = rng.standard_normal((2, 3, 3))
    tape.embedding(w, idx).backward(g)
    ref = np.zeros((7, 3))
    np.add.at(ref, idx.reshape(-1), g.reshape(-1, 3))  # fine as a host reference; never used by the tape
    np.testing.assert_allclose(w.grad, ref, rtol=1e-14, atol=1e-14)


def test_attention_is_causal():
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 6, 4)) for _ in range(3))
    out = tape.causal_attention(Tensor(q), Tensor(k), Tensor(v)).data
    k2, v2 = k.copy(), v.copy()
    k2[..., 3:, :] += 5.0
    v2[..., 3:, :] -= 5.0
    out2 = tape.causal_attention(Tensor(q), Tensor(k2), Tensor(v2)).data
    np.testing.assert_array_equal(out[..., :3, :], out2[..., :3, :])  # the past never sees the future
    assert not np.allclose(out[..., 3:, :], out2[..., 3:, :])


def test_cross_entropy_value_and_zero_d_array():
    rng = np.random.default_rng(0)
    z = rng.standard_normal((2, 3, 5)).astype(np.float32)
    t = rng.integers(0, 5, (2, 3))
    loss = tape.cross_entropy(Tensor(z), t).data
    assert isinstance(loss, np.ndarray) and loss.shape == () and loss.dtype == np.float32
    zz = z.reshape(-1, 5).astype(np.float64)
    ref = np.mean(np.log(np.exp(zz).sum(-1)) - zz[np.arange(6), t.reshape(-1)])
    assert abs(float(loss) - ref) < 1e-6


def test_ops_keep_float32():
    x = Tensor(np.ones((2, 4, 8), np.float32), True)
    w, b = Tensor(np.ones(8, np.float32), True), Tensor(np.zeros(8, np.float32), True)
    y = tape.gelu(tape.layer_norm(x, w, b))
    q = tape.reshape(y, (2, 1, 4, 8))
    a = tape.causal_attention(q, q, q)
    assert y.dtype == np.float32 and a.dtype == np.float32
    tape.cross_entropy(tape.reshape(a, (2, 4, 8)), np.zeros((2, 4), np.int64)).backward()
    assert x.grad.dtype == np.float32 and w.grad.dtype == np.float32
