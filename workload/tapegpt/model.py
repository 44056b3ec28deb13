"""GPT-2-style decoder (pre-norm, learned positions, tanh GELU) on the tape."""
import math
from dataclasses import asdict, dataclass

import numpy as np

from . import fused as fused_ops
from . import tape
from .tape import Tensor


@dataclass
class GPTConfig:
    """Model and batch shape; the defaults are the reference benchmark configuration."""

    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 384
    n_ffn: int = 1536
    block_size: int = 256
    vocab_size: int = 256
    batch_size: int = 32
    dtype: str = "float32"
    ln_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if np.dtype(self.dtype) not in (np.float32, np.float64):
            raise ValueError(f"dtype must be float32 or float64, got {self.dtype!r}")

    def to_dict(self):
        """Plain dict, for JSON metadata in checkpoints."""
        return asdict(self)


def param_shapes(cfg):
    """Ordered name -> shape of every parameter; the order fixes both init and checkpoint layout."""
    c, f = cfg.n_embd, cfg.n_ffn
    shapes = {"wte": (cfg.vocab_size, c), "wpe": (cfg.block_size, c)}
    for i in range(cfg.n_layer):
        p = f"h.{i}."
        shapes.update({
            p + "ln_1.w": (c,), p + "ln_1.b": (c,),
            p + "attn.c_attn.w": (c, 3 * c), p + "attn.c_attn.b": (3 * c,),
            p + "attn.c_proj.w": (c, c), p + "attn.c_proj.b": (c,),
            p + "ln_2.w": (c,), p + "ln_2.b": (c,),
            p + "mlp.c_fc.w": (c, f), p + "mlp.c_fc.b": (f,),
            p + "mlp.c_proj.w": (f, c), p + "mlp.c_proj.b": (c,),
        })
    shapes.update({"ln_f.w": (c,), "ln_f.b": (c,), "lm_head.w": (c, cfg.vocab_size)})
    return shapes


def init_params(cfg, seed=0):
    """GPT-2 init on the host (NumPy, float64 draws then cast) so every device starts from the same bits."""
    rng = np.random.default_rng(seed)
    proj_std = cfg.init_std / math.sqrt(2 * cfg.n_layer)  # GPT-2: residual projections scaled by depth
    params = {}
    for name, shape in param_shapes(cfg).items():
        if name.endswith(("ln_1.w", "ln_2.w", "ln_f.w")):
            a = np.ones(shape)
        elif name.endswith(".b"):
            a = np.zeros(shape)
        else:
            a = rng.normal(0.0, proj_std if name.endswith("c_proj.w") else cfg.init_std, size=shape)
        params[name] = a.astype(cfg.dtype)
    return params


def gpt_logits(cfg, P, idx, fused=False):
    """Logits (B, T, vocab) from parameter tensors P (name -> Tensor) and token ids idx (B, T).

    fused=True builds the same model from tapegpt.fused's ops: six tape nodes per layer and a few kernels each.
    """
    B, T = idx.shape
    if T > cfg.block_size:
        raise ValueError(f"sequence length {T} exceeds block_size {cfg.block_size}")
    if fused:
        return _gpt_logits_fused(cfg, P, idx)
    H, C = cfg.n_head, cfg.n_embd
    D = C // H
    x = tape.add(tape.embedding(P["wte"], idx), tape.narrow(P["wpe"], 0, 0, T))
    for i in range(cfg.n_layer):
        p = f"h.{i}."
        h = tape.layer_norm(x, P[p + "ln_1.w"], P[p + "ln_1.b"], cfg.ln_eps)
        qkv = tape.linear(h, P[p + "attn.c_attn.w"], P[p + "attn.c_attn.b"])
        q, k, v = (tape.transpose(tape.reshape(t, (B, T, H, D)), (0, 2, 1, 3)) for t in tape.split(qkv, 3))
        y = tape.causal_attention(q, k, v)
        y = tape.reshape(tape.transpose(y, (0, 2, 1, 3)), (B, T, C))
        x = tape.add(x, tape.linear(y, P[p + "attn.c_proj.w"], P[p + "attn.c_proj.b"]))
        h = tape.layer_norm(x, P[p + "ln_2.w"], P[p + "ln_2.b"], cfg.ln_eps)
        h = tape.gelu(tape.linear(h, P[p + "mlp.c_fc.w"], P[p + "mlp.c_fc.b"]))
        x = tape.add(x, tape.linear(h, P[p + "mlp.c_proj.w"], P[p + "mlp.c_proj.b"]))
    x = tape.layer_norm(x, P["ln_f.w"], P["ln_f.b"], cfg.ln_eps)
    return tape.linear(x, P["lm_head.w"])


def _gpt_logits_fused(cfg, P, idx):
    f = fused_ops
    x = f.embed(P["wte"], P["wpe"], idx)
    h = f.layer_norm(x, P["h.0.ln_1.w"], P["h.0.ln_1.b"], cfg.ln_eps)
    for i in range(cfg.n_layer):
        p = f"h.{i}."
        # Each residual add also computes the layer norm that reads its result: the next layer's ln_1, or ln_f.
        nxt = f"h.{i + 1}.ln_1." if i + 1 < cfg.n_layer else "ln_f."
        y = f.attention(h, P[p + "attn.c_attn.w"], P[p + "attn.c_attn.b"], cfg.n_head)
        x, h = f.linear_residual(x, y, P[p + "attn.c_proj.w"], P[p + "attn.c_proj.b"],
                                 (P[p + "ln_2.w"], P[p + "ln_2.b"], cfg.ln_eps))
        h = f.linear_gelu(h, P[p + "mlp.c_fc.w"], P[p + "mlp.c_fc.b"])
        x, h = f.linear_residual(x, h, P[p + "mlp.c_proj.w"], P[p + "mlp.c_proj.b"],
                                 (P[nxt + "w"], P[nxt + "b"], cfg.ln_eps))
    return tape.matmul(h, P["lm_head.w"])


class GPT:
    """The training model: parameters live in `params` (name -> xp array), gradients come from the tape.

    fused: build the step from tapegpt.fused's ops (default: tapegpt.fused.enabled, env TAPEGPT_FUSED) or
    from the unfused ops of tapegpt.tape; the same math either way, up to floating-point rounding.
    """

    def __init__(self, cfg, xp=np, seed=0, fused=None):
        self.cfg, self.xp, self.seed = cfg, xp, seed
        self.fused = fused_ops.enabled if fused is None else bool(fused)
        self.params = {k: xp.asarray(v) for k, v in init_params(cfg, seed).items()}

    def num_params(self):
        """Total number of scalars in the parameters."""
        return sum(int(np.prod(a.shape)) for a in self.params.values())

    def _tensors(self, requires_grad):
        return {k: Tensor(v, requires_grad) for k, v in self.params.items()}

    def forward(self, idx):
        """Logits (B, T, vocab) as an xp array; no tape is recorded."""
        return gpt_logits(self.cfg, self._tensors(False), idx, self.fused).data

    def loss_tensor(self, P, x, y):
        """The mean cross-entropy as a tape tensor over parameter tensors P (before its backward)."""
        ce = fused_ops.cross_entropy if self.fused else tape.cross_entropy
        return ce(gpt_logits(self.cfg, P, x, self.fused), y)

    def loss(self, x, y):
        """Mean cross-entropy as a 0-d xp array, without a tape (for evaluation)."""
        return self.loss_tensor(self._tensors(False), x, y).data

    def loss_and_grads(self, x, y):
        """(loss, grads): 0-d loss array and name -> gradient array, one forward and one backward pass."""
        P = self._tensors(True)
        loss = self.loss_tensor(P, x, y)
        value = loss.data
        loss.backward()
        xp = self.xp
        # Every parameter is used, but keep zeros for safety rather than a None the optimizer can't use.
        return value, {k: (t.grad if t.grad is not None else xp.zeros_like(t.data)) for k, t in P.items()}

    def generate(self, idx, n_new):
        """Greedy decode: append n_new argmax tokens to idx (B, T0), recomputing the cropped window each step."""
        xp = self.xp
        for _ in range(n_new):
            logits = self.forward(idx[:, -self.cfg.block_size:])
            nxt = xp.argmax(logits[:, -1, :], axis=-1).astype(idx.dtype)
            idx = xp.concatenate([idx, nxt.reshape(-1, 1)], axis=1)
        return idx
