"""Steady-state training throughput of the GPT, nanoGPT-style: python -m tapegpt.bench [--cpu].

It trains under whatever allocator CuPy has; comparing allocators is the lab's job (python -m xlab.experiments).
"""
import argparse
import time

from .data import get_batch, load_corpus
from .model import GPT, GPTConfig
from .optim import AdamW

TINY = dict(n_layer=2, n_head=2, n_embd=32, n_ffn=64, block_size=16, batch_size=4)


def time_training(xp, cfg, steps, warmup, sync, seed=0):
    """Run `warmup` untimed steps, then time `steps` steps between two device synchronisations."""
    data = load_corpus()
    model = GPT(cfg, xp=xp, seed=seed)
    opt = AdamW(model.params)
    # Batches are built before timing so the timed loop measures the model and the allocator only.
    batches = [get_batch(data, cfg.batch_size, cfg.block_size, s, seed=seed, xp=xp) for s in range(warmup + steps)]
    loss = None
    for x, y in batches[:warmup]:
        loss, grads = model.loss_and_grads(x, y)
        opt.step(grads)
    sync()
    t0 = time.perf_counter()
    for x, y in batches[warmup:]:
        loss, grads = model.loss_and_grads(x, y)
        opt.step(grads)
    sync()
    dt = time.perf_counter() - t0
    return dict(tokens_per_s=steps * cfg.batch_size * cfg.block_size / dt, ms_per_step=1e3 * dt / steps,
                final_loss=float(loss), params=model.num_params())


def bench_gpu(cfg, steps, warmup):
    """One row: the GPT on CuPy under CuPy's current allocator."""
    import cupy
    row = time_training(cupy, cfg, steps, warmup, cupy.cuda.Device().synchronize)
    free, total = cupy.cuda.runtime.memGetInfo()
    current = cupy.cuda.get_allocator()
    name = getattr(current, "__qualname__", type(current).__name__) if current else "cudaMalloc"
    return [dict(allocator=name, **row, device_used_gib=(total - free) / 2**30)]


def bench_cpu(cfg, steps, warmup):
    """NumPy smoke run (no allocator choice on the host)."""
    import numpy as np
    return [dict(allocator="numpy", **time_training(np, cfg, steps, warmup, lambda: None))]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=20, help="timed steps")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (kernel compilation, pool growth)")
    ap.add_argument("--batch", type=int, default=None, help="batch size (default: the config's)")
    ap.add_argument("--cpu", action="store_true", help="tiny config on NumPy, a smoke test")
    args = ap.parse_args(argv)
    cfg = GPTConfig(**TINY) if args.cpu else GPTConfig()
    if args.batch is not None:
        cfg.batch_size = args.batch
    print(f"config: {cfg}")
    if args.cpu:
        rows = bench_cpu(cfg, args.steps, args.warmup)
    else:
        rows = bench_gpu(cfg, args.steps, args.warmup)
    print(f"{'allocator':<20} {'tokens/s':>12} {'ms/step':>10} {'final loss':>11}")
    for r in rows:
        print(f"{r['allocator']:<20} {r['tokens_per_s']:>12.0f} {r['ms_per_step']:>10.2f} {r['final_loss']:>11.4f}")
    return rows


if __name__ == "__main__":
    main()
