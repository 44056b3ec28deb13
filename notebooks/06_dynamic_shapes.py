# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 06 · Dynamic shapes: memory held, device calls and speed when the shapes change every step
#
# Workloads whose shapes change every step (a CuPy loop of FFTs, sorts, cumsums and matmuls of random sizes whose
# results live a random number of steps; tapegpt's GPT and a PyTorch `TransformerEncoder` language model trained at a
# sequence length drawn every step; a ResNet-18 at an image size drawn every step), beside fixed-shape controls (the
# GPT at batch 32 and 4, the PyTorch model at one length, the ResNet at 224 px), under every peer (CuPy's `MemoryPool` and `MemoryAsyncPool`, RMM's pool; PyTorch's caching allocator with
# and without `expandable_segments:True`) and every xpool scheme: peak reserved over peak requested, device calls per
# timed step and per step in steady state (after the demand's last new high), and ms per step over the fastest peer's
# in the same trial. Trials interleaved, each arm a process of
# its own. Measured by `python -m xlab.bench.dynamic` (`data/dynamic_shapes.csv`); on a GPU this notebook runs a quick
# pass by default (one trial of a few steps: checks the code, not numbers to quote). Its last two sections show the
# same workloads at the scale users run them (33-40 GiB requested) and under memory caps (issue #46,
# `python -m xlab.bench.dynamic_scale`; with `scale=True` a GPU measures them too).
#
# **Run it.** In JupyterLab (`.venv/bin/jupyter lab`, open `notebooks/06_dynamic_shapes.ipynb`, Run > Run All Cells), or in batch
# from the repository's root with the environment active (`. .venv/bin/activate`):
# `mkdir -p build/notebooks && papermill notebooks/06_dynamic_shapes.ipynb build/notebooks/06_dynamic_shapes.ipynb -p quick False`
# (`papermill --help-notebook notebooks/06_dynamic_shapes.ipynb` lists the parameters and their ranges; the cell after them checks
# them; `python -m xlab.report` runs every notebook).
# On a GPU machine it measures and writes its CSV to `build/data/` (with `-p publish True`: to `data/`, and redraws
# `figures/`); without a GPU it shows the committed CSVs, newest of each kind, and says which machine and date they
# come from. A run writes nothing outside `build/` unless asked. Git holds this notebook as `notebooks/06_dynamic_shapes.py`, its
# cells alone; the `.ipynb` beside it, outputs and all, stays on your disk (`make setup` pairs the two; JupyterLab
# saves both). Long tables open a group at a click; "All rows" gives every row.

# %% tags=["parameters"]
quick: bool = True  # one trial of a few steps; False: the full run (every trial and step); True or False; GPU only
workloads: list[str] = []  # workloads (empty: all but the held-out ones); workloads of xlab.bench.dynamic.WORKLOADS each, or empty for the default; GPU only
allocators: list[str] = []  # arms (empty: every peer and every xpool scheme); arms of xlab.allocators.ARMS each, or empty for the default; GPU only
measure: bool = True  # measure now; True or False; GPU only
scale: bool = False  # measure the scaled runs and their memory caps too (quick: one trial; else ~17 min on an H200); True or False; GPU only
cpu_check: bool = True  # run the benchmark's code on NumPy and PyTorch's CPU (measures nothing); True or False; without a GPU only
data_dir: str = ""  # folder of the committed CSVs shown; a folder of CSVs, or empty for data/
publish: bool = False  # write what this run measures to data/ and redraw figures/ (default: build/ only); True or False

# %%
from xlab import parameters  # the standard library alone: a bad parameter stops here, a moment after the kernel starts

parameters.check("06_dynamic_shapes", globals())

from xlab import notebook_utils as nbu

run = nbu.setup("06_dynamic_shapes", globals())  # says what this machine ignores; a GPU measures now, a CPU shows the committed CSVs

import pandas as pd

from xlab import summaries
from xlab.bench import dynamic, dynamic_scale

# %% [markdown]
# ## Without a GPU: the benchmark's code on the CPU, small models (checks the code, measures nothing)

# %%
if cpu_check and not run.gpu:
    nbu.cpu_smoke("xlab.bench.dynamic:run", workloads=["cupy_mix", "torch_fixed"], trials=1, steps=2, warmup=1,
                  start="spawn")

# %% [markdown]
# ## Measurements (medians over trials [95% interval]; every trial a click away)

# %%
measured = nbu.load_or_measure("dynamic_shapes", "xlab.bench.dynamic:run", run.gpu, run.data, measure, out=run.out,
                               how_to_measure="python -m xlab.bench.dynamic", workloads=workloads or None,
                               arms=allocators or None, start="spawn", **(dynamic.QUICK if quick else {}))
rows = nbu.rows("dynamic_shapes", run, measured)
nbu.table(summaries.dynamic_summary(rows), full=rows, group="workload") if rows is not None else None

# %%
nbu.figure("dynamic_shapes", rows, run=run)

# %% [markdown]
# Device calls per step (the `cudaMalloc`s and frees, or maps and unmaps, of each arm) and ms per step over the
# fastest peer's in the same trial, from the same rows.

# %%
nbu.figure("dynamic_calls", rows, run=run)

# %%
nbu.figure("dynamic_speed", rows, run=run)

# %% [markdown]
# ## At the scale users run them (issue #46)
#
# The dynamic workloads again, each grown to a peak requested of 33-40 GiB (`xlab.bench.dynamic_scale.SCALED`),
# under every peer and xpool scheme, trials interleaved: at the benchmark's own size a 2 MiB page is a sizeable share
# of the demand; at this size the release rule decides. Measured by `python -m xlab.bench.dynamic_scale`
# (`data/dynamic_scale.csv`, and the capped runs below into `data/memory_cap.csv`); on a GPU this notebook measures
# them with `scale=True`. A run under way shows the trials it has, without an interval under three.

# %%
scaled = nbu.load_or_measure("dynamic_scale", "xlab.bench.dynamic_scale:measure", run.gpu, run.data,
                             measure and scale, out=run.out, how_to_measure="this notebook with scale=True",
                             skipped="scale=False" if measure else "measure=False", arms=allocators or None,
                             start="spawn", **(dynamic_scale.QUICK if quick else {}))
big = nbu.rows("dynamic_scale", run, scaled)
print(summaries.said(big))
nbu.table(summaries.scale_summary(big), full=big, group="workload") if big is not None else None

# %%
nbu.table(summaries.defaults_vs_peers(big)) if big is not None else None

# %%
nbu.figure("dynamic_scale", big, run=run)

# %% [markdown]
# ## Under a memory cap: does the job fit?
#
# Each scaled workload under caps over its uncapped run's peak requested (the line below names the caps the rows
# hold; `python -m xlab.bench.dynamic_scale --caps` sets them), set the way each allocator allows (Note [Memory caps]
# in `xlab/allocators.py`); a run stops at its first out-of-memory error. Per front end, the trials each arm finished
# of those it ran.

# %%
capped = nbu.rows("memory_cap", run, scaled)
print(summaries.said(capped, "memory_cap"))
for framework in capped["framework"].unique() if capped is not None else ():
    display(nbu.table(summaries.cap_grid(capped, framework), full=capped[capped["framework"] == framework]))

# %%
nbu.figure("memory_cap", capped, run=run)
