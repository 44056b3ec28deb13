"""PyTorch (CPU) parity: logits, loss, every gradient, and AdamW training steps, for both forms of the model."""
import pytest
import torch

from tapegpt import checks


def _assert_all_passed(df):
    assert df.passed.all(), "\n" + df[~df.passed].to_string()


FORMS = pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])


@FORMS
def test_torch_parity_float64(fused):
    # Tolerances: logits/loss 1e-11 and gradients 1e-9 relative; measured ~1e-16..1e-15.
    df = checks.torch_parity("float64", fused=fused)
    assert len(df) == 2 + len(checks.GPT(checks.small_config()).params) + 2
    assert df.check.str.contains("unfused" if not fused else " fused").all()
    _assert_all_passed(df)


@FORMS
def test_torch_parity_float32(fused):
    # Tolerances: logits 2e-5, loss 2e-6, gradients 2e-4 relative; AdamW param drift 2e-2 lr (see TORCH_TOL).
    _assert_all_passed(checks.torch_parity("float32", fused=fused))


def test_adamw_matches_torch_with_identical_gradients():
    _assert_all_passed(checks.adamw_isolated_parity())


def test_parity_check_detects_a_different_model():
    # The torch reference must be able to disagree: perturb one torch weight and the logits move past tolerance.
    cfg = checks.small_config(dtype="float64")
    model = checks.GPT(cfg, seed=0)
    x, _ = checks.get_batch(checks.load_corpus(), 2, cfg.block_size, step=0)
    P = {k: torch.tensor(v) for k, v in model.params.items()}
    P["h.1.mlp.c_fc.b"] = P["h.1.mlp.c_fc.b"] + 1e-3
    err = checks._rel_err(model.forward(x), checks.torch_logits(cfg, P, torch.from_numpy(x)).numpy())
    assert err > checks.TORCH_TOL["float64"]["logits"] * 1e3
