"""Write notebooks/*.ipynb from the cell sources below: output-free, stable cell ids, diff-friendly.

    python scripts/make_notebooks.py           # (re)write the notebooks
    python scripts/make_notebooks.py --check   # exit 1 if a committed notebook differs from this script

Each notebook is thin: a markdown header, one cell tagged `parameters` (literal, annotated, commented
defaults, so `papermill --help-notebook` documents them), then calls into xpool, tables and figures.
Edit the notebooks here, not in JupyterLab, and re-run this script.
"""
from __future__ import annotations

import argparse
import pathlib
import sys

import nbformat

ROOT = pathlib.Path(__file__).resolve().parents[1]
NB_DIR = ROOT / "notebooks"

COMMON_PARAMS = '''\
data_dir: str = ""  # folder of the CSVs (empty: the repository's data/)
figures_dir: str = ""  # folder the figures are saved to (empty: the repository's figures/)'''

SETUP = '''\
import pandas as pd

from xlab import notebook_utils as nbu
from xlab import plots

gpu = nbu.gpu_available()  # a GPU measures now; without one the committed CSVs are shown
print(nbu.machine_line())'''

HOW_TO_RUN = '''
Interactive: run all cells in JupyterLab. Batch: `papermill notebooks/{name}.ipynb build/notebooks/{name}.ipynb -p NAME VALUE`
(`papermill --help-notebook notebooks/{name}.ipynb` lists the parameters); `python -m xlab.report` runs every notebook.
On a GPU machine the notebook measures and writes its CSV to `data/`; without a GPU it runs what the CPU can check,
shows the committed CSV and says which machine and date it comes from, and skips a figure whose CSV is missing.'''

NOTEBOOKS = {
    "01_correctness": [
        ("md", '''\
# 01 · Correctness gate

Every check of the training workload, one pass/fail table with the measured errors.
On the CPU (NumPy): finite-difference gradients of every op and of the GPT loss (float64), float32 against
float64, PyTorch parity (logits, loss, every gradient, AdamW steps), overfitting one batch, checkpoint round trip
and bit-exact resume, batch consistency, and the closed loop from training to serving.
On a GPU, in addition: the same checks on CuPy and the **bitwise transparency gate**: training under raw
`cudaMalloc`, CuPy's pool and xpool must give identical losses and parameters, bit for bit.
Results: the CPU checks run here go to `build/correctness_cpu.csv` (a run never rewrites committed data; the
committed `data/correctness_cpu.csv` is refreshed on purpose with `python -m xlab.correctness --out
data/correctness_cpu.csv`), the GPU checks to `data/correctness_gpu.csv`.
''' + HOW_TO_RUN.format(name="01_correctness")),
        ("params", '''\
with_torch: bool = True  # PyTorch parity checks (needs torch)
transparency_steps: int = 50  # GPU only: training steps per allocator in the bitwise transparency gate
measure: bool = True  # on a GPU: run the GPU checks now and overwrite data/correctness_gpu.csv
fail_on_error: bool = True  # the last cell raises if a check run here failed, so papermill and CI fail
''' + COMMON_PARAMS),
        ("code", SETUP),
        ("md", "## Checks on the CPU (run now, written to `build/correctness_cpu.csv`)"),
        ("code", '''\
cpu_checks = nbu.run_correctness("cpu", with_torch=with_torch, out=nbu.build_dir() / "correctness_cpu.csv")'''),
        ("md", "## Checks on a GPU (run now on a GPU machine, else the committed results)"),
        ("code", '''\
gpu_checks = nbu.load_or_measure("correctness_gpu", nbu.run_correctness, gpu, data_dir, measure,
                                 device="gpu", transparency_steps=transparency_steps)'''),
        ("md", "## Verdict"),
        ("code", '''\
checks = pd.concat([f for f in (cpu_checks, gpu_checks) if f is not None], ignore_index=True)
nbu.correctness_summary(checks)'''),
        ("code", 'nbu.table(checks, ["device", "check", "measured", "threshold", "passed"])'),
        ("code", 'nbu.figure(plots.correctness, checks, "correctness", figures_dir)'),
        ("md", "The gate: this cell raises, failing the notebook (and papermill, and CI), if a check run here failed."),
        ("code", '''\
if fail_on_error:
    nbu.assert_all_passed(nbu.measured_here(cpu_checks, gpu_checks))'''),
    ],
    "02_allocator_microbench": [
        ("md", '''\
# 02 · Allocator microbenchmark

Microseconds per `a = cupy.empty(n, uint8); del a` pair for each allocator and request size on one thread, and
thousands of pairs per second with several threads allocating on one GPU. Peers: raw `cudaMalloc`/`cudaFree`
(alone on the device, and with one small block held alive, which makes small pairs ten times cheaper), CuPy's
`MemoryPool` (the default) and `MemoryAsyncPool`, PyTorch's caching allocator (where PyTorch has CUDA), and
allocators doing no work (the floor of CuPy's allocation path); xpool's default scheme and the design's.
Five trials, the allocators interleaved in each; medians with 95% bootstrap intervals.
Measured by `python -m xlab.bench.alloc --out data/alloc_microbench.csv`.
''' + HOW_TO_RUN.format(name="02_allocator_microbench")),
        ("params", '''\
quick: bool = False  # GPU only: fewer trials, short windows (a smoke run, not numbers to quote)
measure: bool = True  # on a GPU: measure now and overwrite data/alloc_microbench.csv
threads_size_bytes: int = 65536  # request size of the thread-scaling table and figure (bytes)
''' + COMMON_PARAMS),
        ("code", SETUP),
        ("code", '''\
bench = nbu.load_or_measure("alloc_microbench", "xlab.bench.alloc:run", gpu, data_dir, measure,
                            how_to_measure="python -m xlab.bench.alloc --out data/alloc_microbench.csv",
                            quick=quick)'''),
        ("md", "## One thread: µs per alloc/free pair (median over trials; lower is faster)"),
        ("code", 'nbu.pivot(bench, index="allocator", columns="size_bytes", values="us_per_pair", threads=1)'),
        ("code", 'nbu.figure(plots.alloc_cost, bench, "alloc_cost", figures_dir)'),
        ("md", "## Several threads on one GPU: thousand pairs per second, all threads together"),
        ("code", '''\
nbu.pivot(bench, index="allocator", columns="threads", values="kpairs_per_s", size_bytes=threads_size_bytes)'''),
        ("code", 'nbu.figure(plots.alloc_threads, bench, "alloc_threads", figures_dir, size_bytes=threads_size_bytes)'),
        ("md", '''\
## CuPy and PyTorch in one pool

With `xpool.enable_torch()` PyTorch allocates from the same pool as CuPy. Left: µs per `torch.empty`+`del` pair
through xpool and through PyTorch's own caching allocator; right: tokens/s of a PyTorch training step (the parity
model at the reference size) through each; medians of five interleaved trials (each arm a fresh process) with
95% intervals. Measured by `python -m xlab.bench.torch_interop --out data/torch_interop.csv`.'''),
        ("code", '''\
from xlab.bench import torch_interop
interop = nbu.load_csv("torch_interop", data_dir)
torch_interop.plot(interop) if interop is not None else print("no data/torch_interop.csv yet")'''),
        ("md", '''\
A mixed loop (a PyTorch training step, then CuPy work on its weights through DLPack, feeding the next step), on a GPU
with PyTorch: the bytes each framework holds in the one pool over time, the pool's reserved bytes, and (dashed) the
peak that the two frameworks' own pools reserve together. Once warm the stack alternates between the frameworks
while reserved stays flat: each reuses what the other freed.'''),
        ("code", '''\
if gpu and measure and torch_interop.torch_cuda_available():
    mem, peaks = torch_interop.mixed_memory()
    print(f"peak reserved: one pool {peaks['one_pool'] / 2**20:.0f} MiB, two pools {peaks['two_pools'] / 2**20:.0f} MiB")
    display(torch_interop.plot_mixed_memory(mem, peaks["two_pools"]))
else:
    print("The mixed loop runs on a GPU with PyTorch (CUDA) only.")'''),
    ],
    "03_single_gpu": [
        ("md", '''\
# 03 · One GPU: training throughput and memory

The small GPT (12 layers, 384 wide, 256 tokens per sequence; every op makes a fresh array) trained under each
allocator: tokens per second, host ms per step (the dispatching thread's CPU time), the step's span on the GPU
stream (CUDA events), mean GPU utilisation (NVML) and what bounds the step, device mallocs per step after warm-up,
and peak memory reserved against requested. Five trials, allocators interleaved; flat-buffer AdamW.
Measured by `xlab.experiments.single_gpu.run`, writing `data/single_gpu.csv` (one row per trial).
''' + HOW_TO_RUN.format(name="03_single_gpu")),
        ("params", '''\
steps: int = 10  # timed steps per run
warmup: int = 3  # untimed steps before the timed ones
trials: int = 5  # trials per (batch, allocator), interleaved across allocators
batches: list = [32, 4]  # batch sizes (sequences per step)
allocators: list = []  # allocators to compare (empty: raw, cupy_pool and xpool's two arms)
measure: bool = True  # on a GPU: measure now and overwrite data/single_gpu.csv
cpu_check: bool = True  # without a GPU: run the measuring code on NumPy with a tiny model (measures nothing)
''' + COMMON_PARAMS),
        ("code", SETUP),
        ("md", "## Without a GPU: the measuring code itself, on NumPy (checks the code, measures nothing)"),
        ("code", '''\
if cpu_check and not gpu:
    nbu.cpu_smoke("xlab.experiments.single_gpu:run", config="tiny", batches=(2,), steps=2, warmup=1,
                  progress=False, trials=2)'''),
        ("md", "## Measurements (medians over trials; the CSV keeps every trial)"),
        ("code", '''\
runs = nbu.load_or_measure("single_gpu", "xlab.experiments.single_gpu:run", gpu, data_dir, measure,
                           allocators=tuple(allocators) or None, batches=tuple(batches), steps=steps,
                           warmup=warmup, trials=trials)'''),
        ("code", '''\
nbu.medians(runs, ["batch", "allocator"], ["tokens_per_s", "ms_per_step", "host_ms_per_step", "gpu_ms_per_step",
                                           "gpu_util_mean", "device_mallocs_per_step", "reserved_over_requested"])'''),
        ("code", 'nbu.figure(plots.single_gpu, runs, "single_gpu", figures_dir)'),
    ],
    "04_multi_gpu": [
        ("md", '''\
# 04 · Several GPUs: data-parallel scaling

Data-parallel training of the same GPT on 1 and 2 GPUs, either one thread per GPU in one process (`threads`) or
one process per GPU (`processes`), gradients all-reduced with NCCL every step: tokens per second, speedup over one
GPU, GPU utilisation, before (raw `cudaMalloc`) and after (a pool); then the batch sweep: one thread per GPU on 2
GPUs against 1 at per-GPU batch 4 to 128, where the host bound ends. Five trials, allocators interleaved.
Measured by `xlab.experiments.ddp.run` and `xlab.experiments.sweep.run`, writing `data/ddp_scaling.csv` and
`data/batch_sweep.csv` (one row per trial). Last, the step as a CUDA graph: forward and backward captured once
over a private pool and replayed (`_graph` arms, `tapegpt.graph`), beside the eager arms (`data/graph/`).
''' + HOW_TO_RUN.format(name="04_multi_gpu")),
        ("params", '''\
modes: list = ["threads", "processes"]  # one thread per GPU in one process, and/or one process per GPU
worlds: list = [1, 2]  # numbers of GPUs
allocators: list = []  # allocators to compare (empty: raw, cupy_pool and xpool's two arms)
batch: int = 32  # sequences per GPU per step
steps: int = 8  # timed steps per run
trials: int = 5  # trials per (mode, world, allocator), interleaved across allocators
sweep: bool = True  # on a GPU machine: also measure the batch sweep (data/batch_sweep.csv)
graph: bool = True  # on a GPU machine: also measure threads with the graph arms (data/graph/ddp_scaling.csv)
measure: bool = True  # on a GPU machine: measure now and overwrite data/ddp_scaling.csv
cpu_check: bool = True  # without a GPU: run the measuring code on NumPy with a tiny model (measures nothing)
''' + COMMON_PARAMS),
        ("code", SETUP),
        ("md", "## Without a GPU: the data-parallel code on NumPy, ranks as threads (checks the code, measures nothing)"),
        ("code", '''\
if cpu_check and not gpu:
    nbu.cpu_smoke("xlab.experiments.ddp:run", modes=("threads",), worlds=(1, 2), config="tiny", batch=2,
                  steps=2, progress=False, trials=2)
    nbu.cpu_smoke("xlab.experiments.sweep:run", batches=(2, 4), config="tiny", steps_scale=0.3, progress=False,
                  trials=2)'''),
        ("md", "## Measurements (medians over trials; the CSV keeps every trial)"),
        ("code", '''\
scaling = nbu.load_or_measure("ddp_scaling", "xlab.experiments.ddp:run", gpu, data_dir, measure,
                              modes=tuple(modes), worlds=tuple(worlds), allocators=tuple(allocators) or None,
                              batch=batch, steps=steps, trials=trials)'''),
        ("md", "Speedup over the same allocator on one GPU:"),
        ("code", 'nbu.pivot(scaling, index=["mode", "allocator"], columns="world", values="speedup")'),
        ("md", "Tokens per second, all GPUs together:"),
        ("code", 'nbu.pivot(scaling, index=["mode", "allocator"], columns="world", values="tokens_per_s")'),
        ("code", 'nbu.figure(plots.ddp_scaling, scaling, "ddp_scaling", figures_dir)'),
        ("code", 'nbu.figure(plots.ddp_before_after, scaling, "ddp_before_after", figures_dir)'),
        ("md", "## Batch sweep: one thread per GPU, 2 GPUs over 1, by per-GPU batch"),
        ("code", '''\
sweep_runs = nbu.load_or_measure("batch_sweep", "xlab.experiments.sweep:run", gpu, data_dir, measure and sweep,
                                 trials=trials)'''),
        ("code", 'nbu.pivot(sweep_runs, index="allocator", columns="batch", values="speedup", world=2)'),
        ("code", 'nbu.figure(plots.batch_sweep, sweep_runs, "batch_sweep", figures_dir)'),
        ("md", "## The step as a CUDA graph: eager arms against `_graph` arms (one thread per GPU)"),
        ("code", '''\
graph_runs = nbu.load_or_measure("graph/ddp_scaling", "xlab.experiments.ddp:run", gpu, data_dir, measure and graph,
                                 modes=("threads",), worlds=tuple(worlds), batch=batch, steps=12, trials=trials,
                                 allocators=("raw", "cupy_pool", "xpool", "cupy_pool_graph", "xpool_graph"))
graph_single = [nbu.load_csv(n, data_dir) for n in ("graph/single_gpu", "graph/single_gpu_b4")]'''),
        ("code", 'nbu.pivot(graph_runs, index=["mode", "allocator"], columns="world", values="speedup")'),
        ("code", '''\
graph_frames = [df for df in graph_single + [graph_runs] if df is not None]
nbu.figure(plots.graph_steps, pd.concat(graph_frames) if graph_frames else None, "graph_steps", figures_dir)'''),
    ],
    "05_memory": [
        ("md", '''\
# 05 · Memory: waste by size-class setting, and one step over time

For k = 1, 2, 4, 8 size classes per doubling above 1 MiB: the bytes the classes hand out over the bytes requested
(one training step's requests), and peak bytes reserved over peak bytes requested (the whole run). On a GPU:
measured with xpool installed, plus the allocation timeline of the run (`data/memory_timeline.csv`).
On any machine: the recorded requests and frees are replayed, in order, through xpool's core over a fake address
space for every k. A program's requests do not depend on the allocator, so the replay reproduces each setting's
decisions exactly; the table checks it against the GPU's own counters (`replay_exact`).
''' + HOW_TO_RUN.format(name="05_memory")),
        ("params", '''\
ks: list = [1, 2, 4, 8]  # size classes per doubling to compare
batch: int = 32  # GPU only: sequences per step in the recorded run
warmup: int = 1  # GPU only: training steps before the recorded one
measure: bool = True  # on a GPU: measure now and overwrite data/memory_waste.csv and data/memory_timeline.csv
''' + COMMON_PARAMS),
        ("code", SETUP + '''
from xlab import memory_study'''),
        ("code", '''\
measured = nbu.load_or_measure("memory_waste", "xlab.memory_study:run", gpu, data_dir, measure,
                               how_to_measure="python -m xlab.memory_study --out-dir data",
                               ks=tuple(ks), batch=batch, warmup=warmup)
timeline = nbu.load_csv("memory_timeline", data_dir)'''),
        ("md", "## Replay of the recorded requests through xpool's core, for every k (runs on the CPU)"),
        ("code", '''\
replayed = memory_study.replay_waste(timeline, ks) if timeline is not None else None
memory_study.waste_table(measured, replayed)'''),
        ("code", '''\
nbu.figure(plots.memory_waste, measured if measured is not None else replayed, "memory_waste", figures_dir)'''),
        ("md", "## Memory over time: the whole recording, and one training step"),
        ("code", 'nbu.figure(plots.memory_timeline, timeline, "memory_timeline", figures_dir)'),
    ],
}


def build(name: str, cells) -> nbformat.NotebookNode:
    """One notebook: stable ids (name-NN), no outputs, the parameters cell tagged."""
    nb = nbformat.v4.new_notebook()
    nb.metadata = {
        "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
        "language_info": {"name": "python"},
    }
    for i, (kind, source) in enumerate(cells):
        if kind == "md":
            cell = nbformat.v4.new_markdown_cell(source)
        else:
            cell = nbformat.v4.new_code_cell(source)
            if kind == "params":
                cell.metadata["tags"] = ["parameters"]
        cell.id = f"{name.split('_')[0]}-{i:02d}"
        nb.cells.append(cell)
    nbformat.validate(nb)
    return nb


def render(name: str) -> str:
    return nbformat.writes(build(name, NOTEBOOKS[name])) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="only compare; exit 1 if a notebook is out of date")
    args = p.parse_args(argv)
    NB_DIR.mkdir(exist_ok=True)
    stale = []
    for name in NOTEBOOKS:
        path = NB_DIR / f"{name}.ipynb"
        text = render(name)
        if path.is_file() and path.read_text() == text:
            continue
        stale.append(path)
        if not args.check:
            path.write_text(text)
    for path in stale:
        print(f"{'out of date' if args.check else 'wrote'}: {path.relative_to(ROOT)}")
    return 1 if (args.check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
