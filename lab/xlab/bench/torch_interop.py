"""PyTorch through xpool against PyTorch's own caching allocator (`empty_del`: µs per torch.empty+del pair by
size; `train_step`: the parity model's tokens/s), and the memory of a mixed CuPy/PyTorch loop for notebook 02; the
cases and why each arm runs in a process of its own: Note [PyTorch interop benchmark], below.

    python -m xlab.bench.torch_interop [--trials 5] [--out data/torch_interop.csv]     # ~2-3 min on one H200
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

import xpool
from xlab import intervals
from xlab.paths import write_csv

# xpool: the pool enable_torch() makes (scheme expandable); xpool_segments: the same with scheme segments, CuPy's
# default, beside it (the default per front end: docs/decisions/0002-segments-for-cupy.md and
# 0003-expandable-for-pytorch.md)
# Note [PyTorch interop benchmark]
# Two cases, each arm in a fresh process (PyTorch picks its allocator once per process), the arms alternating and
# swapping which goes first from trial to trial:
# - empty_del: µs per `a = torch.empty(n, dtype=uint8, device="cuda"); del a` pair at three sizes (host-bound: the
#   allocator's path plus PyTorch's tensor construction);
# - train_step: tokens/s of the parity model (tapegpt's torch twin of the GPT, reference size, AdamW) over timed
#   steps after warm-up (the GPU is busy for most of a step, so this shows whether the allocator costs a training
#   loop anything).
# One CSV row per (trial, arm, case, size) with provenance. The arms: torch (PyTorch's own allocator; CSVs before
# the arms table call it `native`), xpool (xpool.enable_torch()'s pool) and xpool_segments (the same, scheme
# segments). For notebook 02, mixed_memory() runs a mixed loop (a PyTorch MLP step, then CuPy matmuls on its weights
# through DLPack, feeding the next step) under xpool and under the frameworks' own pools, each in a fresh process,
# and plot_mixed_memory draws each framework's bytes in the one pool over time beside the two pools' summed
# peak.
ARMS = ("torch", "xpool", "xpool_segments")
MIXED_ARMS = ("torch", "xpool")          # the mixed loop's memory: one pool against the two frameworks' own
SIZES = (4096, 1 << 20, 64 << 20)
COLUMNS = ["case", "arm", "scheme", "trial", "order", "size_bytes", "value", "unit", "pairs", "steps", "batch_size",
           "device_mallocs_per_step", "device_calls_per_step", "peak_reserved_bytes", "torch"]


# --- one arm, in its own process
def time_empty_del(torch, nbytes: int, pairs: int) -> float:
    """µs per torch.empty + del pair (after a warm-up that leaves the block cached)."""
    empty, u8, dev = torch.empty, torch.uint8, torch.device("cuda", 0)
    for _ in range(100):
        a = empty(nbytes, dtype=u8, device=dev)
        del a
    torch.cuda.synchronize()
    t0 = time.perf_counter_ns()
    for _ in range(pairs):
        a = empty(nbytes, dtype=u8, device=dev)
        del a
    torch.cuda.synchronize()
    return (time.perf_counter_ns() - t0) / pairs / 1e3


def time_train(torch, steps: int, warmup: int, batch_size: int | None):
    """(tokens/s, batch size, (device mallocs, device calls) per step or (None, None)) of the parity model with
    AdamW; device calls: mallocs, frees, maps and unmaps (the expandable scheme maps where segments malloc)."""
    from tapegpt.checks import torch_logits
    from tapegpt.model import GPTConfig, init_params
    cfg = GPTConfig() if batch_size is None else GPTConfig(batch_size=batch_size)
    dev = torch.device("cuda", 0)
    P = {k: torch.tensor(v, device=dev, requires_grad=True) for k, v in init_params(cfg).items()}
    opt = torch.optim.AdamW(P.values(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator(device=dev).manual_seed(0)
    B, T, V = cfg.batch_size, cfg.block_size, cfg.vocab_size

    def step():
        idx = torch.randint(0, V, (B, T + 1), device=dev, generator=gen)
        logits = torch_logits(cfg, P, idx[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), idx[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    pool = xpool.cupy_adapter.installed()
    before = pool.stats() if pool else None
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    if pool is None:
        return B * T * steps / dt, B, (None, None)
    d = pool.stats() - before
    calls = d.device_mallocs + d.device_frees + d.device_maps + d.device_unmaps
    return B * T * steps / dt, B, (d.device_mallocs / steps, calls / steps)


def worker(arm: str, pairs: int, steps: int, warmup: int, batch_size: int | None) -> list[dict]:
    """Every case's rows for one arm of ARMS ("torch": PyTorch's own allocator); call in a fresh process."""
    import torch
    if arm == "xpool":
        xpool.enable_torch()
    elif arm == "xpool_segments":
        xpool.enable_torch(scheme="segments")
    elif arm != "torch":
        raise ValueError(f"arm must be one of {ARMS}, got {arm!r}")
    rows = [dict(case="empty_del", size_bytes=n, value=time_empty_del(torch, n, pairs), unit="us_per_pair",
                 pairs=pairs) for n in SIZES]
    tps, B, (mallocs, calls) = time_train(torch, steps, warmup, batch_size)
    peak = (torch.cuda.max_memory_reserved() if arm == "torch" else
            xpool.cupy_adapter.installed().stats(0).peak_bytes_reserved)
    rows.append(dict(case="train_step", value=tps, unit="tokens_per_s", steps=steps, batch_size=B,
                     device_mallocs_per_step=mallocs, device_calls_per_step=calls, peak_reserved_bytes=int(peak)))
    scheme = xpool.cupy_adapter.installed().settings.scheme if arm != "torch" else ""     # the pool enable_torch() made
    for r in rows:
        r.update(arm=arm, scheme=scheme, torch=torch.__version__)
    return rows


def _worker(argv, what: str, timeout: float):
    """The JSON a worker process prints last; RuntimeError naming `what` when it fails."""
    out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if out.returncode:
        raise RuntimeError(f"{what} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# --- the trials, interleaved
def run(trials: int = 5, pairs: int = 50_000, steps: int = 20, warmup: int = 5, batch_size: int | None = None,
        command=None, timeout: float = 120.0):
    """Rows (COLUMNS, provenance) of `trials` trials, who goes first rotating, a fresh process per (trial, arm)
    running command(arm) (default: this module's GPU worker); a failing worker's trial and arm are named."""
    import pandas as pd

    from xlab.provenance import provenance
    if command is None:
        def command(arm):
            argv = [sys.executable, "-m", "xlab.bench.torch_interop", "--worker", arm, "--pairs", str(pairs),
                    "--steps", str(steps), "--warmup", str(warmup)]
            return argv + (["--batch-size", str(batch_size)] if batch_size else [])
    rows = []
    for trial in range(trials):
        order = ARMS[trial % len(ARMS):] + ARMS[:trial % len(ARMS)]     # who goes first rotates
        for position, arm in enumerate(order):
            rows += [{**r, "trial": trial, "order": position}
                     for r in _worker(command(arm), f"trial {trial}, arm {arm}", timeout)]
    prov = provenance(bench="torch_interop", trials=trials)
    df = pd.DataFrame(rows).reindex(columns=COLUMNS)
    return df.assign(**{k: v for k, v in prov.items() if k not in df.columns})


def summarize(df):
    """One row per (case, size): each arm's median [95% interval], and xpool's speed over PyTorch's own paired by
    trial (speedup > 1: xpool is faster; torch µs / xpool µs for empty_del, xpool / torch tokens/s for training);
    an older CSV without the arm xpool_segments has no columns of it."""
    import pandas as pd

    from xlab.allocators import canonical
    out, df = [], canonical(df)
    for (case, size), g in df.groupby(["case", df["size_bytes"].fillna(0)], sort=False):
        vals = {arm: g.loc[g.arm == arm, "value"].to_numpy() for arm in ARMS if (g.arm == arm).any()}
        row = {"case": case, "size_bytes": int(size) or None, "unit": g.unit.iloc[0],
               "trials": min(len(v) for v in vals.values())}
        for arm in vals:
            row[f"{arm}_median"], row[f"{arm}_low"], row[f"{arm}_high"], _ = intervals.median_ci(vals[arm])
        num, den = (vals["torch"], vals["xpool"]) if case == "empty_del" else (vals["xpool"], vals["torch"])
        row["speedup"], row["speedup_low"], row["speedup_high"], _ = intervals.ratio_ci(num, den)
        row["verdict"] = ("within noise" if row["speedup_low"] <= 1 <= row["speedup_high"]
                          else "xpool faster" if row["speedup_low"] > 1 else "xpool slower")
        out.append(row)
    return pd.DataFrame(out)


# --- a mixed CuPy/PyTorch loop, and its memory (the notebook's section; tests/lab/test_torch_gpu.py runs it too)
MIX_B, MIX_D, MIX_H = 4096, 1024, 4096   # PyTorch's B*H*4 activations = CuPy's H*H*4 temporaries = 64 MiB


def mixed_setup(torch, seed=0):
    """(model, optimizer, first input) of the mixed loop: an MLP trained with AdamW on CUDA device 0."""
    torch.manual_seed(seed)
    dev = torch.device("cuda", 0)
    model = torch.nn.Sequential(torch.nn.Linear(MIX_D, MIX_H), torch.nn.GELU(), torch.nn.Linear(MIX_H, MIX_D)).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(MIX_B, MIX_D, device=dev, generator=torch.Generator(device=dev).manual_seed(seed + 1))
    return model, opt, x


def mixed_step(torch, cupy, model, opt, x):
    """A PyTorch step, then CuPy on its first weight (DLPack) feeding the next input: (loss, sum, next x)."""
    loss = ((model(x) - x) ** 2).mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    w = cupy.from_dlpack(model[0].weight.detach())        # (H, D)
    a = w @ w.T                                            # (H, H): 64 MiB, the size PyTorch's activations had
    b = cupy.tanh(a) * 0.5
    c = b @ b
    total = c.sum()
    feed = cupy.ascontiguousarray(c[:MIX_B, :MIX_D] * 1e-3)
    del a, b, c
    return loss.detach(), total, x * 0.5 + torch.from_dlpack(feed)


def mixed_worker(arm: str, steps: int, out_csv: str | None) -> dict:
    """The mixed loop in this fresh process under `arm`: its peak reserved; xpool's memory to `out_csv`."""
    import cupy
    import torch
    pool = xpool.enable_torch(timeline=1_000_000) if arm == "xpool" else None
    model, opt, x = mixed_setup(torch)
    for _ in range(steps):
        _, _, x = mixed_step(torch, cupy, model, opt, x)
    torch.cuda.synchronize()
    if pool is None:
        return {"arm": arm, "peak_reserved_torch": int(torch.cuda.max_memory_reserved()),
                "peak_reserved_cupy": int(cupy.get_default_memory_pool().total_bytes())}
    if out_csv:
        in_use_by_origin(pool.timeline()).to_csv(out_csv, index=False)
    return {"arm": arm, "peak_reserved": int(pool.stats(0).peak_bytes_reserved)}


def mixed_memory(steps: int = 4, timeout: float = 180.0):
    """The mixed loop under xpool and under both frameworks' pools (fresh processes): (memory, peaks)."""
    import tempfile

    import pandas as pd
    from tqdm.auto import tqdm
    peaks = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "mixed.csv")
        for arm in tqdm(MIXED_ARMS, desc="mixed loop"):
            peaks[arm] = _worker([sys.executable, "-m", "xlab.bench.torch_interop", "--mixed", arm, "--steps",
                                  str(steps), "--mixed-out", path], f"mixed loop, arm {arm}", timeout)
        mem = pd.read_csv(path)
    n = peaks["torch"]
    return mem, {"one_pool": peaks["xpool"]["peak_reserved"],
                 "two_pools": n["peak_reserved_torch"] + n["peak_reserved_cupy"]}


def torch_cuda_available() -> bool:
    """PyTorch has CUDA and a device (asked in a subprocess: this process's must stay unstarted)."""
    code = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    try:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def in_use_by_origin(tl):
    """An xpool timeline -> bytes in use per framework after each event (cupy, torch, python, reserved)."""
    import pandas as pd
    sign = tl.event.map({"alloc_hit": 1, "alloc_miss": 1, "free": -1}).fillna(0).to_numpy(dtype=np.int64)
    out = pd.DataFrame({"t_s": tl.t_s.to_numpy(), "reserved": tl.bytes_reserved.to_numpy()})
    for origin in ("cupy", "torch", "python"):
        out[origin] = np.cumsum(np.where(tl.origin.to_numpy() == origin, sign * tl["size"].to_numpy(dtype=np.int64), 0))
    return out


def plot_mixed_memory(mem, two_pools: int | None = None, title="One pool for CuPy and PyTorch"):
    """Bytes in use by framework, stacked, and reserved, over time; `two_pools`: their own pools' peak."""
    from matplotlib.figure import Figure
    fig = Figure(figsize=(10, 4.5), layout="constrained")
    ax = fig.add_subplot()
    gib = 1 << 30
    ax.stackplot(mem.t_s, mem.torch / gib, mem.cupy / gib, mem.python / gib,
                 labels=["in use: PyTorch", "in use: CuPy", "in use: Python"], step="post", alpha=0.8)
    ax.step(mem.t_s, mem.reserved / gib, where="post", color="black", lw=1.2, label="reserved (one pool)")
    if two_pools:
        ax.axhline(two_pools / gib, color="#d62728", ls="--", lw=1.2,
                   label="peak reserved, PyTorch's + CuPy's own pools")
    ax.set(xlabel="time (s)", ylabel="GiB", title=title)
    ax.legend(loc="upper left", fontsize=8)
    return fig


def main(argv=None):
    """The command line: measure, print the summary, write the CSV (see --help); or, hidden, one worker."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--pairs", type=int, default=50_000, help="torch.empty+del pairs timed per size")
    p.add_argument("--steps", type=int, default=20, help="timed training steps")
    p.add_argument("--warmup", type=int, default=5, help="training steps before timing")
    p.add_argument("--batch-size", type=int, default=None, help="default: the reference config's")
    p.add_argument("--out", default=None, help="CSV path (default: data/torch_interop.csv)")
    p.add_argument("--worker", choices=ARMS, help=argparse.SUPPRESS)
    p.add_argument("--mixed", choices=MIXED_ARMS, help=argparse.SUPPRESS)
    p.add_argument("--mixed-out", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.mixed:
        print(json.dumps(mixed_worker(a.mixed, a.steps, a.mixed_out)))
        return
    if a.worker:
        print(json.dumps(worker(a.worker, a.pairs, a.steps, a.warmup, a.batch_size)))
        return
    from xlab.paths import data_dir
    df = run(a.trials, a.pairs, a.steps, a.warmup, a.batch_size)
    write_csv(df, out := a.out or str(data_dir() / "torch_interop.csv"))
    print(summarize(df).round(3).to_string(index=False, line_width=160))
    print(f"wrote {len(df)} rows to {out}")


if __name__ == "__main__":
    main()
