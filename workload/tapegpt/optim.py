"""AdamW with decoupled weight decay, the same update as torch.optim.AdamW (non-amsgrad)."""
import math

from . import fused as fused_ops
from .tape import array_module


def default_decay(name, shape):
    """nanoGPT's rule: decay matrices and embeddings, never biases or layer-norm gains."""
    return len(shape) >= 2


class AdamW:
    """Updates the arrays of `params` (name -> xp array) in place; the step count stays on the host.

    foreach=True (the default) updates every parameter at once, as torch's foreach AdamW does: the parameters are
    packed into one flat buffer (the dict's arrays become views of it, decayed ones first) and a step is the
    gradients' concatenation and one update of the buffer, with bit-identical results (the same arithmetic on
    every element). The update is one kernel on CuPy (tapegpt.fused.adamw, bit-identical to the array code)
    unless fused=False (default tapegpt.fused.enabled, env TAPEGPT_FUSED): then a dozen array ops.
    foreach=False is the per-parameter loop (the workload as first measured; `fused` does not apply).
    """

    def __init__(self, params, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, decay=default_decay,
                 foreach=True, fused=None):
        self.params = params
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay
        # Names whose parameters get weight decay; fixed at construction so checkpoints can record it.
        self.decay = {k for k, p in params.items() if decay(k, p.shape)}
        self.t = 0
        self.foreach = foreach
        self.fused = fused_ops.enabled if fused is None else bool(fused)
        if foreach:
            self._pack()
        else:
            self.m = {k: array_module(p).zeros_like(p) for k, p in params.items()}
            self.v = {k: array_module(p).zeros_like(p) for k, p in params.items()}

    # --- foreach: one flat buffer

    def _pack(self):
        xp = array_module(next(iter(self.params.values())))
        order = sorted(self.params, key=lambda k: k not in self.decay)       # decayed first: one slice
        self._span, off = {}, 0
        for k in order:
            self._span[k] = (off, off + self.params[k].size)
            off += self.params[k].size
        self._n_decay = sum(self.params[k].size for k in self.decay)
        self._flat = xp.concatenate([self.params[k].ravel() for k in order])
        for k in list(self.params):
            self.params[k] = self._view(self._flat, k)
        self._m, self._v = xp.zeros_like(self._flat), xp.zeros_like(self._flat)
        self._order = order

    def _view(self, flat, k):
        a, b = self._span[k]
        return flat[a:b].reshape(self.params[k].shape)

    def __getattr__(self, name):
        # foreach keeps the moments flat; per-name views for state_dict() and callers that read opt.m / opt.v
        if name in ("m", "v") and self.__dict__.get("foreach"):
            flat = self._m if name == "m" else self._v
            return {k: self._view(flat, k) for k in self.params}
        raise AttributeError(name)

    def _step_foreach(self, grads, lr, step_size, bc2_sqrt):
        xp = array_module(self._flat)
        g = xp.concatenate([grads[k].ravel() for k in self._order])
        update = fused_ops.adamw if self.fused else fused_ops.adamw_formulas
        self._m, self._v = update(self._flat, self._m, self._v, g, self._n_decay if self.weight_decay else 0,
                                  1.0 - lr * self.weight_decay, *self.betas, step_size, bc2_sqrt, self.eps)

    def step(self, grads, lr=None):
        """One update from grads (name -> array). `lr` overrides the learning rate for this step only."""
        lr = self.lr if lr is None else lr
        b1, b2 = self.betas
        self.t += 1
        # Bias corrections are host floats computed from the host step count: no device round trip.
        step_size = lr / (1.0 - b1 ** self.t)
        bc2_sqrt = math.sqrt(1.0 - b2 ** self.t)
        if self.foreach:
            self._step_foreach(grads, lr, step_size, bc2_sqrt)
            return
        for k, p in self.params.items():
            g = grads[k]
            m, v = self.m[k], self.v[k]
            # Fresh arrays for the moments (as a framework's out-of-place ops would allocate).
            m = b1 * m + (1.0 - b1) * g
            v = b2 * v + (1.0 - b2) * (g * g)
            self.m[k], self.v[k] = m, v
            if self.weight_decay and k in self.decay:
                p *= 1.0 - lr * self.weight_decay
            p -= step_size * (m / (array_module(v).sqrt(v) / bc2_sqrt + self.eps))   # sqrt: see fused.adamw_formulas

    def state_dict(self):
        """Hyper-parameters, step count and moments (moments as xp arrays, copies: foreach updates its in place)."""
        copy = self.foreach
        return {"lr": self.lr, "betas": list(self.betas), "eps": self.eps, "weight_decay": self.weight_decay,
                "decay": sorted(self.decay), "t": self.t, "m": {k: a.copy() if copy else a for k, a in self.m.items()},
                "v": {k: a.copy() if copy else a for k, a in self.v.items()}}

    def load_state_dict(self, state):
        """Restore what state_dict() returned (moments are taken as given, not copied)."""
        if set(state["m"]) != set(self.params):
            raise ValueError("optimizer state does not match the parameter names")
        self.lr, self.betas, self.eps = state["lr"], tuple(state["betas"]), state["eps"]
        if self.foreach and set(state["decay"]) != self.decay:
            raise ValueError("a foreach AdamW packs its parameters by decay: the state's decay set must match")
        self.weight_decay, self.decay, self.t = state["weight_decay"], set(state["decay"]), int(state["t"])
        if self.foreach:
            for k in self.params:   # copy into the flat moments
                self._view(self._m, k)[...] = state["m"][k]
                self._view(self._v, k)[...] = state["v"][k]
        else:
            self.m, self.v = dict(state["m"]), dict(state["v"])
