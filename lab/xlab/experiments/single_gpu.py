"""One GPU, reference config: steady-state tokens/s, host and GPU ms per step, what bounds the step, GPU
utilisation, device mallocs per step and peak memory for each allocator, each run from a fresh pool and a fresh
model (same seed); `trials` trials interleaved across the allocators and batches. The columns: Note [The timed
window] in xlab/experiments/train.py.

    df = single_gpu.run()                        # writes data/single_gpu.csv, one row per (trial, batch, allocator)
    python -m xlab.experiments single --steps 10 --trials 5
"""
from __future__ import annotations

import contextlib

from tapegpt import load_corpus

from xlab import allocators as registry
from xlab.nvml import UtilSampler

from . import runner, train

TRIALS = 5
DISPATCH_STEPS = 3     # steps after the window, each from an idle device: the host's work per step (train.run_rank)


def run(allocators=None, batches=(32, 4), steps=10, warmup=3, config=None, out="data/single_gpu.csv",
        count_steps=3, device=0, cpu=False, progress=True, trials=TRIALS, resume=False):
    """One row per (trial, batch, allocator), to `out` after each; cpu: NumPy (tests the code, measures nothing)."""
    allocators = registry.parse(allocators or registry.SETS["single"])
    if cpu:
        import numpy as xp
        allocators, sampler, on_device = ("numpy",), None, contextlib.nullcontext
    else:
        registry.require_gpus(1, "single_gpu.run")
        import cupy as xp
        sampler, on_device = UtilSampler([device]), lambda: xp.cuda.Device(device)
    cfg, data = train.make_config(config), load_corpus()
    first = {}                                 # first: batch -> the first allocator's loss curve

    def one(trial, batch, name):
        def ranks(alloc, n):
            with on_device():
                return [train.run_rank(alloc, cfg, data, batch, n, warmup, xp=xp, device=device,
                                       sampler=sampler, dispatch_steps=DISPATCH_STEPS)]
        m = runner.run_arm(name, ranks, steps, count_steps, [device], count=trial == 0)
        ref = first.setdefault(batch, m["timed"][0]["losses"])
        return train.build_row("single", m, 1, batch, cfg, steps, warmup, ref_losses=ref,
                               config=train.config_name(config), trial=trial)

    return runner.run_trials("single_gpu", one, [(b, a) for b in batches for a in allocators], trials, out,
                             ("trial", "batch", "allocator"), resume, progress, steps=steps, warmup=warmup,
                             config=train.config_name(config))
