"""The correctness gate as the lab runs it: the workload's own checks (tapegpt.checks) plus the bitwise
transparency gate across allocators, which needs the lab's allocator registry.

    python -m xlab.correctness [--gpu] [--steps 50] --out data/correctness_gpu.csv
"""
from __future__ import annotations

import hashlib
import os

import numpy as np
import pandas as pd
from tqdm.auto import tqdm

import xpool
from tapegpt import AdamW, GPT, GPTConfig, checks, load_corpus

from . import allocators as registry
from .paths import write_csv
from .provenance import provenance

# allocators.SETS["gate"]: raw first, every other arm is compared with it. The debug arm poisons every freed block
# with NaN bytes and guards every block with a canary: identical bits there also show the workload never reads
# memory it did not write (and debug="raise" makes any damage found fail the arm).
GATE_ALLOCATORS = registry.SETS["gate"]


def transparency_config() -> GPTConfig:
    """Small-ish config for the transparency gate."""
    return GPTConfig(n_layer=2, n_head=4, n_embd=64, n_ffn=256, block_size=64, batch_size=8)


def transparency_gate(steps: int = 50, cfg: GPTConfig | None = None, allocators=GATE_ALLOCATORS,
                      seed: int = 0, progress: bool = False) -> pd.DataFrame:
    """Train on CuPy under each allocator (the reference first): one row per allocator with `identical_to_<first>`
    (losses and parameters bit-identical) and `debug_error` (what a debug-mode pool raised, or '')."""
    import cupy
    cfg = cfg or transparency_config()
    data = load_corpus()
    rows = []
    for name in tqdm(allocators, desc="transparency gate", disable=not progress):
        alloc = registry.make(name)
        alloc.install()
        row = dict(allocator=name, steps=steps, debug_error="")
        try:
            model = GPT(cfg, xp=cupy, seed=seed)
            opt = AdamW(model.params, lr=1e-3)
            losses = checks.train(model, opt, data, steps, seed=seed)
            loss_bytes = cupy.stack(losses).get().tobytes()  # collected after the run: no sync inside it
            row.update(final_param_sha256=checks.params_sha256(model.params),
                       losses_sha256=hashlib.sha256(loss_bytes).hexdigest(),
                       final_loss=float(np.frombuffer(loss_bytes, dtype=cfg.dtype)[-1]))
            del model, opt, losses
            cupy.cuda.Device().synchronize()
            alloc.check()   # a debug-mode pool raises on damage still pending or in live blocks
        except xpool.CorruptionError as e:   # recorded: the arm fails
            row["debug_error"] = str(e).splitlines()[0]
        finally:
            alloc.uninstall()
            alloc.release([cupy.cuda.Device().id])
            rows.append(row)
    df = pd.DataFrame(rows)
    ref = df.iloc[0]
    df[f"identical_to_{allocators[0]}"] = ((df.final_param_sha256 == ref.final_param_sha256)
                                           & (df.losses_sha256 == ref.losses_sha256) & (df.debug_error == ""))
    return df


def transparency_rows(gate: pd.DataFrame) -> pd.DataFrame:
    """The transparency gate's frame as check rows (measured 0: bitwise identical)."""
    col = next(c for c in gate.columns if c.startswith("identical_to_"))
    ref = col.removeprefix("identical_to_")
    rows = [dict(check=f"transparency: {r.allocator} bitwise = {ref}, {r.steps} steps (losses, params)",
                 measured=float(not r[col]), threshold=0.0, passed=bool(r[col]), xp="cupy")
            for _, r in gate.iterrows() if r.allocator != ref]
    return pd.DataFrame(rows)


def _as_rows(df: pd.DataFrame) -> pd.DataFrame:
    """Bring a check's frame to (check, measured, threshold, passed, xp)."""
    df = df.rename(columns={"max_rel_err": "measured", "tol": "threshold"})
    return df[["check", "measured", "threshold", "passed", "xp"]]


def run_correctness(device: str = "cpu", with_torch: bool = True, transparency_steps: int = 50,
                    out: str | os.PathLike | None = None, progress: bool = False) -> pd.DataFrame:
    """The checks on the CPU (NumPy) or the GPU (CuPy, and the bitwise transparency gate), with provenance;
    `progress`: a progress bar over the checks (tqdm)."""
    def bar(todo):
        return tqdm(todo, desc=f"checks ({device})", disable=not progress)
    if device == "cpu":
        frames = [checks.run_all(np, with_torch=with_torch, progress=bar)]
    elif device == "gpu":
        import cupy
        frames = [checks.run_all(cupy, with_torch=False, progress=bar),
                  transparency_rows(transparency_gate(steps=transparency_steps, progress=progress))]
    else:
        raise ValueError(f"device must be 'cpu' or 'gpu', got {device!r}")
    df = pd.concat([_as_rows(f) for f in frames], ignore_index=True)
    df = df.assign(device=device, **provenance(with_torch=with_torch, transparency_steps=transparency_steps))
    write_csv(df, out)
    df.attrs["source"] = "measured"
    return df


def main(argv=None) -> int:
    """python -m xlab.correctness [--gpu] --out CSV; exit status 1 if a check failed."""
    import argparse
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--gpu", action="store_true", help="run the checks on CuPy, plus the transparency gate")
    ap.add_argument("--steps", type=int, default=50, help="transparency gate steps")
    ap.add_argument("--no-torch", action="store_true", help="CPU: skip the PyTorch parity checks")
    ap.add_argument("--out", default=None, help="CSV to write")
    args = ap.parse_args(argv)
    df = run_correctness("gpu" if args.gpu else "cpu", with_torch=not args.no_torch,
                         transparency_steps=args.steps, out=args.out)
    with pd.option_context("display.width", 200, "display.max_colwidth", 70):
        print(df[["check", "measured", "threshold", "passed"]].to_string(index=False))
    return 0 if df.passed.all() else 1


if __name__ == "__main__":
    raise SystemExit(main())
