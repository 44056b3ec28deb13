"""Tape-based reverse-mode autograd over one array module (NumPy or CuPy)."""
import math
import sys

import numpy as np

from . import blas


def array_module(a):
    """NumPy for host arrays, CuPy otherwise (CuPy is only ever imported by the caller)."""
    if isinstance(a, (np.ndarray, np.generic)):
        return np
    return sys.modules["cupy"]


class Tensor:
    """An array plus the closure that pushes its gradient back to the tensors it came from."""

    __slots__ = ("data", "grad", "requires_grad", "_parents", "_backward", "_owned")

    def __init__(self, data, requires_grad=False, parents=(), backward=None):
        self.data = data
        self.grad = None
        self.requires_grad = requires_grad
        self._parents = parents
        self._backward = backward
        self._owned = False  # True when .grad is a buffer no other tensor references

    shape = property(lambda self: self.data.shape)
    ndim = property(lambda self: self.data.ndim)
    dtype = property(lambda self: self.data.dtype)

    def __repr__(self):
        return f"Tensor(shape={self.shape}, dtype={self.dtype}, requires_grad={self.requires_grad})"

    def backward(self, grad=None):
        """Accumulate d(self)/d(leaf) into every leaf's .grad, freeing interior grads as it goes."""
        order = _topo_order(self)
        xp = array_module(self.data)
        self.grad = xp.ones_like(self.data) if grad is None else grad
        for node in reversed(order):
            if node._backward is None:
                continue  # a leaf: keep its gradient for the caller
            if node.grad is not None:
                node._backward(node.grad)
            # Drop the closure (and the activations it saved) as soon as it has run, like a real tape.
            node._backward, node._parents, node.grad = None, (), None


def _topo_order(root):
    """Inputs-before-outputs order by an iterative DFS; parent order is fixed, so the walk is deterministic."""
    order, seen, stack = [], {id(root)}, [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        stack.append((node, True))
        for p in reversed(node._parents):
            if id(p) not in seen:
                seen.add(id(p))
                stack.append((p, False))
    return order


def _accumulate(t, g):
    """Add gradient g into t.grad; the first contribution is kept by reference, later ones make a new sum."""
    if not t.requires_grad:
        return
    if t.grad is None:
        t.grad, t._owned = g, False
    else:
        t.grad, t._owned = t.grad + g, True


def _accumulate_slice(t, index, g):
    """Add g into t.grad[index] without materialising a zero-padded copy when t already owns its buffer."""
    if not t.requires_grad:
        return
    xp = array_module(g)
    if t.grad is None:
        t.grad = xp.zeros(t.shape, dtype=g.dtype)
    elif not t._owned:
        t.grad = t.grad.copy()  # never write into an array another tensor may still read
    t._owned = True
    t.grad[index] += g


def _unbroadcast(g, shape):
    """Sum g down to `shape`, undoing NumPy broadcasting so a gradient matches its input."""
    shape = tuple(shape)
    if g.shape == shape:
        return g
    lead = g.ndim - len(shape)
    if lead:
        g = g.sum(axis=tuple(range(lead)))
    ones = tuple(i for i, n in enumerate(shape) if n == 1 and g.shape[i] != 1)
    if ones:
        g = g.sum(axis=ones, keepdims=True)
    return g


def _make(data, parents, backward):
    """Wrap an op result; record the backward closure only when some input needs a gradient."""
    if any(p.requires_grad for p in parents):
        return Tensor(data, True, parents, backward)
    return Tensor(data)


def _swap(a):
    """Transpose the last two axes."""
    return a.swapaxes(-1, -2)


def _mm(xp, a, b):
    """a @ b; rows times one shared matrix become a single 2-D GEMM (faster than a stride-0 batched one).
    On CuPy a GEMM is one direct cuBLAS call (tapegpt.blas), the costliest op of a step to dispatch otherwise."""
    if b.ndim == 2 and a.ndim > 2:
        return blas.mm(a.reshape(-1, a.shape[-1]), b).reshape(a.shape[:-1] + (b.shape[-1],))
    return blas.mm(a, b) if a.ndim == b.ndim else xp.matmul(a, b)


def matmul(a, b):
    """Batched matrix product with NumPy broadcasting of the batch axes."""
    xp = array_module(a.data)
    assert a.ndim >= 2 and b.ndim >= 2, "matmul needs matrices"
    out = _mm(xp, a.data, b.data)

    def backward(g):
        if a.requires_grad:
            _accumulate(a, _unbroadcast(_mm(xp, g, _swap(b.data)), a.shape))
        if b.requires_grad:
            if b.ndim == 2 and a.ndim > 2:
                # A shared weight: fold the batch into rows so its gradient is one GEMM, not a batched sum.
                k, n = b.shape
                gb = blas.mm(a.data.reshape(-1, k).T, g.reshape(-1, n))
            else:
                gb = _unbroadcast(xp.matmul(_swap(a.data), g), b.shape)
            _accumulate(b, gb)

    return _make(out, (a, b), backward)


def add(a, b):
    """Elementwise a + b with broadcasting; each gradient is summed back to its input's shape."""
    out = a.data + b.data

    def backward(g):
        _accumulate(a, _unbroadcast(g, a.shape))
        _accumulate(b, _unbroadcast(g, b.shape))

    return _make(out, (a, b), backward)


def mul(a, b):
    """Elementwise a * b with broadcasting."""
    out = a.data * b.data

    def backward(g):
        if a.requires_grad:
            _accumulate(a, _unbroadcast(g * b.data, a.shape))
        if b.requires_grad:
            _accumulate(b, _unbroadcast(g * a.data, b.shape))

    return _make(out, (a, b), backward)


def linear(x, w, b=None):
    """x @ w (+ b), with w stored (in, out) so no transpose is needed."""
    y = matmul(x, w)
    return y if b is None else add(y, b)


def reshape(x, shape):
    """View x with a new shape."""
    out = x.data.reshape(shape)

    def backward(g):
        _accumulate(x, g.reshape(x.shape))

    return _make(out, (x,), backward)


def transpose(x, axes):
    """Permute the axes of x."""
    axes = tuple(axes)
    inverse = tuple(np.argsort(axes))
    out = x.data.transpose(axes)

    def backward(g):
        _accumulate(x, g.transpose(inverse))

    return _make(out, (x,), backward)


def narrow(x, axis, start, stop):
    """The slice start:stop of x along one axis (used for splits and for the position table)."""
    axis = axis % x.ndim
    index = (slice(None),) * axis + (slice(start, stop),)
    out = x.data[index]

    def backward(g):
        _accumulate_slice(x, index, g)

    return _make(out, (x,), backward)


def split(x, n, axis=-1):
    """Split x into n equal parts along an axis."""
    size = x.shape[axis] // n
    assert size * n == x.shape[axis], "split must divide the axis evenly"
    return [narrow(x, axis, i * size, (i + 1) * size) for i in range(n)]


def embedding(w, idx):
    """Rows of table w picked by integer array idx: output shape idx.shape + (w.shape[1],)."""
    xp = array_module(w.data)
    out = xp.take(w.data, idx, axis=0)

    def backward(g):
        # One-hot matmul instead of a scatter-add: a GEMM sums in a fixed order, atomics do not.
        vocab, dim = w.shape
        onehot = (idx.reshape(-1, 1) == xp.arange(vocab).reshape(1, -1)).astype(g.dtype)
        _accumulate(w, xp.matmul(onehot.T, g.reshape(-1, dim)))

    return _make(out, (w,), backward)


def layer_norm(x, w, b, eps=1e-5):
    """Layer norm over the last axis with gain w and bias b (biased variance, like torch)."""
    xd = x.data
    mu = xd.mean(axis=-1, keepdims=True)
    xc = xd - mu
    rstd = 1.0 / (((xc * xc).mean(axis=-1, keepdims=True) + eps) ** 0.5)
    xhat = xc * rstd
    out = xhat * w.data + b.data

    def backward(g):
        lead = tuple(range(g.ndim - 1))
        if w.requires_grad:
            _accumulate(w, (g * xhat).sum(axis=lead))
        if b.requires_grad:
            _accumulate(b, g.sum(axis=lead))
        if x.requires_grad:
            dxhat = g * w.data
            inner = dxhat - dxhat.mean(axis=-1, keepdims=True)
            inner = inner - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True)
            _accumulate(x, rstd * inner)

    return _make(out, (x, w, b), backward)


_GELU_C = math.sqrt(2.0 / math.pi)


def gelu(x):
    """GELU, tanh approximation (GPT-2's; torch's approximate='tanh')."""
    xp = array_module(x.data)
    xd = x.data
    t = xp.tanh(_GELU_C * (xd + 0.044715 * xd * xd * xd))
    out = 0.5 * xd * (1.0 + t)

    def backward(g):
        du = _GELU_C * (1.0 + 3 * 0.044715 * xd * xd)
        _accumulate(x, g * (0.5 * (1.0 + t) + 0.5 * xd * (1.0 - t * t) * du))

    return _make(out, (x,), backward)


def causal_attention(q, k, v):
    """softmax(q k^T / sqrt(d) + causal mask) v for (..., T, d) inputs; saves the probabilities."""
    xp = array_module(q.data)
    t_q, d = q.shape[-2], q.shape[-1]
    t_k = k.shape[-2]
    scale = 1.0 / math.sqrt(d)
    # Scale q (T x d) rather than the scores (T x T): one fewer pass over the largest tensor.
    s = xp.matmul(q.data * scale, _swap(k.data))
    # Query i sits at absolute position i + (t_k - t_q), so it may see keys up to there.
    mask = xp.arange(t_k).reshape(1, -1) <= (xp.arange(t_q).reshape(-1, 1) + (t_k - t_q))
    s = xp.where(mask, s, s.dtype.type(-np.inf))
    e = xp.exp(s - s.max(axis=-1, keepdims=True))
    p = e / e.sum(axis=-1, keepdims=True)
    out = xp.matmul(p, v.data)

    def backward(g):
        if v.requires_grad:
            _accumulate(v, _unbroadcast(xp.matmul(_swap(p), g), v.shape))
        if q.requires_grad or k.requires_grad:
            dp = xp.matmul(g, _swap(v.data))
            # Masked entries have p == 0, so their score gradient is exactly zero.
            ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
            if q.requires_grad:
                _accumulate(q, _unbroadcast(xp.matmul(ds, k.data) * scale, q.shape))
            if k.requires_grad:
                _accumulate(k, _unbroadcast(xp.matmul(_swap(ds), q.data) * scale, k.shape))

    return _make(out, (q, k, v), backward)


def cross_entropy(logits, targets):
    """Mean over tokens of -log softmax(logits)[target]; returns a 0-d tensor (no host sync)."""
    xp = array_module(logits.data)
    vocab = logits.shape[-1]
    z = logits.data.reshape(-1, vocab)
    t = targets.reshape(-1, 1)
    n = z.shape[0]
    m = z.max(axis=-1, keepdims=True)
    e = xp.exp(z - m)
    s = e.sum(axis=-1, keepdims=True)
    picked = xp.take_along_axis(z, t, axis=-1)
    # keepdims + reshape keeps a 0-d *array* under NumPy too (a bare .mean() gives a NumPy scalar).
    out = (xp.log(s) + m - picked).mean(keepdims=True).reshape(())

    def backward(g):
        onehot = (t == xp.arange(vocab).reshape(1, -1)).astype(z.dtype)
        dz = (e / s - onehot) * (g / n)
        _accumulate(logits, dz.reshape(logits.shape))

    return _make(out, (logits,), backward)
