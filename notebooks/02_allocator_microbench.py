# ---
# jupyter:
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 02 · Allocator microbenchmark
#
# Microseconds per `a = cupy.empty(n, uint8); del a` pair for each allocator and request size on one thread, and
# thousands of pairs per second with several threads allocating on one GPU. Peers: raw `cudaMalloc`/`cudaFree`
# (alone on the device, and with one small block held alive, which makes small pairs ten times cheaper), CuPy's
# `MemoryPool` (the default) and `MemoryAsyncPool`, PyTorch's caching allocator handing CuPy its blocks (where
# PyTorch has CUDA), and allocators doing no work (the floor of CuPy's allocation path); xpool's default scheme and
# the seed scheme. Trials interleaved across the allocators; medians with 95% bootstrap intervals.
# Measured by `python -m xlab.bench.alloc`; the cached arms again at the final hit path (`alloc_hit_sweep.csv`).
#
# **Run it.** In JupyterLab (`.venv/bin/jupyter lab`, open `notebooks/02_allocator_microbench.ipynb`, Run > Run All Cells), or in batch
# from the repository's root with the environment active (`. .venv/bin/activate`):
# `mkdir -p build/notebooks && papermill notebooks/02_allocator_microbench.ipynb build/notebooks/02_allocator_microbench.ipynb -p quick True`
# (`papermill --help-notebook notebooks/02_allocator_microbench.ipynb` lists the parameters and their ranges; the cell after them checks
# them; `python -m xlab.report` runs every notebook).
# On a GPU machine it measures and writes its CSV to `build/data/` (with `-p publish True`: to `data/`, and redraws
# `figures/`); without a GPU it shows the committed CSVs, newest of each kind, and says which machine and date they
# come from. A run writes nothing outside `build/` unless asked. Git holds this notebook as `notebooks/02_allocator_microbench.py`, its
# cells alone; the `.ipynb` beside it, outputs and all, stays on your disk (`make setup` pairs the two; JupyterLab
# saves both). Long tables open a group at a click; "All rows" gives every row.

# %% tags=["parameters"]
quick: bool = False  # fewer trials, short windows (a smoke run, not numbers to quote); True or False; GPU only
measure: bool = True  # measure now; True or False; GPU only
data_dir: str = ""  # folder of the committed CSVs shown; a folder of CSVs, or empty for data/
publish: bool = False  # write what this run measures to data/ and redraw figures/ (default: build/ only); True or False

# %%
from xlab import parameters  # the standard library alone: a bad parameter stops here, a moment after the kernel starts

parameters.check("02_allocator_microbench", globals())

from xlab import notebook_utils as nbu

run = nbu.setup("02_allocator_microbench", globals())  # says what this machine ignores; a GPU measures now, a CPU shows the committed CSVs

from xlab.bench import torch_interop
from xlab.bench.alloc import THREAD_SIZE  # the one request size the threads are measured at

# %%
bench = nbu.load_or_measure("alloc_microbench", "xlab.bench.alloc:run", run.gpu, run.data, measure, out=run.out,
                            how_to_measure="python -m xlab.bench.alloc --out data/alloc_microbench.csv",
                            quick=quick)

# %% [markdown]
# ## One thread: µs per alloc/free pair (lower is faster), and CuPy's pool's time over each arm's

# %%
sizes = nbu.rows("alloc_size", run, bench)
nbu.summary(sizes, ["size_bytes", "allocator"], ["us_per_pair", "ratio_vs_cupy_pool"])

# %%
nbu.figure("alloc_cost", sizes, run=run)

# %% [markdown]
# ## Several threads on one GPU: thousand pairs per second, all threads together

# %%
threads = nbu.rows("alloc_threads", run, bench)
nbu.summary(threads[threads["size_bytes"] == THREAD_SIZE] if threads is not None else None,
            ["threads", "allocator"], ["kpairs_per_s"])

# %%
nbu.figure("alloc_threads", threads, run=run, size_bytes=THREAD_SIZE)

# %% [markdown]
# ## CuPy and PyTorch in one pool
#
# With `xpool.enable_torch()` PyTorch allocates from the same pool as CuPy. µs per `torch.empty`+`del` pair through
# xpool and through PyTorch's own caching allocator, and tokens/s of a PyTorch training step (the parity model at the
# reference size) through each; interleaved trials, each arm a fresh process. Measured by
# `python -m xlab.bench.torch_interop --out data/torch_interop.csv`.

# %%
interop = nbu.with_units(nbu.rows("torch_interop.csv", run))
if interop is not None:
    display(nbu.summary(interop[interop["case"] == "empty_del"], ["size_bytes", "arm"], ["us_per_pair"]))
    display(nbu.summary(interop[interop["case"] == "train_step"], ["arm"], ["tokens_per_s"]))

# %%
nbu.figure("torch_interop", interop, run=run)

# %% [markdown]
# A mixed loop (a PyTorch training step, then CuPy work on its weights through DLPack, feeding the next step), on a GPU
# with PyTorch: the bytes each framework holds in the one pool over time, the pool's reserved bytes, and (dashed) the
# peak that the two frameworks' own pools reserve together. Once warm the stack alternates between the frameworks
# while reserved stays flat: each reuses what the other freed.

# %%
if run.gpu and measure and torch_interop.torch_cuda_available():
    mem, peaks = torch_interop.mixed_memory()
    print(f"peak reserved: one pool {peaks['one_pool'] / 2**20:,.0f} MiB, two pools {peaks['two_pools'] / 2**20:,.0f} MiB")
    display(nbu.show(torch_interop.plot_mixed_memory(mem, peaks["two_pools"])))
else:
    print("The mixed loop runs on a GPU with PyTorch (CUDA) only.")
