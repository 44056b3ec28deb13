"""Inference from exported weights: plain xp code with a KV cache, sharing nothing with the tape."""
import math

import numpy as np

from .checkpoint import load_weights


class Server:
    """Greedy decoder over exported weights; an independent implementation to close the loop with training."""

    def __init__(self, cfg, weights, xp=np):
        self.cfg, self.xp = cfg, xp
        self.w = {k: xp.asarray(v) for k, v in weights.items()}

    @classmethod
    def from_file(cls, path, xp=np):
        """Load a file written by checkpoint.export_weights."""
        cfg, weights = load_weights(path)
        return cls(cfg, weights, xp)

    def _ln(self, x, name):
        mu = x.mean(axis=-1, keepdims=True)
        var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
        return (x - mu) / self.xp.sqrt(var + self.cfg.ln_eps) * self.w[name + ".w"] + self.w[name + ".b"]

    def _attend(self, q, k, v, past):
        """Queries at positions past.. attend to all cached keys plus the causal part of their own."""
        xp = self.xp
        s = xp.matmul(q, k.swapaxes(-1, -2)) / math.sqrt(q.shape[-1])
        n_q, n_k = q.shape[-2], k.shape[-2]
        if n_q > 1:
            visible = xp.arange(n_k)[None, :] <= xp.arange(n_q)[:, None] + past
            s = xp.where(visible, s, s.dtype.type(-np.inf))
        s = xp.exp(s - s.max(axis=-1, keepdims=True))
        return xp.matmul(s / s.sum(axis=-1, keepdims=True), v)

    def _run(self, idx, past, cache, last_only=True):
        """Logits for tokens idx (B, L) at positions past..past+L-1, and the extended per-layer (K, V) cache."""
        xp, cfg, w = self.xp, self.cfg, self.w
        B, L = idx.shape
        H = cfg.n_head
        D = cfg.n_embd // H
        x = w["wte"][idx] + w["wpe"][past:past + L]
        new_cache = []
        for i in range(cfg.n_layer):
            p = f"h.{i}."
            qkv = self._ln(x, p + "ln_1") @ w[p + "attn.c_attn.w"] + w[p + "attn.c_attn.b"]
            q, k, v = (t.reshape(B, L, H, D).transpose(0, 2, 1, 3) for t in xp.split(qkv, 3, axis=-1))
            if cache is not None:
                k = xp.concatenate([cache[i][0], k], axis=2)
                v = xp.concatenate([cache[i][1], v], axis=2)
            new_cache.append((k, v))
            y = self._attend(q, k, v, past).transpose(0, 2, 1, 3).reshape(B, L, cfg.n_embd)
            x = x + y @ w[p + "attn.c_proj.w"] + w[p + "attn.c_proj.b"]
            h = self._ln(x, p + "ln_2") @ w[p + "mlp.c_fc.w"] + w[p + "mlp.c_fc.b"]
            h = 0.5 * h * (1.0 + xp.tanh(math.sqrt(2.0 / math.pi) * (h + 0.044715 * h ** 3)))
            x = x + h @ w[p + "mlp.c_proj.w"] + w[p + "mlp.c_proj.b"]
        if last_only:
            x = x[:, -1:]
        return self._ln(x, "ln_f") @ w["lm_head.w"], new_cache

    def logits(self, idx):
        """Full logits (B, T, vocab) for idx, no cache."""
        return self._run(self.xp.asarray(idx), 0, None, last_only=False)[0]

    def generate(self, idx, n_new):
        """Append n_new greedy tokens to idx (B, T0); once the window is full it slides and is recomputed."""
        xp, bs = self.xp, self.cfg.block_size
        out = xp.asarray(idx)
        ctx = out[:, -bs:]
        logits, cache = self._run(ctx, 0, None)
        pos = ctx.shape[1]
        for n in range(n_new):
            nxt = xp.argmax(logits[:, -1], axis=-1).astype(out.dtype).reshape(-1, 1)
            out = xp.concatenate([out, nxt], axis=1)
            if n == n_new - 1:
                break
            if pos < bs:
                logits, cache = self._run(nxt, pos, cache)
                pos += 1
            else:
                # Positions shift when the window slides, so cached keys are stale: recompute the window.
                logits, cache = self._run(out[:, -bs:], 0, None)
        return out
