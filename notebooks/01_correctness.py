# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 01 · Correctness gate
#
# Every check of the training workload, one pass/fail summary with the measured errors.
# On the CPU (NumPy): finite-difference gradients of every op and of the GPT loss (float64), float32 against
# float64, PyTorch parity (logits, loss, every gradient, AdamW steps), overfitting one batch, checkpoint round trip
# and bit-exact resume, batch consistency, and the closed loop from training to serving.
# On a GPU, in addition: the same checks on CuPy and the **bitwise transparency gate**: training under raw
# `cudaMalloc`, CuPy's pool and xpool must give identical losses and parameters, bit for bit.
# The CPU checks run here go to `build/data/correctness_cpu.csv` (with `publish`: `data/correctness_cpu.csv`).
#
# **Run it.** In JupyterLab (`.venv/bin/jupyter lab`, open `notebooks/01_correctness.ipynb`, Run > Run All Cells), or in batch
# from the repository's root with the environment active (`. .venv/bin/activate`):
# `mkdir -p build/notebooks && papermill notebooks/01_correctness.ipynb build/notebooks/01_correctness.ipynb -p with_torch False`
# (`papermill --help-notebook notebooks/01_correctness.ipynb` lists the parameters and their ranges; the cell after them checks
# them; `python -m xlab.report` runs every notebook).
# On a GPU machine it measures and writes its CSV to `build/data/` (with `-p publish True`: to `data/`, and redraws
# `figures/`); without a GPU it shows the committed CSVs, newest of each kind, and says which machine and date they
# come from. A run writes nothing outside `build/` unless asked. Git holds this notebook as `notebooks/01_correctness.py`, its
# cells alone; the `.ipynb` beside it, outputs and all, stays on your disk (`make setup` pairs the two; JupyterLab
# saves both). Long tables open a group at a click; "All rows" gives every row.

# %% tags=["parameters"]
with_torch: bool = True  # PyTorch parity checks (needs torch); True or False
transparency_steps: int = 50  # training steps per allocator in the bitwise transparency gate; 1 to 10,000; GPU only
measure: bool = True  # run the GPU checks now; True or False; GPU only
fail_on_error: bool = True  # the last cell raises if a check run here failed, so papermill and CI fail; True or False
data_dir: str = ""  # folder of the committed CSVs shown; a folder of CSVs, or empty for data/
publish: bool = False  # write what this run measures to data/ and redraw figures/ (default: build/ only); True or False

# %%
from xlab import parameters  # the standard library alone: a bad parameter stops here, a moment after the kernel starts

parameters.check("01_correctness", globals())

from xlab import notebook_utils as nbu

run = nbu.setup("01_correctness", globals())  # says what this machine ignores; a GPU measures now, a CPU shows the committed CSVs

import pandas as pd

# %% [markdown]
# ## Checks on the CPU (run now)

# %%
cpu_checks = nbu.run_correctness("cpu", with_torch=with_torch, out=run.out / "correctness_cpu.csv", progress=True)

# %% [markdown]
# ## Checks on a GPU (run now on a GPU machine, else the committed results)

# %%
gpu_checks = nbu.load_or_measure("correctness_gpu", nbu.run_correctness, run.gpu, run.data, measure, out=run.out,
                                 device="gpu", transparency_steps=transparency_steps, progress=True)

# %% [markdown]
# ## Verdict, by device and family of checks

# %%
checks = pd.concat([f for f in (cpu_checks, gpu_checks) if f is not None], ignore_index=True)
nbu.verdict(checks)

# %%
nbu.figure("correctness", checks, run=run)

# %% [markdown]
# The gate: this cell raises, failing the notebook (and papermill, and CI), if a check run here failed.

# %%
if fail_on_error:
    nbu.assert_all_passed(nbu.measured_here(cpu_checks, gpu_checks))
