"""AdamW with decoupled weight decay, the same update as torch.optim.AdamW (non-amsgrad)."""
import math

from .tape import array_module


def default_decay(name, shape):
    """nanoGPT's rule: decay matrices and embeddings, never biases or layer-norm gains."""
    return len(shape) >= 2


class AdamW:
    """Updates the arrays of `params` (name -> xp array) in place; the step count stays on the host."""

    def __init__(self, params, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, decay=default_decay):
        self.params = params
        self.lr, self.betas, self.eps, self.weight_decay = lr, tuple(betas), eps, weight_decay
        # Names whose parameters get weight decay; fixed at construction so checkpoints can record it.
        self.decay = {k for k, p in params.items() if decay(k, p.shape)}
        self.t = 0
        self.m = {k: array_module(p).zeros_like(p) for k, p in params.items()}
        self.v = {k: array_module(p).zeros_like(p) for k, p in params.items()}

    def step(self, grads, lr=None):
        """One update from grads (name -> array). `lr` overrides the learning rate for this step only."""
        lr = self.lr if lr is None else lr
        b1, b2 = self.betas
        self.t += 1
        # Bias corrections are host floats computed from the host step count: no device round trip.
        step_size = lr / (1.0 - b1 ** self.t)
        bc2_sqrt = math.sqrt(1.0 - b2 ** self.t)
        for k, p in self.params.items():
            g = grads[k]
            m, v = self.m[k], self.v[k]
            # Fresh arrays for the moments (as a framework's out-of-place ops would allocate).
            m = b1 * m + (1.0 - b1) * g
            v = b2 * v + (1.0 - b2) * (g * g)
            self.m[k], self.v[k] = m, v
            if self.weight_decay and k in self.decay:
                p *= 1.0 - lr * self.weight_decay
            p -= step_size * (m / (v ** 0.5 / bc2_sqrt + self.eps))

    def state_dict(self):
        """Hyper-parameters, step count and moments (moments as xp arrays)."""
        return {"lr": self.lr, "betas": list(self.betas), "eps": self.eps, "weight_decay": self.weight_decay,
                "decay": sorted(self.decay), "t": self.t, "m": dict(self.m), "v": dict(self.v)}

    def load_state_dict(self, state):
        """Restore what state_dict() returned (moments are taken as given, not copied)."""
        if set(state["m"]) != set(self.params):
            raise ValueError("optimizer state does not match the parameter names")
        self.lr, self.betas, self.eps = state["lr"], tuple(state["betas"]), state["eps"]
        self.weight_decay, self.decay, self.t = state["weight_decay"], set(state["decay"]), int(state["t"])
        self.m, self.v = dict(state["m"]), dict(state["v"])
