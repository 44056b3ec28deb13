"""Bit-exact checkpoints (weights + AdamW state + step) and weight export for serving."""
import json
import os
import pathlib

import numpy as np

from .model import GPTConfig

CKPT_FORMAT = "xpool-gpt-checkpoint-1"
WEIGHTS_FORMAT = "xpool-gpt-weights-1"


def to_numpy(a):
    """Host copy of a NumPy or CuPy array (same dtype, same bits)."""
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


def _write_npz(path, arrays, meta):
    """Write an uncompressed .npz atomically (temp file + rename); meta travels as JSON bytes, no pickle."""
    path = pathlib.Path(path)
    tmp = path.with_name(path.name + ".tmp")
    arrays = dict(arrays, __meta__=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))
    with open(tmp, "wb") as f:  # a file object stops np.savez from appending '.npz' to the name
        np.savez(f, **arrays)
    os.replace(tmp, path)


def _read_npz(path, fmt):
    """(meta, arrays) from a file written by _write_npz, checking its format tag."""
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(arrays.pop("__meta__").tobytes().decode())
    if meta.get("format") != fmt:
        raise ValueError(f"{path}: expected format {fmt!r}, found {meta.get('format')!r}")
    return meta, arrays


def save_checkpoint(path, model, opt, step):
    """Save parameters, optimizer moments/step/hyper-parameters and the training step to `path`."""
    arrays = {"param/" + k: to_numpy(v) for k, v in model.params.items()}
    state = opt.state_dict()
    arrays.update({"adam_m/" + k: to_numpy(v) for k, v in state["m"].items()})
    arrays.update({"adam_v/" + k: to_numpy(v) for k, v in state["v"].items()})
    opt_meta = {k: state[k] for k in ("lr", "betas", "eps", "weight_decay", "decay", "t")}
    meta = {"format": CKPT_FORMAT, "step": int(step), "config": model.cfg.to_dict(), "opt": opt_meta,
            "names": list(model.params)}
    _write_npz(path, arrays, meta)


def load_checkpoint(path, model, opt=None):
    """Restore model (in place) and optionally opt from `path`; returns the saved step."""
    meta, arrays = _read_npz(path, CKPT_FORMAT)
    if GPTConfig(**meta["config"]) != model.cfg:
        raise ValueError(f"checkpoint config {meta['config']} does not match model config {model.cfg}")
    if meta["names"] != list(model.params):
        raise ValueError("checkpoint parameter names do not match the model")
    xp = model.xp
    for k, p in model.params.items():
        src = arrays["param/" + k]
        if p.shape != src.shape or p.dtype != src.dtype:
            raise ValueError(f"{k}: checkpoint has {src.shape} {src.dtype}, model has {p.shape} {p.dtype}")
        p[...] = xp.asarray(src)  # in place: the optimizer and callers keep the same arrays
    if opt is not None:
        state = dict(meta["opt"])
        state["m"] = {k: xp.asarray(arrays["adam_m/" + k]) for k in model.params}
        state["v"] = {k: xp.asarray(arrays["adam_v/" + k]) for k in model.params}
        opt.load_state_dict(state)
    return meta["step"]


def export_weights(path, model):
    """Write just the config and parameters, the input of the serving path (serve.Server)."""
    arrays = {"param/" + k: to_numpy(v) for k, v in model.params.items()}
    _write_npz(path, arrays, {"format": WEIGHTS_FORMAT, "config": model.cfg.to_dict(), "names": list(model.params)})


def load_weights(path):
    """(GPTConfig, name -> NumPy array) from a file written by export_weights."""
    meta, arrays = _read_npz(path, WEIGHTS_FORMAT)
    return GPTConfig(**meta["config"]), {k: arrays["param/" + k] for k in meta["names"]}
