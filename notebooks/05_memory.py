# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 05 · Memory: the seed scheme's waste by size-class setting, one step over time, every scheme replayed
#
# For k = 1, 2, 4, 8 size classes per doubling above 1 MiB (xpool's seed scheme, `classes_per_doubling`): the bytes
# the classes hand out over the bytes requested (one training step's requests), and peak bytes reserved over peak
# bytes requested (the whole run). On a GPU: measured with xpool installed, plus the allocation timeline of the run
# (`memory_timeline.csv`, at k = 1). On any machine: the recorded requests and frees are replayed, in order, through
# xpool's core over a fake address space for every k. A program's requests do not depend on the allocator, so the
# replay reproduces each setting's decisions exactly; the table checks it against the GPU's own counters
# (`replay_exact`). Last, every recorded trace replayed through each scheme (`memory_schemes.csv`).
#
# **Run it.** In JupyterLab (`.venv/bin/jupyter lab`, open `notebooks/05_memory.ipynb`, Run > Run All Cells), or in batch
# from the repository's root with the environment active (`. .venv/bin/activate`):
# `mkdir -p build/notebooks && papermill notebooks/05_memory.ipynb build/notebooks/05_memory.ipynb -p ks 4`
# (`papermill --help-notebook notebooks/05_memory.ipynb` lists the parameters and their ranges; the cell after them checks
# them; `python -m xlab.report` runs every notebook).
# On a GPU machine it measures and writes its CSV to `build/data/` (with `-p publish True`: to `data/`, and redraws
# `figures/`); without a GPU it shows the committed CSVs, newest of each kind, and says which machine and date they
# come from. A run writes nothing outside `build/` unless asked. Git holds this notebook as `notebooks/05_memory.py`, its
# cells alone; the `.ipynb` beside it, outputs and all, stays on your disk (`make setup` pairs the two; JupyterLab
# saves both). Long tables open a group at a click; "All rows" gives every row.

# %% tags=["parameters"]
ks: list[int] = [1, 2, 4, 8]  # size classes per doubling to compare; one number is one setting; 1 to 64 each, at least one
batch: int = 32  # sequences per step in the recorded run; 1 to 4,096; GPU only
warmup: int = 1  # training steps before the recorded one; 0 to 1,000; GPU only
measure: bool = True  # measure now; True or False; GPU only
data_dir: str = ""  # folder of the committed CSVs shown; a folder of CSVs, or empty for data/
publish: bool = False  # write what this run measures to data/ and redraw figures/ (default: build/ only); True or False

# %%
from xlab import parameters  # the standard library alone: a bad parameter stops here, a moment after the kernel starts

parameters.check("05_memory", globals())

from xlab import notebook_utils as nbu

run = nbu.setup("05_memory", globals())  # says what this machine ignores; a GPU measures now, a CPU shows the committed CSVs

import pandas as pd

from xlab import memory_study

# %%
measured = nbu.load_or_measure("memory_waste", "xlab.memory_study:run", run.gpu, run.data, measure, out=run.out,
                               how_to_measure="python -m xlab.memory_study --out-dir data",
                               ks=tuple(ks), batch=batch, warmup=warmup)
timeline = nbu.load_csv("memory_timeline", run.out if measured is not None and measured.attrs["source"] == "measured"
                        else run.data)

# %% [markdown]
# ## Replay of the recorded requests through xpool's core, for every k (runs on the CPU)

# %%
replayed = memory_study.replay_waste(timeline, ks) if timeline is not None else None
nbu.table(memory_study.waste_table(measured, replayed), sources=(measured, timeline))

# %%
nbu.figure("memory_waste", measured if measured is not None else replayed, run=run)

# %% [markdown]
# ## Memory over time: the whole recording, and one training step

# %%
nbu.figure("memory_timeline", timeline, run=run)

# %% [markdown]
# ## Every recorded trace through each scheme (replayed on the CPU: `python -m xlab.memory_study --schemes`)

# %%
schemes = nbu.rows("memory_schemes.csv", run)
nbu.summary(schemes, ["trace", "allocator"], ["reserved_over_requested", "device_mallocs_warm", "ns_per_pair"])

# %%
nbu.figure("memory_schemes", schemes, run=run)
