# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 04 · Several GPUs: data-parallel scaling
#
# Data-parallel training of the same GPT on 1 and 2 GPUs, either one thread per GPU in one process (`threads`) or
# one process per GPU (`processes`), gradients all-reduced with NCCL every step: tokens per second, speedup over one
# GPU, GPU utilisation, before (raw `cudaMalloc`) and after (a pool); then the batch sweep: one thread per GPU on 2
# GPUs against 1 at per-GPU batch 4 to 128, where the host bound ends. Trials interleaved across the allocators.
# Measured by `xlab.experiments.ddp.run` and `xlab.experiments.sweep.run` (`data/ddp_scaling.csv`; its newer run
# `data/ddp_expandable.csv` beside the expandable scheme; `data/batch_sweep.csv`). Last, the step as a CUDA graph: forward and backward captured once over a private pool and
# replayed (`_graph` arms, `tapegpt.graph`), beside the eager arms (`data/graph/`).
#
# **Run it.** In JupyterLab (`.venv/bin/jupyter lab`, open `notebooks/04_multi_gpu.ipynb`, Run > Run All Cells), or in batch
# from the repository's root with the environment active (`. .venv/bin/activate`):
# `mkdir -p build/notebooks && papermill notebooks/04_multi_gpu.ipynb build/notebooks/04_multi_gpu.ipynb -p modes threads -p worlds 1,2`
# (`papermill --help-notebook notebooks/04_multi_gpu.ipynb` lists the parameters and their ranges; the cell after them checks
# them; `python -m xlab.report` runs every notebook).
# On a GPU machine it measures and writes its CSV to `build/data/` (with `-p publish True`: to `data/`, and redraws
# `figures/`); without a GPU it shows the committed CSVs, newest of each kind, and says which machine and date they
# come from. A run writes nothing outside `build/` unless asked. Git holds this notebook as `notebooks/04_multi_gpu.py`, its
# cells alone; the `.ipynb` beside it, outputs and all, stays on your disk (`make setup` pairs the two; JupyterLab
# saves both). Long tables open a group at a click; "All rows" gives every row.

# %% tags=["parameters"]
modes: list[str] = ["threads", "processes"]  # one thread per GPU in one process, and/or one process per GPU; threads or processes each, at least one; GPU only
worlds: list[int] = [1, 2]  # numbers of GPUs; 1 to 64 each, at least one; GPU only
allocators: list[str] = []  # arms to compare (empty: raw, cupy_pool, xpool, xpool_seed); arms of xlab.allocators.ARMS each, or empty for the default; GPU only
batch: int = 32  # sequences per GPU per step; 1 to 4,096; GPU only
steps: int = 8  # timed steps per run; 1 to 10,000; GPU only
trials: int = 5  # trials per (mode, world, allocator), interleaved across allocators; 1 to 100; GPU only
sweep: bool = True  # also measure the batch sweep; True or False; GPU only
graph: bool = True  # also measure threads with the graph arms; True or False; GPU only
measure: bool = True  # measure now; True or False; GPU only
cpu_check: bool = True  # run the measuring code on NumPy with a tiny model (measures nothing); True or False; without a GPU only
data_dir: str = ""  # folder of the committed CSVs shown; a folder of CSVs, or empty for data/
publish: bool = False  # write what this run measures to data/ and redraw figures/ (default: build/ only); True or False

# %%
from xlab import parameters  # the standard library alone: a bad parameter stops here, a moment after the kernel starts

parameters.check("04_multi_gpu", globals())

from xlab import notebook_utils as nbu

run = nbu.setup("04_multi_gpu", globals())  # says what this machine ignores; a GPU measures now, a CPU shows the committed CSVs

import pandas as pd

# %% [markdown]
# ## Without a GPU: the data-parallel code on NumPy, ranks as threads (checks the code, measures nothing)

# %%
if cpu_check and not run.gpu:
    nbu.cpu_smoke("xlab.experiments.ddp:run", modes=("threads",), worlds=(1, 2), config="tiny", batch=2,
                  steps=2, trials=2)
    nbu.cpu_smoke("xlab.experiments.sweep:run", batches=(2, 4), config="tiny", steps_scale=0.3, trials=2)

# %% [markdown]
# ## Measurements (medians over trials [95% interval]; every trial a click away)

# %%
scaling = nbu.load_or_measure("ddp_scaling", "xlab.experiments.ddp:run", run.gpu, run.data, measure, out=run.out,
                              modes=tuple(modes), worlds=tuple(worlds), allocators=tuple(allocators) or None,
                              batch=batch, steps=steps, trials=trials)
ddp = nbu.rows("ddp", run, scaling)
nbu.summary(ddp, ["mode", "world", "allocator"], ["tokens_per_s", "speedup", "gpu_util_mean"])

# %%
nbu.figure("ddp_scaling", ddp, run=run)

# %%
nbu.figure("ddp_before_after", ddp, run=run)

# %% [markdown]
# ## Batch sweep: one thread per GPU, 2 GPUs over 1, by per-GPU batch

# %%
swept = nbu.load_or_measure("batch_sweep", "xlab.experiments.sweep:run", run.gpu, run.data, measure and sweep,
                            out=run.out, trials=trials)
sweep_rows = nbu.rows("batch_sweep", run, swept)
nbu.summary(sweep_rows, ["batch", "world", "allocator"], ["speedup", "host_ms_per_step", "ms_per_step"])

# %%
nbu.figure("batch_sweep", sweep_rows, run=run)

# %% [markdown]
# ## The step as a CUDA graph: eager arms against `_graph` arms

# %%
graphed = nbu.load_or_measure("graph/ddp_scaling", "xlab.experiments.ddp:run", run.gpu, run.data,
                              measure and graph, out=run.out, modes=("threads",), worlds=tuple(worlds), batch=batch,
                              steps=12, trials=trials,
                              allocators=("raw", "cupy_pool", "xpool", "cupy_pool_graph", "xpool_graph"))
graph_rows = nbu.rows("graph", run, graphed)
nbu.summary(graph_rows, ["mode", "world", "batch", "allocator"], ["tokens_per_s", "speedup", "dispatch_ms_per_step",
                                                                 "gpu_util_mean"])

# %%
nbu.figure("graph_steps", graph_rows, run=run)

# %% [markdown]
# ## One set-up, two runs
#
# The first two figures (the `ddp` CSVs) and the graph figure (`graph/`) both show the eager arms with one thread per
# GPU at this batch: the same set-up, measured in different runs. Each row below says which run an answer comes from
# and what that run was (`bound`: what limited a step, the host's dispatch or the GPU); the line above it names what
# differs between the runs. Read each figure's ratios against peers of its own run only.

# %%
same, said = nbu.same_setup(ddp, graph_rows, where=dict(mode="threads", world=2, batch=batch))
print(said or "No set-up shared by the figures' runs.")
nbu.table(same) if same is not None else None
