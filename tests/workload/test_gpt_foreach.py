"""foreach AdamW: one flat buffer, bit-identical to the per-parameter update, checkpoints included."""
import numpy as np
import pytest

from tapegpt import AdamW, GPT, get_batch, load_checkpoint, load_corpus, save_checkpoint
from tapegpt.checks import params_sha256, small_config


def train(foreach, steps, dtype="float32", lr=None, opt_state=None):
    cfg = small_config(dtype=dtype)
    model = GPT(cfg, xp=np, seed=0)
    opt = AdamW(model.params, lr=1e-2, weight_decay=0.1, foreach=foreach)
    data = load_corpus()
    losses = []
    for i in range(steps):
        x, y = get_batch(data, cfg.batch_size, cfg.block_size, i, xp=np)
        loss, grads = model.loss_and_grads(x, y)
        opt.step(grads, lr=lr)
        losses.append(float(loss))
    return model, opt, losses


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_foreach_is_bit_identical_to_per_parameter(dtype):
    m1, o1, l1 = train(False, 6, dtype)
    m2, o2, l2 = train(True, 6, dtype)
    assert l1 == l2
    assert params_sha256(m1.params) == params_sha256(m2.params)
    for k in m1.params:
        assert o1.m[k].tobytes() == o2.m[k].tobytes() and o1.v[k].tobytes() == o2.v[k].tobytes()


def test_foreach_params_are_views_of_one_buffer():
    model, opt, _ = train(True, 1)
    assert all(np.shares_memory(p, opt._flat) for p in model.params.values())
    assert opt._flat.size == sum(p.size for p in model.params.values())


def test_foreach_checkpoint_resumes_identically(tmp_path):
    cfg = small_config()
    data = load_corpus()

    def steps(model, opt, a, b):
        out = []
        for i in range(a, b):
            x, y = get_batch(data, cfg.batch_size, cfg.block_size, i, xp=np)
            loss, grads = model.loss_and_grads(x, y)
            opt.step(grads)
            out.append(float(loss))
        return out

    model = GPT(cfg, xp=np, seed=0)
    opt = AdamW(model.params, lr=1e-2, foreach=True)
    straight = steps(model, opt, 0, 6)
    model2 = GPT(cfg, xp=np, seed=0)
    opt2 = AdamW(model2.params, lr=1e-2, foreach=True)
    first = steps(model2, opt2, 0, 3)
    save_checkpoint(tmp_path / "c.npz", model2, opt2, 3)
    model3 = GPT(cfg, xp=np, seed=1)                  # other weights: the load must overwrite them
    opt3 = AdamW(model3.params, lr=1e-2, foreach=True)
    assert load_checkpoint(tmp_path / "c.npz", model3, opt3) == 3
    assert first + steps(model3, opt3, 3, 6) == straight
    assert params_sha256(model3.params) == params_sha256(model.params)
