"""Fused ops: each one tape node with a hand-written backward, replacing a chain of the ops in tape.py.

Every array-level op below has two implementations of the same formulas, chosen by the array module: NumPy
(plain array code, so the CPU tests and the NumPy path exercise the math) and CuPy (one kernel from
tapegpt.kernels, or two). On CuPy a training step is then about 33 launches per layer (18 of them GEMMs)
instead of ~130 (tapegpt.profile counts them), and launches are what bound the host's dispatch time (issue 13).
The foreach AdamW's update is one of these ops too (adamw).

`enabled` is the model's default (environment: TAPEGPT_FUSED=0 selects the unfused ops of tape.py, e.g. when
a kernel misbehaves on a new GPU); GPT(fused=...) overrides it per model and records the choice.
"""
import functools
import math

import numpy as np

from . import kernels
from .blas import mm
from .switches import env_choice
from .tape import _accumulate, _make, _swap, array_module

FUSED_ENV = "TAPEGPT_FUSED"


def _enabled_from_env():
    return env_choice(FUSED_ENV, {"0": "unfused ops", "1": "fused kernels"}, "1") == "1"


enabled = _enabled_from_env()

# Set by tapegpt.profile while it counts a step's ops on NumPy: it is told the CuPy launch count of each fused
# op and ignores the NumPy ops that implement it. None otherwise (the hot path only tests it).
_recorder = None


def _launches(n):
    """Mark an array-level fused op as `n` CuPy kernel launches, for the op-count profile."""
    def wrap(fn):
        @functools.wraps(fn)
        def op(*args):
            if _recorder is None:
                return fn(*args)
            return _recorder.fused_op(fn.__name__, n, fn, args)
        return op
    return wrap


def _on_host(a):
    """NumPy arrays take the formulas, CuPy arrays the kernels (the tests swap this to emulate the kernels)."""
    return isinstance(a, np.ndarray)


def _c(a):
    """a as a C-contiguous array (the kernels index flat); a no-op for the arrays the model makes."""
    return a if a.flags.c_contiguous else array_module(a).ascontiguousarray(a)


_i64 = kernels.sizes   # sizes as the kernels' `long long`


def _launch_elem(name, n, args, dtype):
    grid, block = kernels.elem_grid(n)
    kernels.kernel(name, dtype)(grid, block, args)


_GELU_C = math.sqrt(2.0 / math.pi)

# ---------------------------------------------------------------------------------------------------------
# Array-level ops: NumPy formulas first, then the kernel launch that computes the same thing on CuPy.


@_launches(1)
def layer_norm_fwd(x, w, b, eps):
    """(y, mean, rstd) for rows x (N, C); mean and rstd are (N, 1)."""
    if _on_host(x):
        mean = x.mean(axis=-1, keepdims=True)
        xc = x - mean
        rstd = 1.0 / (((xc * xc).mean(axis=-1, keepdims=True) + eps) ** 0.5)
        return (xc * rstd) * w + b, mean, rstd
    cp = array_module(x)
    x, n, c = _c(x), x.shape[0], x.shape[1]
    y, mean, rstd = cp.empty_like(x), cp.empty((n, 1), x.dtype), cp.empty((n, 1), x.dtype)
    kernels.kernel("ln_fwd", x.dtype)(*kernels.row_grid(n), (x, _c(w), _c(b), y, mean, rstd,
                                                            *_i64(n, c), x.dtype.type(eps)))
    return y, mean, rstd


@_launches(2)
def layer_norm_bwd(g, x, w, mean, rstd, acc):
    """(dx, dw, db) of layer norm for rows (N, C); dx includes acc (a gradient already there) unless None."""
    return _layer_norm_bwd(g, x, w, mean, rstd, acc, False)


@_launches(2)
def layer_norm_bwd_sum(g, x, w, mean, rstd, acc):
    """layer_norm_bwd and the column sums of the dx it returns, (dx, dw, db, ds), from the same two launches."""
    return _layer_norm_bwd(g, x, w, mean, rstd, acc, True)


def _layer_norm_bwd(g, x, w, mean, rstd, acc, with_sum):
    if _on_host(x):
        xhat = (x - mean) * rstd
        dxhat = g * w
        inner = dxhat - dxhat.mean(axis=-1, keepdims=True)
        inner = inner - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True)
        dx = rstd * inner
        dx = dx if acc is None else acc + dx
        grads = dx, (g * xhat).sum(axis=0), g.sum(axis=0)
        return grads + (dx.sum(axis=0),) if with_sum else grads
    cp = array_module(x)
    g, x, n, c = _c(g), _c(x), x.shape[0], x.shape[1]
    dx = cp.empty_like(x)
    sums = cp.empty((3 if with_sum else 2, c), x.dtype)
    has_acc = acc is not None
    sizes = _i64(n, c)
    kernels.kernel("ln_bwd", x.dtype)(*kernels.row_grid(n), (g, x, _c(w), mean, rstd, _c(acc) if has_acc else x,
                                                            dx, *sizes, np.int32(has_acc)))
    out = tuple(_row_view(sums, i, (c,)) for i in range(sums.shape[0]))
    ds = out[2] if with_sum else out[0]     # (not written without with_sum)
    kernels.kernel("ln_param", x.dtype)(*kernels.col_grid(n, c), (g, x, mean, rstd, dx, out[0], out[1], ds, *sizes,
                                                                  np.int32(with_sum)))
    return (dx,) + out


@_launches(1)
def colsum(a):
    """Sum of a (N, C) over its rows: a bias's gradient. Deterministic: fixed row order, then a fixed tree."""
    if _on_host(a):
        return a.sum(axis=0)
    a, n, c = _c(a), a.shape[0], a.shape[1]
    out = array_module(a).empty((c,), a.dtype)
    kernels.kernel("colsum", a.dtype)(*kernels.col_grid(n, c), (a, out, *_i64(n, c)))
    return out


@_launches(1)
def bias_gelu(a, b):
    """gelu(a + b), tanh form, with b broadcast over the last axis."""
    if _on_host(a):
        u = a + b
        t = np.tanh(_GELU_C * (u + 0.044715 * u * u * u))
        return 0.5 * u * (1.0 + t)
    a = _c(a)
    y = array_module(a).empty_like(a)
    _launch_elem("bias_gelu_fwd", a.size, (a, _c(b), y, *_i64(a.size, b.size)), a.dtype)
    return y


@_launches(1)
def bias_gelu_bwd(g, a, b):
    """(du, db): du = g times d gelu(a + b) / d(a + b), rows (N, C), and db its sum over rows (b's gradient)."""
    if _on_host(a):
        u = a + b
        t = np.tanh(_GELU_C * (u + 0.044715 * u * u * u))
        d = _GELU_C * (1.0 + 3 * 0.044715 * u * u)
        du = g * (0.5 * (1.0 + t) + 0.5 * u * (1.0 - t * t) * d)
        return du, du.sum(axis=0)
    cp = array_module(a)
    a, n, c = _c(a), a.shape[0], a.shape[1]
    du, db = cp.empty_like(a), cp.empty((c,), a.dtype)
    kernels.kernel("bias_gelu_bwd", a.dtype)(*kernels.col_grid(n, c), (_c(g), a, _c(b), du, db, *_i64(n, c)))
    return du, db


@_launches(1)
def bias_residual(x, a, b):
    """x + (a + b): a residual stream plus a projection and its bias."""
    if _on_host(a):
        return x + (a + b)
    a = _c(a)
    y = array_module(a).empty_like(a)
    _launch_elem("bias_residual", a.size, (_c(x), a, _c(b), y, *_i64(a.size, b.size)), a.dtype)
    return y


@_launches(1)
def residual_layer_norm_fwd(x, a, bias, w, b, eps):
    """(r, y, mean, rstd): r = x + (a + bias) as bias_residual, and layer_norm_fwd of r, from one kernel."""
    if _on_host(x):
        r = x + (a + bias)
        return (r, *layer_norm_fwd(r, w, b, eps))
    cp = array_module(x)
    x, a, n, c = _c(x), _c(a), x.shape[0], x.shape[1]
    r, y, mean, rstd = cp.empty_like(x), cp.empty_like(x), cp.empty((n, 1), x.dtype), cp.empty((n, 1), x.dtype)
    kernels.kernel("residual_ln_fwd", x.dtype)(*kernels.row_grid(n), (x, a, _c(bias), _c(w), _c(b), r, y, mean, rstd,
                                                                     *_i64(n, c), x.dtype.type(eps)))
    return r, y, mean, rstd


@_launches(1)
def embed_fwd(wte, wpe, idx):
    """wte[idx] + wpe[:T] for token ids idx (B, T)."""
    if _on_host(wte):
        return np.take(wte, idx, axis=0) + wpe[:idx.shape[1]]
    cp = array_module(wte)
    idx = _c(idx.astype(np.int64, copy=False))
    c = wte.shape[1]
    y = cp.empty(idx.shape + (c,), wte.dtype)
    _launch_elem("embed_fwd", y.size, (_c(wte), _c(wpe), idx, y, *_i64(y.size, idx.shape[1], c)), wte.dtype)
    return y


@_launches(1)
def onehot_t(idx, vocab, dtype):
    """The (vocab, N) matrix with a 1 where row v meets a token id v: its product with g sums rows exactly."""
    idx = idx.reshape(-1)
    if _on_host(idx):
        return (np.arange(vocab).reshape(-1, 1) == idx.reshape(1, -1)).astype(dtype)
    cp = array_module(idx)
    idx = _c(idx.astype(np.int64, copy=False))
    out = cp.empty((vocab, idx.size), dtype)
    _launch_elem("onehot_t", out.size, (idx, out, *_i64(out.size, idx.size)), out.dtype)
    return out


def _row_view(out, i, shape):
    """Row i of a C-contiguous 2-D array as an array of `shape`, a view. On CuPy a view made at a byte offset
    (out.data + offset): an integer index goes through CuPy's general indexing, several times the host time."""
    if isinstance(out, np.ndarray):
        return out[i].reshape(shape)
    return type(out)(shape, out.dtype, out.data + i * out.shape[1] * out.itemsize)


@_launches(1)
def rows_to_heads(a, bias, n_head, S):
    """Rows a (B, T, S*C) plus bias (or None) -> for each of the S parts (q, k, v when S = 3) the pair of
    contiguous arrays (heads (B, H, T, D), the same transposed (B, H, D, T)): no matmul gets a transposed operand."""
    B, T, SC = a.shape
    D = SC // (S * n_head)
    if _on_host(a):
        u = (a if bias is None else a + bias).reshape(B, T, S, n_head, D)
        heads = [u[:, :, s].transpose(0, 2, 1, 3) for s in range(S)]
        return [(np.ascontiguousarray(x), np.ascontiguousarray(_swap(x))) for x in heads]
    a = _c(a)
    M = B * n_head * T * D
    out = array_module(a).empty((2 * S, M), a.dtype)
    has_bias = bias is not None
    _launch_elem("rows_to_heads", a.size, (a, _c(bias) if has_bias else a, out, *_i64(a.size, B, T, n_head, D, S),
                                           np.int32(has_bias)), a.dtype)
    return [(_row_view(out, 2 * s, (B, n_head, T, D)), _row_view(out, 2 * s + 1, (B, n_head, D, T))) for s in range(S)]


@_launches(1)
def heads_to_rows(parts, transposed):
    """Heads -> rows (B*T, S*H*D), part s from parts[s]: (B, H, T, D), or (B, H, D, T) where transposed[s]."""
    S = len(parts)
    B, H = parts[0].shape[:2]
    T, D = parts[0].shape[2:][::-1] if transposed[0] else parts[0].shape[2:]
    if _on_host(parts[0]):
        heads = [_swap(x) if t else x for x, t in zip(parts, transposed)]
        return np.stack(heads, axis=2).transpose(0, 3, 2, 1, 4).reshape(B * T, S * H * D)
    parts = [_c(x) for x in parts]
    a0, a1, a2 = (parts + parts[:1] * 2)[:3]
    mask = sum(1 << s for s, t in enumerate(transposed) if t)
    out = array_module(a0).empty((B * T, S * H * D), a0.dtype)
    _launch_elem("heads_to_rows", out.size, (a0, a1, a2, out, *_i64(out.size, B, T, H, D, S), np.int32(mask)),
                 a0.dtype)
    return out


def _causal_mask(tq, tk):
    """True where query i (at absolute position i + tk - tq) may see key j."""
    return np.arange(tk).reshape(1, -1) <= (np.arange(tq).reshape(-1, 1) + (tk - tq))


@_launches(1)
def causal_softmax(s, scale):
    """softmax(scale * s) over the last axis with the causal mask, written into s (..., Tq, Tk)."""
    tq, tk = s.shape[-2:]
    if _on_host(s):
        x = np.where(_causal_mask(tq, tk), s * scale, s.dtype.type(-np.inf))
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        s[...] = e / e.sum(axis=-1, keepdims=True)
        return s
    s = _c(s)
    n_rows = s.size // tk
    kernels.kernel("causal_softmax_fwd", s.dtype)(*kernels.row_grid(n_rows),
                                                  (s, *_i64(n_rows, tq, tk), s.dtype.type(scale)))
    return s


@_launches(1)
def causal_softmax_bwd(p, dp, scale):
    """Scores' gradient scale * p * (dp - sum(dp * p)), written into dp (masked entries get 0)."""
    tq, tk = p.shape[-2:]
    if _on_host(p):
        dp[...] = np.where(_causal_mask(tq, tk), scale * (p * (dp - (dp * p).sum(axis=-1, keepdims=True))), 0)
        return dp
    dp = _c(dp)
    n_rows = p.size // tk
    kernels.kernel("causal_softmax_bwd", p.dtype)(*kernels.row_grid(n_rows),
                                                  (_c(p), dp, *_i64(n_rows, tq, tk), p.dtype.type(scale)))
    return dp


@_launches(1)
def ce_fwd(z, t):
    """Per-row cross-entropy of logits z (N, V) against int targets t (N,): (loss, max, sum of exp), each (N, 1)."""
    if _on_host(z):
        m = z.max(axis=-1, keepdims=True)
        s = np.exp(z - m).sum(axis=-1, keepdims=True)
        picked = np.take_along_axis(z, t.reshape(-1, 1), axis=-1)
        return np.log(s) + m - picked, m, s
    cp = array_module(z)
    z, t, n = _c(z), _c(t.astype(np.int64, copy=False)), z.shape[0]
    loss, m, s = (cp.empty((n, 1), z.dtype) for _ in range(3))
    kernels.kernel("ce_fwd", z.dtype)(*kernels.row_grid(n), (z, t, loss, m, s, *_i64(n, z.shape[1])))
    return loss, m, s


@_launches(1)
def ce_bwd(z, t, m, s, g):
    """(softmax(z) - onehot(t)) * g / N: the logits' gradient of the mean loss, g its 0-d gradient."""
    n, vocab = z.shape
    if _on_host(z):
        onehot = (t.reshape(-1, 1) == np.arange(vocab).reshape(1, -1)).astype(z.dtype)
        return (np.exp(z - m) / s - onehot) * (g / n)
    cp = array_module(z)
    z, t = _c(z), _c(t.astype(np.int64, copy=False))
    g = _c(cp.asarray(g, dtype=z.dtype).reshape(1))
    dz = cp.empty_like(z)
    _launch_elem("ce_bwd", z.size, (z, t, m, s, g, dz, *_i64(z.size, vocab, n)), z.dtype)
    return dz


def adamw_formulas(p, m, v, g, n_decay, decay, b1, b2, step_size, bc2_sqrt, eps):
    """One AdamW step on flat arrays as array code (NumPy or CuPy): p updated in place, the new (m, v) returned.

    The first n_decay elements of p get weight decay (p *= decay). The square root is sqrt, not `** 0.5`:
    NumPy computes `** 0.5` as sqrt anyway, CuPy as powf, which may differ from sqrt in the last bit."""
    m = b1 * m + (1.0 - b1) * g
    v = b2 * v + (1.0 - b2) * (g * g)
    if n_decay:
        decayed = p[:n_decay]   # a view: in-place on it, no write-back copy
        decayed *= decay
    p -= step_size * (m / (array_module(v).sqrt(v) / bc2_sqrt + eps))
    return m, v


@_launches(1)
def adamw(p, m, v, g, n_decay, decay, b1, b2, step_size, bc2_sqrt, eps):
    """adamw_formulas in one kernel over flat contiguous p, m and v, all three updated in place; the result is
    bit-identical (each operation rounds as it does there, see the kernel). Returns (m, v)."""
    if _on_host(p):
        return adamw_formulas(p, m, v, g, n_decay, decay, b1, b2, step_size, bc2_sqrt, eps)
    t = p.dtype.type   # Python floats meet float32 arrays as float32 (NumPy's and CuPy's weak scalars)
    _launch_elem("adamw", p.size, (p, m, v, _c(g), *_i64(p.size, n_decay), t(b1), t(1.0 - b1), t(b2), t(1.0 - b2),
                                   t(decay), t(bc2_sqrt), t(eps), t(step_size)), p.dtype)
    return m, v


# ---------------------------------------------------------------------------------------------------------
# Tape ops: one node each.


def _set_grad(t, g):
    """Store a gradient buffer this op just made (no other tensor holds it, so later sums may reuse it)."""
    if t.requires_grad:
        t.grad, t._owned = g, True


def _linear_grads(g2, h, h2, w, b):
    """Gradients of h2 @ w + b given g2 = d(out) as rows: into b (unless None: the caller did it), w and h."""
    if b is not None and b.requires_grad:
        _accumulate(b, colsum(g2))
    if w.requires_grad:
        _accumulate(w, mm(h2.T, g2))
    if h.requires_grad:
        _accumulate(h, mm(g2, w.data.T).reshape(h.shape))


def embed(wte, wpe, idx):
    """wte[idx] + wpe[:T]: token plus position embeddings of ids idx (B, T)."""
    xp = array_module(wte.data)
    B, T = idx.shape
    vocab, C = wte.shape
    out = embed_fwd(wte.data, wpe.data, idx)

    def backward(g):
        if wte.requires_grad:
            # A one-hot GEMM rather than a scatter-add: it sums in a fixed order, atomics do not.
            _accumulate(wte, mm(onehot_t(idx, vocab, g.dtype), g.reshape(-1, C)))
        if wpe.requires_grad:
            gp = colsum(g.reshape(B, T * C)).reshape(T, C)
            if T < wpe.shape[0]:
                full = xp.zeros(wpe.shape, g.dtype)
                full[:T] = gp
                gp = full
            _accumulate(wpe, gp)

    return _make(out, (wte, wpe), backward)


def layer_norm(x, w, b, eps=1e-5):
    """Layer norm over the last axis (as tape.layer_norm); its backward adds into x's gradient in the kernel."""
    x2 = x.data.reshape(-1, x.shape[-1])
    return _layer_norm_node(x, x2, *layer_norm_fwd(x2, w.data, b.data, eps), w, b)


def _layer_norm_node(x, x2, y, mean, rstd, w, b, handoff=None):
    """The tape node of y = layer norm of x (x2: x's data as rows), its forward already computed.

    With handoff (a dict), its backward also sums the gradient it writes into x over the rows, in the same
    launches, and leaves that gradient and its sums there: x's own backward needs them for a bias."""
    C = x.shape[-1]

    def backward(g):
        acc = None if x.grad is None else x.grad.reshape(-1, C)
        args = (g.reshape(-1, C), x2, w.data, mean, rstd, acc)
        if handoff is None:
            dx, dw, db = layer_norm_bwd(*args)
        else:
            dx, dw, db, ds = layer_norm_bwd_sum(*args)
        _set_grad(x, dx.reshape(x.shape))
        if handoff is not None:
            handoff.update(grad=x.grad, sum=ds)
        _accumulate(w, dw)
        _accumulate(b, db)

    return _make(y.reshape(x.shape), (x, w, b), backward)


def attention(h, w, b, n_head):
    """Causal self-attention of h (B, T, C) up to the output projection: the heads' outputs merged, (B, T, C).

    q, k, v = split(h @ w + b); per head softmax(q k^T / sqrt(D) + mask) v, batched over (B, H) in one GEMM.
    """
    B, T, C = h.shape
    scale = 1.0 / math.sqrt(C // n_head)
    h2 = h.data.reshape(-1, C)
    (q, qT), (k, kT), (v, vT) = rows_to_heads(mm(h2, w.data).reshape(B, T, 3 * C), b.data, n_head, 3)
    p = causal_softmax(mm(q, kT), scale)
    y = heads_to_rows([mm(p, v)], [False]).reshape(B, T, C)

    def backward(g):
        [(gh, ghT)] = rows_to_heads(g, None, n_head, 1)
        ds = causal_softmax_bwd(p, mm(gh, vT), scale)
        # dq = ds k; dk = ds^T q and dv = p^T g, computed transposed (q^T ds, g^T p) so every operand is contiguous.
        da = heads_to_rows([mm(ds, k), mm(qT, ds), mm(ghT, p)], [False, True, True])
        _linear_grads(da, h, h2, w, b)

    return _make(y, (h, w, b), backward)


def linear_gelu(h, w, b):
    """gelu(h @ w + b)."""
    h2 = h.data.reshape(-1, h.shape[-1])
    a = mm(h2, w.data)
    y = bias_gelu(a, b.data).reshape(h.shape[:-1] + (w.shape[1],))

    def backward(g):
        du, db = bias_gelu_bwd(g.reshape(a.shape), a, b.data)    # the bias's gradient in the same pass
        _accumulate(b, db)
        _linear_grads(du, h, h2, w, None)

    return _make(y, (h, w, b), backward)


def linear_residual(x, h, w, b, ln=None):
    """x + (h @ w + b): a residual connection around a projection. With ln = (ln_w, ln_b, eps), the same kernel
    also computes the layer norm that reads the new residual stream: returns (x + ..., its layer norm)."""
    h2 = h.data.reshape(-1, h.shape[-1])
    a = mm(h2, w.data)
    x2 = x.data.reshape(a.shape)
    if ln is None:
        y = bias_residual(x2, a, b.data)
    else:
        y, *norm = residual_layer_norm_fwd(x2, a, b.data, ln[0].data, ln[1].data, ln[2])
    # The layer norm's backward writes this op's whole gradient when it runs last among the result's readers
    # (the next residual add runs first and leaves its part for the norm's kernel to add to): then it also hands
    # over the gradient's column sums, b's gradient, and no launch of colsum is needed here.
    handoff = None if ln is None else {}

    def backward(g):
        _accumulate(x, g)
        summed = handoff is not None and handoff.get("grad") is g
        if summed:
            _accumulate(b, handoff["sum"])
        if handoff:
            handoff.clear()
        _linear_grads(g.reshape(a.shape), h, h2, w, None if summed else b)

    out = _make(y.reshape(x.shape), (x, h, w, b), backward)
    return out if ln is None else (out, _layer_norm_node(out, y, *norm, ln[0], ln[1], handoff))


def cross_entropy(logits, targets):
    """Mean over tokens of -log softmax(logits)[target] (as tape.cross_entropy); a 0-d tensor."""
    vocab = logits.shape[-1]
    z = logits.data.reshape(-1, vocab)
    t = targets.reshape(-1)
    rows, m, s = ce_fwd(z, t)
    out = rows.mean(keepdims=True).reshape(())

    def backward(g):
        _accumulate(logits, ce_bwd(z, t, m, s, g).reshape(logits.shape))

    return _make(out, (logits,), backward)
