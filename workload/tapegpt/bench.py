"""Steady-state training throughput of the GPT, nanoGPT-style: python -m tapegpt.bench [--cpu] [--profile] [--drift N].

It trains under whatever allocator CuPy has; comparing allocators is the lab's job (python -m xlab.experiments).
--profile prints step_profile (host and GPU time of a step, what it dispatches) for the fused and unfused model;
--drift N trains both forms N steps side by side and prints how far the fused loss curve moves (rounding only).
"""
import argparse
import statistics
import time

from . import blas, launch
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
                final_loss=float(loss), params=model.num_params(), fused=model.fused,
                adamw="foreach" if opt.foreach else "per_param")


def step_profile(xp, cfg=None, steps=10, warmup=3, fused=None, foreach=True, seed=0):
    """Host and GPU time of one training step (forward, backward, AdamW) and what it dispatches, as one dict.

    host_ms: the dispatching thread's CPU time (time.thread_time) per step, median over `steps`; the device is
    synchronised before each step (outside the timed region) so a full launch queue never makes the host wait.
    gpu_ms: CUDA events around the same step (NaN on NumPy). ms_per_step: wall time per step of `steps` steps
    run back to back, as training runs them. bound: "host" when host_ms > gpu_ms, else "gpu". launches and
    tape_nodes come from tapegpt.profile (counted on NumPy at this depth; each op ~ one CuPy launch).
    """
    from .profile import reference_counts
    cfg = cfg or GPTConfig()
    on_gpu = xp.__name__ == "cupy"
    sync = xp.cuda.Device().synchronize if on_gpu else (lambda: None)
    model = GPT(cfg, xp=xp, seed=seed, fused=fused)
    opt = AdamW(model.params, foreach=foreach, fused=model.fused)
    data = load_corpus()
    batches = [get_batch(data, cfg.batch_size, cfg.block_size, s, seed=seed, xp=xp) for s in range(warmup + steps)]

    def step(x, y):
        loss, grads = model.loss_and_grads(x, y)
        opt.step(grads)
        return loss

    for x, y in batches[:warmup]:
        step(x, y)
    host, gpu = [], []
    for x, y in batches[warmup:]:
        sync()
        if on_gpu:
            start, end = xp.cuda.Event(), xp.cuda.Event()
            start.record()
        t0 = time.thread_time()
        step(x, y)
        host.append(1e3 * (time.thread_time() - t0))
        if on_gpu:
            end.record()
            end.synchronize()
            gpu.append(xp.cuda.get_elapsed_time(start, end))
    sync()
    t0 = time.perf_counter()
    for x, y in batches[warmup:]:
        loss = step(x, y)
    sync()
    wall = 1e3 * (time.perf_counter() - t0) / steps
    counts = reference_counts(cfg, fused_model=model.fused, foreach=foreach)
    host_ms = statistics.median(host)
    gpu_ms = statistics.median(gpu) if gpu else float("nan")
    return dict(xp=xp.__name__, fused=model.fused, gemm="cublas" if blas.enabled and on_gpu else "matmul",
                launch=("direct" if launch.direct else "cupy") if on_gpu else None,
                adamw=counts["adamw"], batch=cfg.batch_size,
                host_ms=host_ms, host_ms_min=min(host), gpu_ms=gpu_ms, ms_per_step=wall,
                bound="host" if not host_ms <= gpu_ms else "gpu", launches=counts["launches"],
                tape_nodes=counts["tape_nodes"], final_loss=float(loss), steps=steps, warmup=warmup)


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
    ap.add_argument("--profile", action="store_true", help="step_profile of the fused and the unfused model")
    ap.add_argument("--drift", type=int, default=0, metavar="N", help="fused vs unfused loss curve over N steps")
    ap.add_argument("--out", default=None, help="CSV for the --drift rows")
    args = ap.parse_args(argv)
    cfg = GPTConfig(**TINY) if args.cpu else GPTConfig()
    if args.batch is not None:
        cfg.batch_size = args.batch
    print(f"config: {cfg}")
    if args.profile or args.drift:
        if args.cpu:
            import numpy as xp
        else:
            import cupy as xp
    if args.drift:
        from .checks import loss_curve_drift
        df = loss_curve_drift(xp, cfg, steps=args.drift)
        print(f"fused vs unfused over {args.drift} steps on {xp.__name__}: max relative loss difference "
              f"{df.rel_diff.max():.3g}, at the last step {df.rel_diff.iloc[-1]:.3g}")
        if args.out:
            df.to_csv(args.out, index=False)
        return df
    if args.profile:
        rows = [step_profile(xp, cfg, args.steps, args.warmup, fused=f) for f in (False, True)]
        print(f"{'fused':<6} {'launch':<7} {'adamw':<9} {'host ms':>8} {'gpu ms':>8} {'ms/step':>8} {'bound':>5} "
              f"{'launches':>8} {'nodes':>6}")
        for r in rows:
            print(f"{r['fused']!s:<6} {r['launch']!s:<7} {r['adamw']:<9} {r['host_ms']:>8.2f} {r['gpu_ms']:>8.2f} "
                  f"{r['ms_per_step']:>8.2f} {r['bound']:>5} {r['launches']:>8} {r['tape_nodes']:>6}")
        return rows
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
