"""What one training step dispatches, counted on NumPy: tape nodes and array ops (each op ~ one CuPy launch).

On CuPy the host's time per step is roughly launches x 5-20 us, so the count is the profile that matters for
issue 13 and it needs no GPU. Every NumPy ufunc call (elementwise ops, reductions, matmul), array function
(take, where, concatenate, ...), copying reshape, copy, astype and slice assignment counts as one launch, and so
does each operand CuPy's matmul copies to make it contiguous (a transposed operand of a batched product); a
fused op (tapegpt.fused) counts as the kernels its CuPy form launches, whatever NumPy does to compute it.
Array creation without a source (zeros, empty) is not counted: on CuPy it is an allocation (zeros: a memset).
"""
import collections
import dataclasses
import threading

import numpy as np

from . import fused
from .data import get_batch, load_corpus
from .model import GPT, GPTConfig
from .optim import AdamW
from .tape import _topo_order

# Array functions that make views or empty buffers, not kernels.
FREE = {"reshape", "transpose", "swapaxes", "ravel", "shape", "ndim", "empty_like", "result_type", "may_share_memory",
        "shares_memory", "split", "array_split"}


class _Recorder:
    """Counts the ops of the thread that made it (other threads training meanwhile pass through uncounted)."""

    def __init__(self):
        self.ops = collections.Counter()
        self.muted = 0
        self.thread = threading.get_ident()

    def count(self, name, n=1):
        if not self.muted and threading.get_ident() == self.thread:
            self.ops[name] += n

    def fused_op(self, name, launches, fn, args):
        if threading.get_ident() != self.thread:
            return fn(*args)
        self.count(f"fused.{name}", launches)
        self.muted += 1
        try:
            return _wrap(fn(*args))
        finally:
            self.muted -= 1


_rec = None


def _plain(a):
    return a.view(np.ndarray) if isinstance(a, Counted) else a


def _wrap(r):
    if isinstance(r, np.ndarray) and not isinstance(r, Counted):
        return r.view(Counted)
    if isinstance(r, tuple):
        return tuple(_wrap(x) for x in r)
    if isinstance(r, list):
        return [_wrap(x) for x in r]
    return r


def _copied_by_cupy_matmul(a, inputs):
    """Whether CuPy's matmul copies operand a first: a batched product (ndim > 2) makes both operands
    C-contiguous (cupy/_core/_routines_linalg.pyx), a 2-D one takes C or F order (a transpose is free)."""
    if max(np.ndim(x) for x in inputs) > 2:
        return not a.flags.c_contiguous
    return not (a.flags.c_contiguous or a.flags.f_contiguous)


class Counted(np.ndarray):
    """A NumPy array that reports each op it takes part in to the active recorder."""

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kw):
        if _rec is not None:
            _rec.count(ufunc.__name__ if method == "__call__" else f"{ufunc.__name__}.{method}")
            if ufunc is np.matmul:
                _rec.count("matmul operand copy", sum(map(_copied_by_cupy_matmul, inputs, [inputs] * len(inputs))))
        if out is not None:
            kw["out"] = tuple(_plain(o) for o in out)
        result = getattr(ufunc, method)(*(_plain(a) for a in inputs), **kw)
        if out is not None:
            return out[0] if len(out) == 1 else out
        return _wrap(result)

    def __array_function__(self, func, types, args, kwargs):
        if _rec is not None and func.__name__ not in FREE:
            _rec.count(func.__name__)
        args = [(_plain(a) if not isinstance(a, (list, tuple)) else type(a)(_plain(x) for x in a)) for a in args]
        return _wrap(func(*args, **{k: _plain(v) for k, v in kwargs.items()}))

    def reshape(self, *shape, **kw):
        r = super().reshape(*shape, **kw)
        if _rec is not None and r.size and not np.may_share_memory(r, self):
            _rec.count("reshape (copy)")
        return r

    def copy(self, *a, **kw):
        if _rec is not None:
            _rec.count("copy")
        return super().copy(*a, **kw)

    def astype(self, dtype, *a, **kw):
        r = super().astype(dtype, *a, **kw)
        if _rec is not None and r is not self:
            _rec.count("astype")
        return r

    def __setitem__(self, index, value):
        if _rec is not None:
            _rec.count("setitem")
        super().__setitem__(index, _plain(value))


def op_counts(cfg=None, fused_model=None, foreach=True, seed=0):
    """One training step (loss, backward, AdamW) of `cfg` on NumPy: tape nodes and launches, total and by op.

    The counts depend on n_layer (and the model's form), not on the widths or the batch, so a narrow config
    with the reference depth gives the reference step's counts quickly (see reference_counts).
    """
    global _rec
    cfg = cfg or GPTConfig()
    model = GPT(cfg, xp=np, seed=seed, fused=fused_model)
    model.params = {k: v.view(Counted) for k, v in model.params.items()}
    opt = AdamW(model.params, foreach=foreach, fused=model.fused)
    x, y = get_batch(load_corpus(), cfg.batch_size, cfg.block_size, 0)
    rec = _rec = fused._recorder = _Recorder()
    try:
        P = model._tensors(True)
        loss = model.loss_tensor(P, x, y)
        nodes = sum(1 for t in _topo_order(loss) if t._backward is not None)
        loss.backward()
        grads = {k: t.grad for k, t in P.items()}
        opt.step(grads)
    finally:
        _rec = fused._recorder = None
    return dict(fused=model.fused, adamw="foreach" if foreach else "per_param", n_layer=cfg.n_layer,
                tape_nodes=nodes, launches=sum(rec.ops.values()), by_op=dict(rec.ops.most_common()))


def reference_counts(cfg=None, **kw):
    """op_counts for cfg's depth and heads on narrow widths and a short batch (same counts, a fraction of the time)."""
    cfg = cfg or GPTConfig()
    small = dataclasses.replace(cfg, n_embd=4 * cfg.n_head, n_ffn=8 * cfg.n_head, block_size=8, batch_size=2)
    return op_counts(small, **kw)
