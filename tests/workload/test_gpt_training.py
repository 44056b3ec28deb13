"""Training-level behaviour on NumPy: overfit, checkpoints, batch consistency, serving, data, API."""
import dataclasses

import numpy as np
import pytest

import tapegpt as gpt
from tapegpt import AdamW, GPT, GPTConfig, Server, checks, get_batch, load_corpus
from tapegpt import bench, data as data_mod


def _assert_all_passed(df):
    assert df.passed.all(), "\n" + df[~df.passed].to_string()


@pytest.fixture(scope="module")
def corpus():
    return load_corpus()


def test_reference_config_defaults():
    cfg = GPTConfig()
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.n_ffn) == (12, 12, 384, 1536)
    assert (cfg.block_size, cfg.vocab_size, cfg.batch_size, cfg.dtype) == (256, 256, 32, "float32")
    assert GPT(GPTConfig(n_layer=1), seed=0).num_params() > 0


def test_config_validation():
    with pytest.raises(ValueError):
        GPTConfig(n_embd=30, n_head=4)
    with pytest.raises(ValueError):
        GPTConfig(dtype="float16")


def test_public_api_names():
    for name in ["GPTConfig", "GPT", "AdamW", "load_corpus", "get_batch", "save_checkpoint", "load_checkpoint",
                 "export_weights", "Server"]:
        assert hasattr(gpt, name), name


def test_param_names_order_and_init_are_stable():
    cfg = checks.small_config()
    model = GPT(cfg, seed=0)
    names = list(model.params)
    assert names[:2] == ["wte", "wpe"] and names[-1] == "lm_head.w" and "h.0.attn.c_attn.w" in names
    assert all(model.params[k].dtype == np.float32 for k in names)
    again = GPT(cfg, seed=0)
    assert checks.params_sha256(model.params) == checks.params_sha256(again.params)
    assert checks.params_sha256(model.params) != checks.params_sha256(GPT(cfg, seed=1).params)
    # float32 init is the float64 init rounded once, so CPU and GPU start from identical bits.
    m64 = GPT(dataclasses.replace(cfg, dtype="float64"), seed=0)
    np.testing.assert_array_equal(m64.params["wte"].astype(np.float32), model.params["wte"])


def test_loss_and_grads_contract(corpus):
    cfg = checks.small_config()
    model = GPT(cfg, seed=0)
    x, y = get_batch(corpus, cfg.batch_size, cfg.block_size, 0)
    loss, grads = model.loss_and_grads(x, y)
    assert isinstance(loss, np.ndarray) and loss.shape == () and loss.dtype == np.float32
    assert abs(float(loss) - np.log(256)) < 0.2  # near-uniform predictions at init
    assert list(grads) == list(model.params)
    assert all(grads[k].shape == p.shape and grads[k].dtype == p.dtype for k, p in model.params.items())
    assert model.forward(x).shape == (cfg.batch_size, cfg.block_size, cfg.vocab_size)
    np.testing.assert_array_equal(model.loss(x, y), loss)
    with pytest.raises(ValueError):
        model.forward(np.zeros((1, cfg.block_size + 1), np.int64))


def test_training_is_bit_deterministic(corpus):
    runs = []
    for _ in range(2):
        model = GPT(checks.small_config(), seed=0)
        losses = checks.train(model, AdamW(model.params), corpus, 5)
        runs.append((b"".join(l.tobytes() for l in losses), checks.params_sha256(model.params)))
    assert runs[0] == runs[1]


def test_adamw_decay_rule_and_lr_override():
    rng = np.random.default_rng(0)
    params = {"w": rng.standard_normal((3, 3)), "b": rng.standard_normal(3)}
    opt = AdamW(params, lr=1e-2, weight_decay=0.1)
    assert opt.decay == {"w"}  # nanoGPT: no decay on biases / layer-norm gains
    before = {k: v.copy() for k, v in params.items()}
    opt.step({k: np.zeros_like(v) for k, v in params.items()}, lr=0.5)
    np.testing.assert_array_equal(params["b"], before["b"])  # zero gradient, no decay: unchanged
    np.testing.assert_allclose(params["w"], before["w"] * (1 - 0.5 * 0.1), rtol=1e-15)


def test_overfits_one_batch():
    # Threshold: loss < 0.1 after 150 AdamW steps (lr 3e-3) on one 4x16 batch; measured ~0.027 from 5.51.
    df = checks.overfit(np, steps=150, threshold=0.1)
    _assert_all_passed(df)
    assert df.initial_loss[0] > 5.0


def test_checkpoint_round_trip_and_resume_are_bit_exact():
    _assert_all_passed(checks.checkpoint_roundtrip(np))


def test_checkpoint_keeps_exact_path_and_rejects_other_configs(tmp_path):
    cfg = checks.small_config()
    model = GPT(cfg, seed=0)
    opt = AdamW(model.params)
    path = tmp_path / "ckpt"  # no extension: np.savez must not append '.npz'
    gpt.save_checkpoint(path, model, opt, step=7)
    assert path.exists() and not (tmp_path / "ckpt.npz").exists()
    params_ref = model.params["wte"]
    assert gpt.load_checkpoint(path, model) == 7
    assert model.params["wte"] is params_ref  # restored in place: optimizer references stay valid
    with pytest.raises(ValueError):
        gpt.load_checkpoint(path, GPT(dataclasses.replace(cfg, n_embd=64), seed=0))
    gpt.export_weights(tmp_path / "w", model)
    with pytest.raises(ValueError):
        gpt.load_checkpoint(tmp_path / "w", model)  # a weights export is not a checkpoint


def test_batch_equals_rows_one_by_one():
    # float32 tolerances: 1e-5 relative for logits/loss and for the mean gradient; measured <= ~4e-7.
    _assert_all_passed(checks.batch_consistency(np))


def test_float32_model_tracks_float64():
    _assert_all_passed(checks.fp32_vs_fp64(np))


def test_closed_loop_serving_matches_training_decode():
    df = checks.closed_loop(np)
    _assert_all_passed(df)
    assert df.min_top2_margin[0] > 1e-4  # no greedy choice was decided by a rounding-level tie
    assert df.min_distinct_tokens[0] >= 10  # a varied decode, so a broken path cannot match by luck


def test_generate_slides_the_window():
    cfg = checks.small_config()
    model = GPT(cfg, seed=0)
    idx = np.zeros((2, 3), np.int64)
    out = model.generate(idx, cfg.block_size + 5)
    assert out.shape == (2, 3 + cfg.block_size + 5) and out.dtype == np.int64
    np.testing.assert_array_equal(out[:, :3], idx)


@pytest.mark.parametrize("dtype,init_std,tol", [("float32", 0.02, 2e-6), ("float64", 0.5, 1e-12)])
def test_server_logits_match_model(tmp_path, corpus, dtype, init_std, tol):
    # Measured: ~2e-7 in float32, ~1e-15 in float64 (the wide float64 model exposes any formula slip).
    cfg = checks.small_config(dtype=dtype, init_std=init_std)
    model = GPT(cfg, seed=3)
    gpt.export_weights(tmp_path / "w.npz", model)
    server = Server.from_file(tmp_path / "w.npz")
    x, _ = get_batch(corpus, 2, cfg.block_size, 0)
    assert checks._rel_err(server.logits(x), model.forward(x)) < tol


def test_get_batch_determinism_and_rank_split():
    _assert_all_passed(checks.get_batch_checks(np, world=4))


def test_get_batch_shapes_shift_and_variation(corpus):
    x, y = get_batch(corpus, 8, 32, step=3, seed=1)
    assert x.shape == y.shape == (8, 32) and x.dtype == y.dtype == np.int64
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    x2, _ = get_batch(corpus, 8, 32, step=4, seed=1)
    x3, _ = get_batch(corpus, 8, 32, step=3, seed=2)
    assert not np.array_equal(x, x2) and not np.array_equal(x, x3)
    with pytest.raises(ValueError):
        get_batch(corpus, 8, 32, step=0, rank=2, world=2)


def test_corpus_is_shipped_real_and_small(corpus):
    assert corpus.dtype == np.uint8 and 1_000_000 < corpus.size <= 4 * 2**20
    assert corpus[:7].tobytes() == b"# ==== "
    assert b"def " in corpus[:200_000].tobytes()


def test_corpus_missing_gives_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="make_corpus"):
        load_corpus(tmp_path / "nope.txt")


def test_make_corpus_is_deterministic(tmp_path):
    import importlib.util
    import pathlib
    script = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "make_corpus.py"
    spec = importlib.util.spec_from_file_location("make_corpus", script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    stdlib = tmp_path / "lib"
    stdlib.mkdir()
    for name, text in [("b.py", "B = 2\n"), ("a.py", "A = 1\n"), ("_sysconfigdata_x.py", "skip\n")]:
        (stdlib / name).write_text(text)
    out = mod.build(stdlib, limit=10_000)
    assert out == b"# ==== a.py ====\nA = 1\n# ==== b.py ====\nB = 2\n"
    assert mod.build(stdlib, limit=25) == b"# ==== a.py ====\nA = 1\n"


def test_bench_cpu_smoke(capsys):
    rows = bench.main(["--cpu", "--steps", "2", "--warmup", "1"])
    assert rows[0]["allocator"] == "numpy" and rows[0]["tokens_per_s"] > 0 and np.isfinite(rows[0]["final_loss"])
    assert rows[0]["fused"] == gpt.fused.enabled and rows[0]["adamw"] == "foreach"  # the workload's defaults
    assert "tokens/s" in capsys.readouterr().out


def test_run_all_is_one_tidy_frame():
    df = checks.run_all(np, with_torch=False)
    assert {"check", "measured", "threshold", "passed", "xp"} <= set(df.columns)
    _assert_all_passed(df)
