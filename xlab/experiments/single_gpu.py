"""One GPU, reference config: steady-state tokens/s, GPU utilisation, device mallocs per step and peak
memory for each allocator, each run from a fresh pool and a fresh model (same seed).

    df = single_gpu.run()                        # writes data/single_gpu.csv
    python -m xlab.experiments single --steps 30

Columns (shared with ddp; see train.COLUMNS): tokens_per_s over the timed steps after warm-up;
gpu_util_mean, NVML's mean over the timed window; device_mallocs_per_step, cudaMallocs per step
after warm-up (raw and cupy_pool: counted in a separate counting run, see allocators.py);
peak_reserved_bytes / peak_requested_bytes over the whole run (model, warm-up and steps);
loss_rel_diff_max, this allocator's loss curve against the first allocator's at the same batch.
"""
from __future__ import annotations

import contextlib

from tapegpt import load_corpus
from xlab.provenance import provenance

from xlab import allocators as registry
from . import train

ALLOCATORS = ("raw", "cupy_pool", "xpool", "xpool_seed")


def run(allocators=ALLOCATORS, batches=(32, 4), steps=30, warmup=5, config=None, out="data/single_gpu.csv",
        count_steps=3, device=0, cpu=False, progress=True):
    """Measure every allocator at every batch size; a tidy DataFrame, one row per (allocator, batch).

    cpu=True runs the same loop on NumPy (allocator 'numpy'): it tests the code and measures nothing.
    """
    from tqdm.auto import tqdm
    if cpu:
        import numpy as xp
        allocators, sampler, on_device = ("numpy",), None, contextlib.nullcontext
    else:
        registry.require_gpus(1, "single_gpu.run")
        import cupy as xp
        from xlab.nvml import UtilSampler
        sampler, on_device = UtilSampler([device]), lambda: xp.cuda.Device(device)
    cfg, data = train.make_config(config), load_corpus()
    rows, first = [], {}                       # first: batch -> the first allocator's loss curve
    for batch, name in tqdm([(b, a) for b in batches for a in allocators], desc="single_gpu",
                            disable=not progress):
        def run_ranks(alloc, n):
            with on_device():
                return [train.run_rank(alloc, cfg, data, batch, n, warmup, xp=xp, device=device,
                                       sampler=sampler)]
        m = train.measure(name, run_ranks, steps, count_steps, [device])
        ref = first.setdefault(batch, m["timed"][0]["losses"])
        row = train.build_row("single", m, 1, batch, cfg, steps, warmup, ref_losses=ref,
                              config=train.config_name(config))
        rows.append({**row, **provenance(experiment="single_gpu")})
        train.write_csv(train.frame(rows), out)          # what is done survives a later failure
    return train.frame(rows)
