"""Correctness checks as plain functions returning tidy pandas rows (check, measured, threshold, passed, xp)."""
import contextlib
import hashlib
import math
import os
import tempfile

import numpy as np

from . import fused, tape
from .checkpoint import export_weights, load_checkpoint, save_checkpoint, to_numpy
from .data import get_batch, load_corpus
from .model import GPT, GPTConfig
from .optim import AdamW
from .serve import Server
from .tape import Tensor

# Shapes small enough for the CPU test suite; every check takes its config from here unless given one.
SMALL = dict(n_layer=2, n_head=2, n_embd=32, n_ffn=64, block_size=16, batch_size=4)


def small_config(**overrides):
    """The small test configuration, with overrides."""
    return GPTConfig(**dict(SMALL, **overrides))


def _frame(rows):
    import pandas as pd
    return pd.DataFrame(rows)


def _row(check, measured, threshold, xp, **extra):
    """One result row; a check passes when measured <= threshold (NaN never passes)."""
    measured = float(measured)
    return dict(check=check, measured=measured, threshold=float(threshold),
                passed=bool(measured <= threshold), xp=xp.__name__, **extra)


def _rel_err(a, b):
    """max|a - b| / max|b|: the error relative to the reference's scale (b is the reference)."""
    a, b = to_numpy(a).astype(np.float64), to_numpy(b).astype(np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def train(model, opt, data, steps, start=0, seed=0):
    """Run steps [start, start + steps) on the corpus; returns the 0-d loss arrays (still on the device)."""
    cfg, losses = model.cfg, []
    for step in range(start, start + steps):
        x, y = get_batch(data, cfg.batch_size, cfg.block_size, step, seed=seed, xp=model.xp)
        loss, grads = model.loss_and_grads(x, y)
        opt.step(grads)
        losses.append(loss)
    return losses


def params_sha256(params):
    """sha256 over every parameter's name, dtype, shape and bytes, in order."""
    h = hashlib.sha256()
    for k, v in params.items():
        a = np.ascontiguousarray(to_numpy(v))
        h.update(f"{k}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------------------
# Finite-difference gradient checks (float64)


def _fd_max_rel_err(xp, build, inputs, seed=0, eps=1e-6, max_entries=40):
    """Compare tape gradients of sum(build(*tensors) * R) with central differences on sampled entries."""
    rng = np.random.default_rng(seed)
    tensors = [Tensor(xp.asarray(a), requires_grad=True) for a in inputs]
    out = build(*tensors)
    r = xp.asarray(rng.standard_normal(out.shape))
    out.backward(r)

    def objective(arrays):
        return float((build(*[Tensor(a) for a in arrays]).data * r).sum())

    worst = 0.0
    for i, t in enumerate(tensors):
        n = t.data.size
        picks = np.arange(n) if n <= max_entries else rng.choice(n, max_entries, replace=False)
        analytic, numeric = [], []
        g = to_numpy(t.grad).reshape(-1)
        for j in picks:
            arrays = [xp.asarray(a).copy() for a in inputs]
            flat = arrays[i].reshape(-1)
            base = float(flat[int(j)])
            flat[int(j)] = base + eps
            up = objective(arrays)
            flat[int(j)] = base - eps
            down = objective(arrays)
            numeric.append((up - down) / (2 * eps))
            analytic.append(g[j])
        analytic, numeric = np.array(analytic), np.array(numeric)
        scale = max(np.abs(numeric).max(), np.abs(analytic).max(), 1e-12)
        worst = max(worst, float(np.abs(analytic - numeric).max() / scale))
    return worst


def _op_cases(xp):
    """(name, build, inputs) for every tape op, including each broadcasting pattern the model uses."""
    rng = np.random.default_rng(1)
    n = rng.standard_normal
    idx = xp.asarray(np.array([[0, 3, 3, 5, 1], [5, 5, 2, 0, 3]]))  # repeats exercise gradient summation
    targets = xp.asarray(np.array([[0, 6, 2], [2, 2, 4]]))
    return [
        ("matmul 2d", tape.matmul, [n((5, 4)), n((4, 3))]),
        ("matmul batched 4d", tape.matmul, [n((2, 3, 5, 4)), n((2, 3, 4, 3))]),
        ("matmul (B,T,C)@(C,D) weight", tape.matmul, [n((2, 5, 4)), n((4, 3))]),
        ("matmul broadcast batch both sides", tape.matmul, [n((2, 1, 5, 4)), n((3, 4, 2))]),
        ("add same shape", tape.add, [n((2, 3, 4)), n((2, 3, 4))]),
        ("add bias (C,)", tape.add, [n((2, 3, 4)), n((4,))]),
        ("add rows (T,C)", tape.add, [n((2, 3, 4)), n((3, 4))]),
        ("add keepdim (B,1,C)", tape.add, [n((2, 1, 4)), n((2, 3, 4))]),
        ("mul broadcast", tape.mul, [n((2, 3, 4)), n((1, 3, 1))]),
        ("linear", tape.linear, [n((2, 3, 4)), n((4, 5)), n((5,))]),
        ("layer_norm", lambda x, w, b: tape.layer_norm(x, w, b), [n((2, 3, 6)), 1 + 0.1 * n((6,)), n((6,))]),
        ("gelu (tanh)", tape.gelu, [3 * n((4, 7))]),
        ("causal_attention", tape.causal_attention, [n((2, 2, 5, 3)), n((2, 2, 5, 3)), n((2, 2, 5, 3))]),
        ("causal_attention q shorter than k", tape.causal_attention,
         [n((2, 2, 2, 3)), n((2, 2, 5, 3)), n((2, 2, 5, 3))]),
        ("cross_entropy", lambda z: tape.cross_entropy(z, targets), [n((2, 3, 7))]),
        ("embedding", lambda w: tape.embedding(w, idx), [n((6, 4))]),
        ("reshape", lambda x: tape.reshape(x, (6, 4)), [n((2, 3, 4))]),
        ("transpose", lambda x: tape.transpose(x, (2, 0, 1)), [n((2, 3, 4))]),
        ("narrow", lambda x: tape.narrow(x, 0, 1, 3), [n((4, 3))]),
        ("split (pieces multiplied)", lambda x: (lambda a, b, c: tape.add(tape.mul(a, b), c))(*tape.split(x, 3)),
         [n((2, 3, 6))]),
        ("split + direct use of the same input",
         lambda x: tape.mul(tape.add(*tape.split(x, 2)), tape.narrow(tape.gelu(x), -1, 0, 2)), [n((3, 4))]),
        # The fused ops (tapegpt.fused): on CuPy these run the kernels.
        ("fused layer_norm", lambda x, w, b: fused.layer_norm(x, w, b), [n((2, 3, 6)), 1 + 0.1 * n((6,)), n((6,))]),
        ("fused layer_norm adding into an existing gradient",
         lambda x, w, b: tape.add(fused.layer_norm(x, w, b), tape.mul(x, x)), [n((2, 3, 6)), n((6,)), n((6,))]),
        ("fused attention (2 heads)", lambda h, w, b: fused.attention(h, w, b, 2),
         [n((2, 5, 4)), n((4, 12)), n((12,))]),
        ("fused linear_gelu", fused.linear_gelu, [n((2, 3, 4)), n((4, 5)), 3 * n((5,))]),
        ("fused linear_residual", fused.linear_residual, [n((2, 3, 5)), n((2, 3, 4)), n((4, 5)), n((5,))]),
        ("fused embed (T < block)", lambda wte, wpe: fused.embed(wte, wpe, idx), [n((6, 4)), n((7, 4))]),
        ("fused cross_entropy", lambda z: fused.cross_entropy(z, targets), [n((2, 3, 7))]),
    ]


def grad_check_all(xp=np, tol=1e-6):
    """Finite-difference check of every op and of the small model's loss, in float64 on `xp`."""
    rows = []
    for name, build, inputs in _op_cases(xp):
        err = _fd_max_rel_err(xp, build, [np.asarray(a, dtype=np.float64) for a in inputs])
        rows.append(dict(check=f"grad {name}", max_rel_err=err, tol=tol, passed=bool(err <= tol), xp=xp.__name__))
    for fused_model in (False, True):
        err = model_grad_check(xp, fused=fused_model)
        rows.append(dict(check=f"grad GPT loss (3 entries / param, {_form(fused_model)})", max_rel_err=err,
                         tol=tol, passed=bool(err <= tol), xp=xp.__name__))
    return _frame(rows)


def _form(fused_model):
    return "fused" if fused_model else "unfused"


def model_grad_check(xp=np, entries=3, seed=0, eps=1e-5, fused=None):
    """Worst relative error of the float64 small model's loss gradient against central differences."""
    cfg = small_config(dtype="float64")
    model = GPT(cfg, xp=xp, seed=seed, fused=fused)
    x, y = get_batch(load_corpus(), 2, 8, step=0, xp=xp)
    _, grads = model.loss_and_grads(x, y)
    rng = np.random.default_rng(seed)
    worst = 0.0
    for k, p in model.params.items():
        g = to_numpy(grads[k]).reshape(-1)
        flat = p.reshape(-1)  # a view: writes below perturb the model in place
        analytic, numeric = [], []
        for j in rng.choice(flat.size, min(entries, flat.size), replace=False):
            base = float(flat[int(j)])
            flat[int(j)] = base + eps
            up = float(model.loss(x, y))
            flat[int(j)] = base - eps
            down = float(model.loss(x, y))
            flat[int(j)] = base
            numeric.append((up - down) / (2 * eps))
            analytic.append(g[j])
        analytic, numeric = np.array(analytic), np.array(numeric)
        # Scale by the whole tensor's gradient so near-zero entries do not blow up the ratio.
        scale = max(np.abs(g).max(), 1e-12)
        worst = max(worst, float(np.abs(analytic - numeric).max() / scale))
    return worst


def matmul_reference(xp=np, dtype="float32", tol=1e-5):
    """xp.matmul through the tape in `dtype` against an exact-ish float64 NumPy product."""
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((4, 8, 64, 48)), rng.standard_normal((48, 80))
    out = tape.matmul(Tensor(xp.asarray(a.astype(dtype))), Tensor(xp.asarray(b.astype(dtype)))).data
    ref = a.astype(dtype).astype(np.float64) @ b.astype(dtype).astype(np.float64)
    return _frame([_row(f"matmul {dtype} vs float64 reference", _rel_err(out, ref), tol, xp)])


# ---------------------------------------------------------------------------------------------------------
# PyTorch parity


def torch_logits(cfg, P, idx):
    """The same GPT written with torch.nn.functional (P: name -> torch tensor, weights stored (in, out))."""
    import torch.nn.functional as F
    B, T = idx.shape
    C, H = cfg.n_embd, cfg.n_head
    x = F.embedding(idx, P["wte"]) + P["wpe"][:T]
    for i in range(cfg.n_layer):
        p = f"h.{i}."
        h = F.layer_norm(x, (C,), P[p + "ln_1.w"], P[p + "ln_1.b"], cfg.ln_eps)
        q, k, v = (h @ P[p + "attn.c_attn.w"] + P[p + "attn.c_attn.b"]).split(C, dim=-1)
        q, k, v = (t.view(B, T, H, C // H).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C)
        x = x + y @ P[p + "attn.c_proj.w"] + P[p + "attn.c_proj.b"]
        h = F.layer_norm(x, (C,), P[p + "ln_2.w"], P[p + "ln_2.b"], cfg.ln_eps)
        h = F.gelu(h @ P[p + "mlp.c_fc.w"] + P[p + "mlp.c_fc.b"], approximate="tanh")
        x = x + h @ P[p + "mlp.c_proj.w"] + P[p + "mlp.c_proj.b"]
    x = F.layer_norm(x, (C,), P["ln_f.w"], P["ln_f.b"], cfg.ln_eps)
    return x @ P["lm_head.w"]


def _torch_loss(cfg, P, x, y):
    import torch.nn.functional as F
    logits = torch_logits(cfg, P, x)
    return logits, F.cross_entropy(logits.reshape(-1, cfg.vocab_size), y.reshape(-1))


# adamw is max |param difference| in units of lr. In float32 it cannot be tiny: the attention key bias has
# an exactly-zero true gradient (softmax ignores a per-query constant), so its computed gradient is rounding
# noise, which Adam rescales into steps of up to ~lr whose size differs between the two implementations.
TORCH_TOL = {"float64": dict(logits=1e-11, loss=1e-11, grad=1e-9, adamw=1e-8),
             "float32": dict(logits=2e-5, loss=2e-6, grad=2e-4, adamw=2e-2)}


def torch_parity(dtype="float64", adam_steps=5, lr=1e-3, seed=0, fused=None):
    """Logits, loss, every gradient and `adam_steps` AdamW training steps against torch on the CPU.

    fused: the model's form (default: tapegpt.fused.enabled); the check names say which one ran.
    """
    import torch
    cfg = small_config(dtype=dtype)
    tol = TORCH_TOL[dtype]
    data = load_corpus()
    model = GPT(cfg, xp=np, seed=seed, fused=fused)
    label = f"{dtype} {_form(model.fused)}"
    P = {k: torch.tensor(v, requires_grad=True) for k, v in model.params.items()}
    x, y = get_batch(data, cfg.batch_size, cfg.block_size, step=0)
    loss, grads = model.loss_and_grads(x, y)
    t_logits, t_loss = _torch_loss(cfg, P, torch.from_numpy(x), torch.from_numpy(y))
    t_loss.backward()
    rows = [
        _row(f"torch logits {label} (B={cfg.batch_size})", _rel_err(model.forward(x), t_logits.detach().numpy()),
             tol["logits"], np),
        _row(f"torch loss {label}", _rel_err(loss, t_loss.detach().numpy()), tol["loss"], np),
    ]
    rows += [_row(f"torch grad {label} {k}", _rel_err(grads[k], P[k].grad.numpy()), tol["grad"], np)
             for k in model.params]

    # Several full training steps: each side computes its own gradients from its own parameters.
    opt = AdamW(model.params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    groups = [{"params": [P[k] for k in P if k in opt.decay], "weight_decay": 0.1},
              {"params": [P[k] for k in P if k not in opt.decay], "weight_decay": 0.0}]
    t_opt = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    loss_err = 0.0
    for step in range(adam_steps):
        x, y = get_batch(data, cfg.batch_size, cfg.block_size, step=step)
        loss, grads = model.loss_and_grads(x, y)
        opt.step(grads)
        t_opt.zero_grad()
        _, t_loss = _torch_loss(cfg, P, torch.from_numpy(x), torch.from_numpy(y))
        t_loss.backward()
        t_opt.step()
        loss_err = max(loss_err, _rel_err(loss, t_loss.detach().numpy()))
    param_err = max(float(np.abs(model.params[k] - P[k].detach().numpy()).max()) for k in P) / lr
    rows.append(_row(f"torch AdamW {adam_steps} steps: losses {label}", loss_err, tol["loss"], np))
    rows.append(_row(f"torch AdamW {adam_steps} steps: max |param diff| / lr, {label}", param_err,
                     tol["adamw"], np))
    return _frame(rows)


def adamw_isolated_parity(steps=5, lr=1e-2, seed=0):
    """Our AdamW vs torch.optim.AdamW fed identical random float64 gradients (decay and no-decay params)."""
    import torch
    rng = np.random.default_rng(seed)
    params = {"w": rng.standard_normal((5, 4)), "b": rng.standard_normal((4,))}
    P = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    opt = AdamW(params, lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    t_opt = torch.optim.AdamW([{"params": [P["w"]], "weight_decay": 0.1}, {"params": [P["b"]], "weight_decay": 0.0}],
                              lr=lr, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    for _ in range(steps):
        grads = {k: rng.standard_normal(v.shape) * 1e-2 for k, v in params.items()}
        opt.step(grads)
        for k in P:
            P[k].grad = torch.from_numpy(grads[k].copy())
        t_opt.step()
    err = max(_rel_err(params[k], P[k].detach().numpy()) for k in P)
    return _frame([_row(f"torch AdamW isolated {steps} steps float64", err, 1e-12, np)])


# ---------------------------------------------------------------------------------------------------------
# Training-level checks


def fp32_vs_fp64(xp=np, tol_logits=1e-4, tol_grad=1e-3):
    """The float32 model on `xp` against a float64 NumPy model holding the same (float32-rounded) weights."""
    cfg32, cfg64 = small_config(), small_config(dtype="float64")
    m32 = GPT(cfg32, xp=xp, seed=0)
    m64 = GPT(cfg64, xp=np, seed=0)
    for k in m64.params:
        m64.params[k][...] = to_numpy(m32.params[k])
    x, y = get_batch(load_corpus(), cfg32.batch_size, cfg32.block_size, step=0, xp=np)
    loss32, g32 = m32.loss_and_grads(xp.asarray(x), xp.asarray(y))
    loss64, g64 = m64.loss_and_grads(x, y)
    rows = [_row("float32 logits vs float64", _rel_err(m32.forward(xp.asarray(x)), m64.forward(x)), tol_logits, xp),
            _row("float32 loss vs float64", _rel_err(loss32, loss64), tol_logits, xp),
            _row("float32 grads vs float64 (worst param)", max(_rel_err(g32[k], g64[k]) for k in g64), tol_grad, xp)]
    return _frame(rows)


def overfit(xp=np, steps=150, lr=3e-3, threshold=0.1):
    """The small model memorises one batch: loss on it falls below `threshold` within `steps` AdamW steps."""
    cfg = small_config()
    model = GPT(cfg, xp=xp, seed=0)
    opt = AdamW(model.params, lr=lr, weight_decay=0.0)
    x, y = get_batch(load_corpus(), cfg.batch_size, cfg.block_size, step=0, xp=xp)
    first = None
    for _ in range(steps):
        loss, grads = model.loss_and_grads(x, y)
        first = loss if first is None else first
        opt.step(grads)
    final = float(model.loss(x, y))
    return _frame([_row(f"overfit one batch: loss after {steps} steps", final, threshold, xp,
                        initial_loss=float(first))])


def checkpoint_roundtrip(xp=np, steps=4, tmpdir=None):
    """Save/load is bit-exact, and training resumed from a checkpoint matches uninterrupted training bit for bit."""
    cfg = small_config()
    data = load_corpus()
    with tempfile.TemporaryDirectory(dir=tmpdir) as d:
        path = os.path.join(d, "ckpt.npz")
        # Uninterrupted run, with a checkpoint written halfway.
        model = GPT(cfg, xp=xp, seed=0)
        opt = AdamW(model.params, lr=1e-3)
        losses = train(model, opt, data, steps)
        save_checkpoint(path, model, opt, step=steps)
        saved = {k: to_numpy(v).copy() for k, v in model.params.items()}
        saved_m = {k: to_numpy(v).copy() for k, v in opt.m.items()}
        saved_v = {k: to_numpy(v).copy() for k, v in opt.v.items()}
        losses += train(model, opt, data, steps, start=steps)
        # Resume into a model built from a different seed, so nothing can pass by coincidence.
        model2 = GPT(cfg, xp=xp, seed=1)
        opt2 = AdamW(model2.params, lr=5e-2, weight_decay=0.0)
        start = load_checkpoint(path, model2, opt2)
        same_state = sum(
            to_numpy(a[k]).tobytes() != b[k].tobytes()
            for a, b in ((model2.params, saved), (opt2.m, saved_m), (opt2.v, saved_v)) for k in b)
        same_state += int(start != steps) + int(opt2.t != opt.t - steps) + int(opt2.lr != opt.lr)
        losses2 = train(model2, opt2, data, steps, start=start)
    loss_bytes_a = b"".join(to_numpy(v).tobytes() for v in losses[steps:])
    loss_bytes_b = b"".join(to_numpy(v).tobytes() for v in losses2)
    return _frame([
        _row("checkpoint round trip: mismatching arrays/fields", same_state, 0, xp),
        _row("resumed losses differ from uninterrupted (bytes)", int(loss_bytes_a != loss_bytes_b), 0, xp),
        _row("resumed final params differ (sha256)",
             int(params_sha256(model.params) != params_sha256(model2.params)), 0, xp),
    ])


def batch_consistency(xp=np, tol_logits=1e-5, tol_grad=1e-5):
    """A float32 batch computed at once equals its rows computed one by one (logits, losses, mean gradient)."""
    cfg = small_config()
    model = GPT(cfg, xp=xp, seed=0)
    x, y = get_batch(load_corpus(), cfg.batch_size, cfg.block_size, step=0, xp=xp)
    logits = model.forward(x)
    loss, grads = model.loss_and_grads(x, y)
    rows_logits, rows_loss, rows_grads = [], [], []
    for b in range(cfg.batch_size):
        rows_logits.append(model.forward(x[b:b + 1]))
        l, g = model.loss_and_grads(x[b:b + 1], y[b:b + 1])
        rows_loss.append(to_numpy(l))
        rows_grads.append(g)
    # Every row has the same token count, so the batch loss and gradient are means over rows.
    mean_loss = np.mean(rows_loss, dtype=np.float64)
    grad_err = max(_rel_err(grads[k], np.mean([to_numpy(g[k]) for g in rows_grads], axis=0, dtype=np.float64))
                   for k in grads)
    return _frame([
        _row("batch vs row-by-row logits (float32)", _rel_err(logits, xp.concatenate(rows_logits)), tol_logits, xp),
        _row("batch loss vs mean of row losses (float32)", _rel_err(loss, mean_loss), tol_logits, xp),
        _row("batch grads vs mean of row grads (float32, worst param)", grad_err, tol_grad, xp),
    ])


def closed_loop(xp=np, n_new=40, init_std=0.5, seed=0):
    """Exported weights decoded by serve.Server give token-for-token the training model's greedy decode."""
    # A wide init gives a model whose greedy output is varied and depends on the whole context; a briefly
    # trained small model just emits spaces, which would let a broken serving path pass.
    cfg = small_config(init_std=init_std)
    model = GPT(cfg, xp=xp, seed=seed)
    prompt, _ = get_batch(load_corpus(), 3, 5, step=10_000, xp=xp)  # n_new > block_size: the window slides
    ours = model.generate(prompt, n_new)
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "weights.npz")
        export_weights(path, model)
        server = Server.from_file(path, xp=xp)
    served = server.generate(prompt, n_new)
    window = ours[:, -cfg.block_size:]
    logit_err = _rel_err(server.logits(window), model.forward(window))
    # How close each greedy choice came to a tie: tiny margins would make token equality fragile.
    n0 = prompt.shape[1]
    margins = []
    for n in range(n0, n0 + n_new):
        last = np.sort(to_numpy(model.forward(ours[:, max(0, n - cfg.block_size):n])[:, -1]), axis=-1)
        margins.append(np.min(last[:, -1] - last[:, -2]))
    mismatches = int(ours.shape != served.shape) or int(np.sum(to_numpy(ours) != to_numpy(served)))
    distinct = min(len(set(to_numpy(r[n0:]).tolist())) for r in ours)
    return _frame([
        _row(f"closed loop: serve vs training greedy decode, {n_new} tokens x {prompt.shape[0]} rows "
             "(mismatching tokens)", mismatches, 0, xp, min_top2_margin=float(np.min(margins)),
             min_distinct_tokens=distinct),
        _row("closed loop: serve vs training logits (float32)", logit_err, 1e-5, xp),
    ])


def get_batch_checks(xp=np, world=4, steps=3):
    """get_batch is deterministic, and rank slices of a world concatenate to the single-process global batch."""
    data = load_corpus()
    bad_det = bad_split = 0
    for step in range(steps):
        a = [to_numpy(t) for t in get_batch(data, 4, 32, step, seed=7, xp=xp)]
        b = [to_numpy(t) for t in get_batch(data, 4, 32, step, seed=7, xp=xp)]
        bad_det += int(any((u != v).any() for u, v in zip(a, b)))
        gx, gy = (to_numpy(t) for t in get_batch(data, 4 * world, 32, step, seed=7, xp=xp))
        parts = [[to_numpy(t) for t in get_batch(data, 4, 32, step, seed=7, xp=xp, rank=r, world=world)]
                 for r in range(world)]
        bad_split += int(not np.array_equal(np.concatenate([p[0] for p in parts]), gx))
        bad_split += int(not np.array_equal(np.concatenate([p[1] for p in parts]), gy))
    return _frame([_row("get_batch determinism (mismatching steps)", bad_det, 0, xp),
                   _row(f"get_batch rank split, world={world} (mismatches)", bad_split, 0, xp)])


# ---------------------------------------------------------------------------------------------------------
# Fused kernels against their NumPy formulas, and the fused model against the unfused one


def _fused_cases(dtype, large=False):
    """(name, fn, inputs) for every array-level fused op, on odd shapes (T not a multiple of 32, C not a
    multiple of 32, vocab rows longer than a warp's stride); large=True adds rows of the reference model's sizes.
    Every array an op reads is one of its inputs (they are moved to the device), never captured by fn."""
    rng = np.random.default_rng(5)
    B, T, H, D, F, V = (4, 300, 6, 64, 1536, 256) if large else (2, 37, 2, 5, 24, 300)
    C = H * D
    N = B * T

    def n(*shape):
        return rng.standard_normal(shape).astype(dtype)

    x, w, b = n(N, C), 1 + 0.1 * n(C), n(C)
    y, mean, rstd = fused.layer_norm_fwd(x, w, b, 1e-5)
    x9, w9 = n(9, 1000), 1 + 0.1 * n(1000)
    stats9 = fused.layer_norm_fwd(x9, w9, n(1000), 1e-5)[1:]
    x1, w1 = n(1, 37), 1 + 0.1 * n(37)
    stats1 = fused.layer_norm_fwd(x1, w1, n(37), 1e-5)[1:]
    idx = rng.integers(0, V, size=(B, T))
    z = 3 * n(N, V)
    t = rng.integers(0, V, size=N)
    _, m, se = fused.ce_fwd(z, t)
    scale = 1.0 / math.sqrt(D)
    p = fused.causal_softmax(n(B, H, T, T), scale)
    p_short = fused.causal_softmax(n(B, H, 5, T), scale)
    return [
        ("layer_norm_fwd", lambda *a: fused.layer_norm_fwd(*a, 1e-5), [x, w, b]),
        ("layer_norm_fwd, rows of 1000", lambda *a: fused.layer_norm_fwd(*a, 1e-5),
         [n(9, 1000), n(1000), n(1000)]),
        ("layer_norm_bwd", lambda *a: fused.layer_norm_bwd(*a, None), [n(N, C), x, w, mean, rstd]),
        ("layer_norm_bwd adding into a gradient", fused.layer_norm_bwd, [n(N, C), x, w, mean, rstd, n(N, C)]),
        ("layer_norm_bwd, rows of 1000", lambda *a: fused.layer_norm_bwd(*a, None), [n(9, 1000), x9, w9, *stats9]),
        ("layer_norm_bwd_sum (and dx's column sums)", lambda *a: fused.layer_norm_bwd_sum(*a, None),
         [n(N, C), x, w, mean, rstd]),
        ("layer_norm_bwd_sum adding into a gradient", fused.layer_norm_bwd_sum, [n(N, C), x, w, mean, rstd, n(N, C)]),
        ("layer_norm_bwd, one row", lambda *a: fused.layer_norm_bwd(*a, None), [n(1, 37), x1, w1, *stats1]),
        ("colsum, many rows (128 row groups, fewer columns than a block)", fused.colsum, [n(1100, 7)]),
        ("colsum, few rows (2 row groups)", fused.colsum, [n(20, 5)]),
        ("colsum, one row", fused.colsum, [n(1, 37)]),
        ("colsum, 37 rows of 70 (4 row groups, a partial block)", fused.colsum, [n(37, 70)]),
        ("colsum, reference rows" if large else "colsum, 300 rows", fused.colsum, [n(N if large else 300, F)]),
        ("bias_gelu", fused.bias_gelu, [3 * n(N, F), n(F)]),
        ("bias_gelu_bwd (and the bias's gradient)", fused.bias_gelu_bwd, [n(N, F), 3 * n(N, F), n(F)]),
        ("bias_gelu_bwd, one row", fused.bias_gelu_bwd, [n(1, 37), 3 * n(1, 37), n(37)]),
        ("bias_residual", fused.bias_residual, [n(N, C), n(N, C), n(C)]),
        ("residual_layer_norm_fwd", lambda *a: fused.residual_layer_norm_fwd(*a, 1e-5), [n(N, C), n(N, C), n(C), w, b]),
        ("residual_layer_norm_fwd, rows of 1000", lambda *a: fused.residual_layer_norm_fwd(*a, 1e-5),
         [n(9, 1000), n(9, 1000), n(1000), w9, n(1000)]),
        ("residual_layer_norm_fwd, one row", lambda *a: fused.residual_layer_norm_fwd(*a, 1e-5),
         [n(1, 37), n(1, 37), n(37), w1, n(37)]),
        ("embed_fwd (T < block)", fused.embed_fwd, [n(V, C), n(T + 3, C), idx]),
        ("onehot_t", lambda i: fused.onehot_t(i, V, dtype), [idx]),
        ("rows_to_heads, q k v plus bias", lambda a, bias: _flat(fused.rows_to_heads(a, bias, H, 3)),
         [n(B, T, 3 * C), n(3 * C)]),
        ("rows_to_heads, one part", lambda a: _flat(fused.rows_to_heads(a, None, H, 1)), [n(B, T, C)]),
        ("heads_to_rows, one part", lambda a: fused.heads_to_rows([a], [False]), [n(B, H, T, D)]),
        ("heads_to_rows, three parts, two transposed", lambda a0, a1, a2: fused.heads_to_rows(
            [a0, a1, a2], [False, True, True]), [n(B, H, T, D), n(B, H, D, T), n(B, H, D, T)]),
        ("causal_softmax", lambda s: fused.causal_softmax(s, scale), [n(B, H, T, T)]),
        ("causal_softmax, fewer queries than keys", lambda s: fused.causal_softmax(s, scale), [n(B, H, 5, T)]),
        ("causal_softmax_bwd", lambda pp, dp: fused.causal_softmax_bwd(pp, dp, scale), [p, n(B, H, T, T)]),
        ("causal_softmax_bwd, fewer queries", lambda pp, dp: fused.causal_softmax_bwd(pp, dp, scale),
         [p_short, n(B, H, 5, T)]),
        ("ce_fwd", fused.ce_fwd, [z, t]),
        ("ce_bwd", fused.ce_bwd, [z, t, m, se, np.asarray(0.7, dtype=dtype)]),
    ]


# Rounding only: exp/tanh/sqrt differ by an ulp or two between libm and CUDA, sums run in other orders, and nvcc
# contracts a * b + c into one FMA. A wrong index or mask gives errors of order 1.
def _flat(pairs):
    return tuple(a for pair in pairs for a in pair)


FUSED_TOL = {"float32": 1e-5, "float64": 1e-12}


def fused_kernel_parity(xp=np, dtype="float32", large=False, tol=None, on_device=contextlib.nullcontext):
    """Each fused op on xp (CuPy: its kernel) against its NumPy formulas: max relative error of every output.

    On NumPy both sides are the formulas (the check is trivial there); `on_device` wraps the xp side, so the
    CPU tests can run the kernels through an emulator.
    """
    tol = FUSED_TOL[dtype] if tol is None else tol
    rows = []
    for name, fn, inputs in _fused_cases(dtype, large):
        ref = fn(*[a.copy() for a in inputs])           # copies: two of the ops write into an input
        with on_device():
            out = fn(*[xp.array(a) for a in inputs])
        ref, out = (r if isinstance(r, tuple) else (r,) for r in (ref, out))
        err = max(_rel_err(o, r) for o, r in zip(out, ref))
        rows.append(_row(f"fused {name} {dtype}{' large' if large else ''} vs NumPy", err, tol, xp))
    return _frame(rows)


def adamw_bitwise(xp=np, dtype="float32", large=False, on_device=contextlib.nullcontext, steps=3):
    """The foreach AdamW update (tapegpt.fused.adamw; on CuPy one kernel) against its NumPy formulas over a few
    steps: elements of p, m and v whose bits differ (the kernel rounds each operation as NumPy does: 0)."""
    rng = np.random.default_rng(11)
    size = (1 << 21) + 5 if large else 777           # not a multiple of a block; large: a grid of 8193 blocks
    n_decay = size // 3
    lr, (b1, b2), eps, wd = 1e-2, (0.9, 0.95), 1e-8, 0.1
    p, m, g = (rng.standard_normal(size).astype(dtype) for _ in range(3))
    v = (rng.standard_normal(size) ** 2 * 1e-3).astype(dtype)
    ref, out = [p, m, v], [xp.array(a) for a in (p, m, v)]
    for t in range(1, steps + 1):
        gt = (g * rng.uniform(0.5, 2.0, size)).astype(dtype)
        hyper = (n_decay, 1.0 - lr * wd, b1, b2, lr / (1.0 - b1 ** t), math.sqrt(1.0 - b2 ** t), eps)
        ref[1:] = fused.adamw_formulas(*ref, gt, *hyper)
        with on_device():
            out[1:] = fused.adamw(*out, xp.array(gt), *hyper)
    bits = np.uint32 if np.dtype(dtype).itemsize == 4 else np.uint64
    differ = sum(int(np.count_nonzero(to_numpy(o).view(bits) != r.view(bits))) for o, r in zip(out, ref))
    return _frame([_row(f"fused adamw {dtype}{' large' if large else ''} vs NumPy, {steps} steps (elements whose "
                        f"bits differ)", differ, 0, xp)])


def loss_curve_drift(xp=np, cfg=None, steps=50, lr=3e-4, seed=0):
    """Train the fused and the unfused model side by side (same init, batches, foreach AdamW): one row per step.

    Their math is the same, so the curves differ by floating-point rounding only; this says by how much.
    """
    cfg = cfg or GPTConfig()
    data = load_corpus()
    losses = {}
    for f in (False, True):
        model = GPT(cfg, xp=xp, seed=seed, fused=f)
        losses[f] = [float(v) for v in train(model, AdamW(model.params, lr=lr, fused=f), data, steps, seed=seed)]
    return _frame([dict(step=i, loss_unfused=a, loss_fused=b, rel_diff=abs(a - b) / abs(a), xp=xp.__name__,
                        dtype=cfg.dtype) for i, (a, b) in enumerate(zip(losses[False], losses[True]))])


def fused_vs_unfused(xp=np, steps=20, tol=1e-4):
    """The small float32 model's loss curve, fused vs unfused: worst relative difference over `steps` steps."""
    df = loss_curve_drift(xp, small_config(), steps=steps, lr=1e-3)
    return _frame([_row(f"fused vs unfused loss curve, {steps} steps float32 (max rel diff)", df.rel_diff.max(),
                        tol, xp, final_rel_diff=float(df.rel_diff.iloc[-1]))])


def run_all(xp=np, with_torch=True, progress=None):
    """Every check in one tidy frame (check, measured, threshold, passed, xp). `progress` wraps the list of checks
    as they run (e.g. tqdm.auto.tqdm, for a progress bar)."""
    import pandas as pd
    todo = [lambda: grad_check_all(xp).rename(columns={"max_rel_err": "measured", "tol": "threshold"}),
            lambda: matmul_reference(xp), lambda: fp32_vs_fp64(xp), lambda: overfit(xp),
            lambda: checkpoint_roundtrip(xp), lambda: batch_consistency(xp), lambda: closed_loop(xp),
            lambda: get_batch_checks(xp), lambda: fused_kernel_parity(xp, "float64"),
            lambda: fused_kernel_parity(xp, "float32"), lambda: adamw_bitwise(xp, "float64"),
            lambda: adamw_bitwise(xp, "float32"), lambda: fused_vs_unfused(xp)]
    if with_torch:
        todo += [lambda d=dtype, f=f: torch_parity(d, fused=f) for dtype in ("float64", "float32") for f in (False, True)]
        todo.append(adamw_isolated_parity)
    return pd.concat([check() for check in (progress or iter)(todo)], ignore_index=True)


def main(argv=None):
    """python -m tapegpt.checks [--gpu] [--out CSV]: the workload's gate (NumPy, or CuPy with --gpu) as one table.

    The lab's `python -m xlab.correctness` adds the bitwise transparency gate across allocators and provenance.
    """
    import argparse
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--gpu", action="store_true", help="run the checks on CuPy (PyTorch parity runs on the CPU only)")
    ap.add_argument("--out", default=None, help="CSV to write")
    args = ap.parse_args(argv)
    if args.gpu:
        import cupy
        df = run_all(cupy, with_torch=False)
    else:
        df = run_all(np)
    print(df[["check", "measured", "threshold", "passed"]].to_string(index=False))
    if args.out:
        df.to_csv(args.out, index=False)
    return 0 if df.passed.all() else 1


if __name__ == "__main__":
    raise SystemExit(main())
