"""Batch sweep (issue #13.4): one thread per GPU on 2 GPUs against 1, per-GPU batch 4 to 128, for raw, CuPy's pool
and xpool; where the host stops bounding the step, the speedup rises towards 2. A speedup is trial t on 2 GPUs over
trial t on one; big batches take few timed steps (STEPS: a 128-sequence step is ~30 times the GPU work of a
4-sequence one); no counting runs and no loss check against one GPU (ddp has both), the parameters still checked.

    python -m xlab.experiments sweep --trials 5     # data/batch_sweep.csv, one row per (trial, batch, world, arm)
"""
from __future__ import annotations

from tapegpt import load_corpus

from xlab import allocators as registry
from . import runner, train
from .ddp import ThreadGroup, no_multicast
from .single_gpu import TRIALS

BATCHES = (4, 8, 16, 32, 64, 128)
STEPS = {4: 4, 8: 4, 16: 3, 32: 3, 64: 2, 128: 2}      # timed steps per run, by per-GPU batch


def steps_for(batch: int, scale: float = 1.0) -> int:
    """Timed steps at a per-GPU batch: STEPS of the nearest listed batch, times `scale`, at least 2."""
    near = min(STEPS, key=lambda b: abs(b - batch))
    return max(2, round(STEPS[near] * scale))


def run(allocators=None, batches=BATCHES, worlds=(1, 2), warmup=2, steps_scale=1.0, config=None,
        out="data/batch_sweep.csv", cpu=False, progress=True, trials=TRIALS, resume=False):
    """Threads mode per per-GPU batch on each of `worlds` GPUs (the first: the reference); cpu, resume as single's."""
    no_multicast()
    allocators = ("numpy",) if cpu else registry.parse(allocators or registry.SETS["sweep"])
    if not cpu:
        registry.require_gpus(max(worlds), "sweep.run")
    cfg, data = train.make_config(config), load_corpus()
    groups = {w: ThreadGroup(w, cfg, data, warmup, cpu) for w in worlds}

    def one(trial, batch, world, name):
        steps = steps_for(batch, steps_scale)
        m = runner.run_arm(name, groups[world].ranks(batch), steps, 0, range(world), count=False)
        return train.build_row("threads", m, world, batch, cfg, steps, warmup, launcher="threads",
                               config=train.config_name(config), trial=trial)

    try:
        return runner.run_trials("batch_sweep", one, [(b, w, a) for b in batches for w in worlds for a in allocators],
                                 trials, out, ("trial", "batch", "world", "allocator"), resume, progress,
                                 warmup=warmup, config=train.config_name(config))
    finally:
        for g in groups.values():
            g.close()
