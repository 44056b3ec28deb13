"""Batch sweep (issue #13.4): one thread per GPU on 2 GPUs against 1, per-GPU batch 4 to 128, for raw, CuPy's pool
and xpool; where the host stops bounding the step, the speedup rises towards 2.

    df = sweep.run()                      # writes data/batch_sweep.csv, one row per (trial, batch, world, allocator)
    python -m xlab.experiments sweep --trials 5

Every (batch, world, allocator) runs `trials` times, interleaved; a speedup is trial t on 2 GPUs over trial t on
one. Big batches take few timed steps (STEPS) so the sweep stays affordable: a 128-sequence step is ~30 times the
GPU work of a 4-sequence one. No counting runs and no loss check against one GPU (the ddp experiment has both);
the parameters are still checked across ranks.
"""
from __future__ import annotations

from tapegpt import load_corpus
from xlab.paths import write_csv
from xlab.provenance import git_commit, provenance

from xlab import allocators as registry
from . import runner, train
from .ddp import ThreadGroup, no_multicast
from .single_gpu import TRIALS

BATCHES = (4, 8, 16, 32, 64, 128)
STEPS = {4: 4, 8: 4, 16: 3, 32: 3, 64: 2, 128: 2}      # timed steps per run, by per-GPU batch


def steps_for(batch: int, scale: float = 1.0) -> int:
    """Timed steps at a per-GPU batch: STEPS where listed, else as for the nearest listed batch; times `scale`,
    at least 2.

    Args: batch: sequences per GPU; scale: a factor on STEPS. Returns: An int, at least 2.
    """
    near = min(STEPS, key=lambda b: abs(b - batch))
    return max(2, round(STEPS[near] * scale))


def run(allocators=None, batches=BATCHES, worlds=(1, 2), warmup=2, steps_scale=1.0, config=None,
        out="data/batch_sweep.csv", cpu=False, progress=True, trials=TRIALS, resume=False):
    """Threads mode at each per-GPU batch on 1 and 2 GPUs.

    Args: allocators: arm names (default: allocators.SETS["sweep"]); batches: per-GPU batches; worlds: GPU counts;
    the first is the speedup's reference (1); warmup: untimed steps per run; steps_scale: multiplies STEPS; config:
    GPT config; out: the CSV (None: none); cpu: the same loop on NumPy with HostComm (tests the code, measures
    nothing); progress: a progress bar; trials: trials per (batch, world, allocator), interleaved; resume: keep what
    an interrupted run of this commit and these settings left in `out`; measure the rest. Returns: A tidy DataFrame
    (train.COLUMNS), one row per (trial, batch, world, allocator), speedup filled per trial.
    """
    from tqdm.auto import tqdm
    no_multicast()
    allocators = ("numpy",) if cpu else registry.parse(allocators or registry.SETS["sweep"])
    if not cpu:
        registry.require_gpus(max(worlds), "sweep.run")
    cfg, data = train.make_config(config), load_corpus()
    groups = {w: ThreadGroup(w, cfg, data, warmup, cpu) for w in worlds}
    arms = [(b, w, a) for b in batches for w in worlds for a in allocators]
    rows, done = (runner.resumed(out, ("trial", "batch", "world", "allocator"), commit=git_commit(),
                                 warmup=warmup, config=train.config_name(config)) if resume else ([], set()))
    try:
        for trial, (batch, world, name) in tqdm(runner.interleaved(trials, arms), desc="batch sweep",
                                                disable=not progress):
            if (trial, batch, world, name) in done:
                continue
            steps = steps_for(batch, steps_scale)
            m = runner.run_arm(name, groups[world].ranks(batch), steps, 0, range(world), count=False)
            row = train.build_row("threads", m, world, batch, cfg, steps, warmup, launcher="threads",
                                  config=train.config_name(config), trial=trial)
            rows.append({**row, **provenance(experiment="batch_sweep", trials=trials)})
            write_csv(train.frame(rows), out)          # what is done survives a later failure
    finally:
        for g in groups.values():
            g.close()
    return train.frame(rows)
