# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 03 · One GPU: training throughput and memory
#
# The small GPT (12 layers, 384 wide, 256 tokens per sequence; every op makes a fresh array) trained under each
# allocator: tokens per second, host ms per step (the dispatching thread's CPU time), the step's span on the GPU
# stream (CUDA events), mean GPU utilisation (NVML) and what bounds the step, device mallocs per step after warm-up,
# and peak memory reserved against requested. Trials interleaved across the allocators; flat-buffer AdamW.
# Measured by `xlab.experiments.single_gpu.run` (`data/single_gpu.csv`; xpool and CuPy's pool again after the release
# rule, `data/single_gpu_recheck.csv`).
#
# **Run it.** In JupyterLab (`.venv/bin/jupyter lab`, open `notebooks/03_single_gpu.ipynb`, Run > Run All Cells), or in batch
# from the repository's root with the environment active (`. .venv/bin/activate`):
# `mkdir -p build/notebooks && papermill notebooks/03_single_gpu.ipynb build/notebooks/03_single_gpu.ipynb -p batches 4 -p trials 3`
# (`papermill --help-notebook notebooks/03_single_gpu.ipynb` lists the parameters and their ranges; the cell after them checks
# them; `python -m xlab.report` runs every notebook).
# On a GPU machine it measures and writes its CSV to `build/data/` (with `-p publish True`: to `data/`, and redraws
# `figures/`); without a GPU it shows the committed CSVs, newest of each kind, and says which machine and date they
# come from. A run writes nothing outside `build/` unless asked. Git holds this notebook as `notebooks/03_single_gpu.py`, its
# cells alone; the `.ipynb` beside it, outputs and all, stays on your disk (`make setup` pairs the two; JupyterLab
# saves both). Long tables open a group at a click; "All rows" gives every row.

# %% tags=["parameters"]
steps: int = 10  # timed steps per run; 1 to 10,000; GPU only
warmup: int = 3  # untimed steps before the timed ones; 0 to 1,000; GPU only
trials: int = 5  # trials per (batch, allocator), interleaved across allocators; 1 to 100; GPU only
batches: list[int] = [32, 4]  # batch sizes (sequences per step); one number is one batch size; 1 to 4,096 each, at least one; GPU only
allocators: list[str] = []  # arms to compare (empty: raw, cupy_pool, xpool, xpool_seed); arms of xlab.allocators.ARMS each, or empty for the default; GPU only
measure: bool = True  # measure now; True or False; GPU only
cpu_check: bool = True  # run the measuring code on NumPy with a tiny model (measures nothing); True or False; without a GPU only
data_dir: str = ""  # folder of the committed CSVs shown; a folder of CSVs, or empty for data/
publish: bool = False  # write what this run measures to data/ and redraw figures/ (default: build/ only); True or False

# %%
from xlab import parameters  # the standard library alone: a bad parameter stops here, a moment after the kernel starts

parameters.check("03_single_gpu", globals())

from xlab import notebook_utils as nbu

run = nbu.setup("03_single_gpu", globals())  # says what this machine ignores; a GPU measures now, a CPU shows the committed CSVs

import pandas as pd

# %% [markdown]
# ## Without a GPU: the measuring code itself, on NumPy (checks the code, measures nothing)

# %%
if cpu_check and not run.gpu:
    nbu.cpu_smoke("xlab.experiments.single_gpu:run", config="tiny", batches=(2,), steps=2, warmup=1, trials=2)

# %% [markdown]
# ## Measurements (medians over trials [95% interval]; every trial a click away)

# %%
runs = nbu.load_or_measure("single_gpu", "xlab.experiments.single_gpu:run", run.gpu, run.data, measure, out=run.out,
                           allocators=tuple(allocators) or None, batches=tuple(batches), steps=steps,
                           warmup=warmup, trials=trials)
rows = nbu.rows("single_gpu", run, runs)
nbu.summary(rows, ["batch", "allocator"], ["tokens_per_s", "host_ms_per_step", "gpu_ms_per_step", "gpu_util_mean"])

# %% [markdown]
# Memory: device mallocs per step once warm, and peak bytes reserved over peak bytes requested.

# %%
nbu.summary(rows, ["batch", "allocator"], ["device_mallocs_per_step", "reserved_over_requested"])

# %%
nbu.figure("single_gpu", rows, run=run)
