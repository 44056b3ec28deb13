"""Write notebooks/*.ipynb from the cell sources below: output-free, stable cell ids, diff-friendly.

    python scripts/make_notebooks.py           # (re)write the notebooks
    python scripts/make_notebooks.py --check   # exit 1 if a committed notebook differs from this script

Each notebook is thin: a markdown header, one cell tagged `parameters` (literal, annotated, commented
defaults, so `papermill --help-notebook` documents them; `nbu.setup` checks them), then calls into the lab,
summary tables and figures.
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
data_dir: str = ""  # folder of the committed CSVs shown (empty: the repository's data/)
publish: bool = False  # write what this run measures to data/ and redraw figures/ (default: build/ only)'''


def setup(name: str, extra: str = "") -> str:
    return f'''\
import pandas as pd

from xlab import notebook_utils as nbu{extra}

run = nbu.setup("{name}", globals())  # checks the parameters; a GPU measures now, a CPU shows the committed CSVs'''


def header(name: str, example: str) -> str:
    return f'''
**Run it.** In JupyterLab (`.venv/bin/jupyter lab`, open `notebooks/{name}.ipynb`, Run > Run All Cells), or in batch
from the repository's root with the environment active (`. .venv/bin/activate`):
`mkdir -p build/notebooks && papermill notebooks/{name}.ipynb build/notebooks/{name}.ipynb {example}`
(`papermill --help-notebook notebooks/{name}.ipynb` lists the parameters; `python -m xlab.report` runs every notebook).
On a GPU machine it measures and writes its CSV to `build/data/` (with `-p publish True`: to `data/`, and redraws
`figures/`); without a GPU it shows the committed CSVs, newest of each kind, and says which machine and date they
come from. A run writes nothing outside `build/` unless asked. Tables are summaries; click "All rows" for every row.'''


NOTEBOOKS = {
    "01_correctness": [
        ("md", '''\
# 01 · Correctness gate

Every check of the training workload, one pass/fail summary with the measured errors.
On the CPU (NumPy): finite-difference gradients of every op and of the GPT loss (float64), float32 against
float64, PyTorch parity (logits, loss, every gradient, AdamW steps), overfitting one batch, checkpoint round trip
and bit-exact resume, batch consistency, and the closed loop from training to serving.
On a GPU, in addition: the same checks on CuPy and the **bitwise transparency gate**: training under raw
`cudaMalloc`, CuPy's pool and xpool must give identical losses and parameters, bit for bit.
The CPU checks run here go to `build/data/correctness_cpu.csv` (with `publish`: `data/correctness_cpu.csv`).
''' + header("01_correctness", "-p with_torch False")),
        ("params", '''\
with_torch: bool = True  # PyTorch parity checks (needs torch)
transparency_steps: int = 50  # GPU only: training steps per allocator in the bitwise transparency gate
measure: bool = True  # on a GPU: run the GPU checks now
fail_on_error: bool = True  # the last cell raises if a check run here failed, so papermill and CI fail
''' + COMMON_PARAMS),
        ("code", setup("01_correctness")),
        ("md", "## Checks on the CPU (run now)"),
        ("code", '''\
cpu_checks = nbu.run_correctness("cpu", with_torch=with_torch, out=run.out / "correctness_cpu.csv")'''),
        ("md", "## Checks on a GPU (run now on a GPU machine, else the committed results)"),
        ("code", '''\
gpu_checks = nbu.load_or_measure("correctness_gpu", nbu.run_correctness, run.gpu, run.data, measure, out=run.out,
                                 device="gpu", transparency_steps=transparency_steps)'''),
        ("md", "## Verdict, by device and family of checks"),
        ("code", '''\
checks = pd.concat([f for f in (cpu_checks, gpu_checks) if f is not None], ignore_index=True)
nbu.details(nbu.correctness_summary(checks), checks[["device", "check", "measured", "threshold", "passed"]])'''),
        ("code", 'nbu.figure("correctness", checks, run=run)'),
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
`MemoryPool` (the default) and `MemoryAsyncPool`, PyTorch's caching allocator handing CuPy its blocks (where
PyTorch has CUDA), and allocators doing no work (the floor of CuPy's allocation path); xpool's default scheme and
the seed scheme. Trials interleaved across the allocators; medians with 95% bootstrap intervals.
Measured by `python -m xlab.bench.alloc`; the cached arms again at the final hit path (`alloc_hit_sweep.csv`).
''' + header("02_allocator_microbench", "-p quick True")),
        ("params", '''\
quick: bool = False  # GPU only: fewer trials, short windows (a smoke run, not numbers to quote)
measure: bool = True  # on a GPU: measure now
threads_size_bytes: int = 65536  # request size of the thread-scaling table and figure (bytes)
''' + COMMON_PARAMS),
        ("code", setup("02_allocator_microbench", "\nfrom xlab.bench import torch_interop")),
        ("code", '''\
bench = nbu.load_or_measure("alloc_microbench", "xlab.bench.alloc:run", run.gpu, run.data, measure, out=run.out,
                            how_to_measure="python -m xlab.bench.alloc --out data/alloc_microbench.csv",
                            quick=quick)'''),
        ("md", "## One thread: µs per alloc/free pair (lower is faster), and CuPy's pool's time over each arm's"),
        ("code", '''\
sizes = nbu.rows("alloc_size", run, bench)
nbu.summary(sizes, ["allocator", "size_bytes", "csv"], ["us_per_pair", "ratio_vs_cupy_pool"])'''),
        ("code", 'nbu.figure("alloc_cost", sizes, run=run)'),
        ("md", "## Several threads on one GPU: thousand pairs per second, all threads together"),
        ("code", '''\
threads = nbu.rows("alloc_threads", run, bench)
nbu.summary(threads[threads["size_bytes"] == threads_size_bytes] if threads is not None else None,
            ["allocator", "threads", "csv"], ["kpairs_per_s"])'''),
        ("code", 'nbu.figure("alloc_threads", threads, run=run, size_bytes=threads_size_bytes)'),
        ("md", '''\
## CuPy and PyTorch in one pool

With `xpool.enable_torch()` PyTorch allocates from the same pool as CuPy. µs per `torch.empty`+`del` pair through
xpool and through PyTorch's own caching allocator, and tokens/s of a PyTorch training step (the parity model at the
reference size) through each; interleaved trials, each arm a fresh process. Measured by
`python -m xlab.bench.torch_interop --out data/torch_interop.csv`.'''),
        ("code", '''\
interop = nbu.rows("torch_interop.csv", run)
nbu.summary(interop, ["case", "size_bytes", "arm"], ["value"])'''),
        ("code", 'nbu.figure("torch_interop", interop, run=run)'),
        ("md", '''\
A mixed loop (a PyTorch training step, then CuPy work on its weights through DLPack, feeding the next step), on a GPU
with PyTorch: the bytes each framework holds in the one pool over time, the pool's reserved bytes, and (dashed) the
peak that the two frameworks' own pools reserve together. Once warm the stack alternates between the frameworks
while reserved stays flat: each reuses what the other freed.'''),
        ("code", '''\
if run.gpu and measure and torch_interop.torch_cuda_available():
    mem, peaks = torch_interop.mixed_memory()
    print(f"peak reserved: one pool {peaks['one_pool'] / 2**20:.0f} MiB, two pools {peaks['two_pools'] / 2**20:.0f} MiB")
    display(nbu.show(torch_interop.plot_mixed_memory(mem, peaks["two_pools"])))
else:
    print("The mixed loop runs on a GPU with PyTorch (CUDA) only.")'''),
    ],
    "03_single_gpu": [
        ("md", '''\
# 03 · One GPU: training throughput and memory

The small GPT (12 layers, 384 wide, 256 tokens per sequence; every op makes a fresh array) trained under each
allocator: tokens per second, host ms per step (the dispatching thread's CPU time), the step's span on the GPU
stream (CUDA events), mean GPU utilisation (NVML) and what bounds the step, device mallocs per step after warm-up,
and peak memory reserved against requested. Trials interleaved across the allocators; flat-buffer AdamW.
Measured by `xlab.experiments.single_gpu.run` (`data/single_gpu.csv`; xpool and CuPy's pool again after the release
rule, `data/single_gpu_recheck.csv`).
''' + header("03_single_gpu", "-p batches 4 -p trials 3")),
        ("params", '''\
steps: int = 10  # timed steps per run
warmup: int = 3  # untimed steps before the timed ones
trials: int = 5  # trials per (batch, allocator), interleaved across allocators
batches: list[int] = [32, 4]  # batch sizes (sequences per step); one number is one batch size
allocators: list[str] = []  # arms to compare (xlab.allocators.ARMS; empty: raw, cupy_pool, xpool, xpool_seed)
measure: bool = True  # on a GPU: measure now
cpu_check: bool = True  # without a GPU: run the measuring code on NumPy with a tiny model (measures nothing)
''' + COMMON_PARAMS),
        ("code", setup("03_single_gpu")),
        ("md", "## Without a GPU: the measuring code itself, on NumPy (checks the code, measures nothing)"),
        ("code", '''\
if cpu_check and not run.gpu:
    nbu.cpu_smoke("xlab.experiments.single_gpu:run", config="tiny", batches=(2,), steps=2, warmup=1,
                  progress=False, trials=2)'''),
        ("md", "## Measurements (medians over trials [95% interval]; every trial a click away)"),
        ("code", '''\
runs = nbu.load_or_measure("single_gpu", "xlab.experiments.single_gpu:run", run.gpu, run.data, measure, out=run.out,
                           allocators=tuple(allocators) or None, batches=tuple(batches), steps=steps,
                           warmup=warmup, trials=trials)
rows = nbu.rows("single_gpu", run, runs)
nbu.summary(rows, ["batch", "allocator", "csv"], ["tokens_per_s", "host_ms_per_step", "gpu_ms_per_step",
                                                  "gpu_util_mean", "device_mallocs_per_step", "reserved_over_requested"])'''),
        ("code", 'nbu.figure("single_gpu", rows, run=run)'),
    ],
    "04_multi_gpu": [
        ("md", '''\
# 04 · Several GPUs: data-parallel scaling

Data-parallel training of the same GPT on 1 and 2 GPUs, either one thread per GPU in one process (`threads`) or
one process per GPU (`processes`), gradients all-reduced with NCCL every step: tokens per second, speedup over one
GPU, GPU utilisation, before (raw `cudaMalloc`) and after (a pool); then the batch sweep: one thread per GPU on 2
GPUs against 1 at per-GPU batch 4 to 128, where the host bound ends. Trials interleaved across the allocators.
Measured by `xlab.experiments.ddp.run` and `xlab.experiments.sweep.run` (`data/ddp_scaling.csv`; its newer run
`data/ddp_expandable.csv` beside the expandable scheme; `data/batch_sweep.csv`). Last, the step as a CUDA graph: forward and backward captured once over a private pool and
replayed (`_graph` arms, `tapegpt.graph`), beside the eager arms (`data/graph/`).
''' + header("04_multi_gpu", "-p modes threads -p worlds 1,2")),
        ("params", '''\
modes: list[str] = ["threads", "processes"]  # one thread per GPU in one process, and/or one process per GPU
worlds: list[int] = [1, 2]  # numbers of GPUs
allocators: list[str] = []  # arms to compare (xlab.allocators.ARMS; empty: raw, cupy_pool, xpool, xpool_seed)
batch: int = 32  # sequences per GPU per step
steps: int = 8  # timed steps per run
trials: int = 5  # trials per (mode, world, allocator), interleaved across allocators
sweep: bool = True  # on a GPU machine: also measure the batch sweep
graph: bool = True  # on a GPU machine: also measure threads with the graph arms
measure: bool = True  # on a GPU machine: measure now
cpu_check: bool = True  # without a GPU: run the measuring code on NumPy with a tiny model (measures nothing)
''' + COMMON_PARAMS),
        ("code", setup("04_multi_gpu")),
        ("md", "## Without a GPU: the data-parallel code on NumPy, ranks as threads (checks the code, measures nothing)"),
        ("code", '''\
if cpu_check and not run.gpu:
    nbu.cpu_smoke("xlab.experiments.ddp:run", modes=("threads",), worlds=(1, 2), config="tiny", batch=2,
                  steps=2, progress=False, trials=2)
    nbu.cpu_smoke("xlab.experiments.sweep:run", batches=(2, 4), config="tiny", steps_scale=0.3, progress=False,
                  trials=2)'''),
        ("md", "## Measurements (medians over trials [95% interval]; every trial a click away)"),
        ("code", '''\
scaling = nbu.load_or_measure("ddp_scaling", "xlab.experiments.ddp:run", run.gpu, run.data, measure, out=run.out,
                              modes=tuple(modes), worlds=tuple(worlds), allocators=tuple(allocators) or None,
                              batch=batch, steps=steps, trials=trials)
ddp = nbu.rows("ddp", run, scaling)
nbu.summary(ddp, ["mode", "world", "allocator"], ["tokens_per_s", "speedup", "gpu_util_mean"])'''),
        ("code", 'nbu.figure("ddp_scaling", ddp, run=run)'),
        ("code", 'nbu.figure("ddp_before_after", ddp, run=run)'),
        ("md", "## Batch sweep: one thread per GPU, 2 GPUs over 1, by per-GPU batch"),
        ("code", '''\
swept = nbu.load_or_measure("batch_sweep", "xlab.experiments.sweep:run", run.gpu, run.data, measure and sweep,
                            out=run.out, trials=trials)
sweep_rows = nbu.rows("batch_sweep", run, swept)
nbu.summary(sweep_rows, ["world", "batch", "allocator", "csv"], ["speedup", "host_ms_per_step", "ms_per_step"])'''),
        ("code", 'nbu.figure("batch_sweep", sweep_rows, run=run)'),
        ("md", "## The step as a CUDA graph: eager arms against `_graph` arms"),
        ("code", '''\
graphed = nbu.load_or_measure("graph/ddp_scaling", "xlab.experiments.ddp:run", run.gpu, run.data,
                              measure and graph, out=run.out, modes=("threads",), worlds=tuple(worlds), batch=batch,
                              steps=12, trials=trials,
                              allocators=("raw", "cupy_pool", "xpool", "cupy_pool_graph", "xpool_graph"))
graph_rows = nbu.rows("graph", run, graphed)
nbu.summary(graph_rows, ["mode", "world", "batch", "allocator"], ["tokens_per_s", "speedup", "dispatch_ms_per_step",
                                                                 "gpu_util_mean"])'''),
        ("code", 'nbu.figure("graph_steps", graph_rows, run=run)'),
    ],
    "05_memory": [
        ("md", '''\
# 05 · Memory: the seed scheme's waste by size-class setting, one step over time, every scheme replayed

For k = 1, 2, 4, 8 size classes per doubling above 1 MiB (xpool's seed scheme, `classes_per_doubling`): the bytes
the classes hand out over the bytes requested (one training step's requests), and peak bytes reserved over peak
bytes requested (the whole run). On a GPU: measured with xpool installed, plus the allocation timeline of the run
(`memory_timeline.csv`, at k = 1). On any machine: the recorded requests and frees are replayed, in order, through
xpool's core over a fake address space for every k. A program's requests do not depend on the allocator, so the
replay reproduces each setting's decisions exactly; the table checks it against the GPU's own counters
(`replay_exact`). Last, every recorded trace replayed through each scheme (`memory_schemes.csv`).
''' + header("05_memory", "-p ks 4")),
        ("params", '''\
ks: list[int] = [1, 2, 4, 8]  # size classes per doubling to compare; one number is one setting
batch: int = 32  # GPU only: sequences per step in the recorded run
warmup: int = 1  # GPU only: training steps before the recorded one
measure: bool = True  # on a GPU: measure now
''' + COMMON_PARAMS),
        ("code", setup("05_memory", "\nfrom xlab import memory_study")),
        ("code", '''\
measured = nbu.load_or_measure("memory_waste", "xlab.memory_study:run", run.gpu, run.data, measure, out=run.out,
                               how_to_measure="python -m xlab.memory_study --out-dir data",
                               ks=tuple(ks), batch=batch, warmup=warmup)
timeline = nbu.load_csv("memory_timeline", run.out if measured is not None and measured.attrs["source"] == "measured"
                        else run.data)'''),
        ("md", "## Replay of the recorded requests through xpool's core, for every k (runs on the CPU)"),
        ("code", '''\
replayed = memory_study.replay_waste(timeline, ks) if timeline is not None else None
memory_study.waste_table(measured, replayed)'''),
        ("code", 'nbu.figure("memory_waste", measured if measured is not None else replayed, run=run)'),
        ("md", "## Memory over time: the whole recording, and one training step"),
        ("code", 'nbu.figure("memory_timeline", timeline, run=run)'),
        ("md", "## Every recorded trace through each scheme (replayed on the CPU: `python -m xlab.memory_study --schemes`)"),
        ("code", '''\
schemes = nbu.rows("memory_schemes.csv", run)
nbu.summary(schemes, ["trace", "allocator"], ["reserved_over_requested", "device_mallocs_warm", "ns_per_pair"])'''),
        ("code", 'nbu.figure("memory_schemes", schemes, run=run)'),
    ],
    "06_dynamic_shapes": [
        ("md", '''\
# 06 · Dynamic shapes: memory held, device calls and speed when the shapes change every step

Workloads whose shapes change every step (a CuPy loop of FFTs, sorts, cumsums and matmuls of random sizes whose
results live a random number of steps; tapegpt's GPT and a PyTorch `TransformerEncoder` language model trained at a
sequence length drawn every step; a ResNet-18 at an image size drawn every step), beside fixed-shape controls (the
GPT at batch 32 and 4, the PyTorch model at one length, the ResNet at 224 px), under every peer (CuPy's `MemoryPool` and `MemoryAsyncPool`, RMM's pool; PyTorch's caching allocator with
and without `expandable_segments:True`) and every xpool scheme: peak reserved over peak requested, device calls per
timed step and per step in steady state (after the demand's last new high), and ms per step over the fastest peer's
in the same trial. Trials interleaved, each arm a process of
its own. Measured by `python -m xlab.bench.dynamic` (`data/dynamic_shapes.csv`); on a GPU this notebook runs a quick
pass by default (one trial of a few steps: checks the code, not numbers to quote).
''' + header("06_dynamic_shapes", "-p quick False")),
        ("params", '''\
quick: bool = True  # GPU only: one trial of a few steps; False: the full run (every trial and step)
workloads: list[str] = []  # workloads (xlab.bench.dynamic.WORKLOADS; empty: all but the held-out ones)
allocators: list[str] = []  # arms (xlab.allocators.ARMS; empty: every peer and every xpool scheme)
measure: bool = True  # on a GPU: measure now
cpu_check: bool = True  # without a GPU: run the benchmark's code on NumPy and PyTorch's CPU (measures nothing)
''' + COMMON_PARAMS),
        ("code", setup("06_dynamic_shapes", "\nfrom xlab.bench import dynamic") + '''
dynamic.resolve(workloads, cpu=True);  # an unknown workload is named here'''),
        ("md", "## Without a GPU: the benchmark's code on the CPU, small models (checks the code, measures nothing)"),
        ("code", '''\
if cpu_check and not run.gpu:
    nbu.cpu_smoke("xlab.bench.dynamic:run", workloads=["cupy_mix", "torch_fixed"], trials=1, steps=2, warmup=1,
                  start="spawn", progress=False)'''),
        ("md", "## Measurements (medians over trials [95% interval]; every trial a click away)"),
        ("code", '''\
measured = nbu.load_or_measure("dynamic_shapes", "xlab.bench.dynamic:run", run.gpu, run.data, measure, out=run.out,
                               how_to_measure="python -m xlab.bench.dynamic", workloads=workloads or None,
                               arms=allocators or None, start="spawn", **(dynamic.QUICK if quick else {}))
rows = nbu.rows("dynamic_shapes", run, measured)
nbu.details(dynamic.summary(rows), rows) if rows is not None else None'''),
        ("code", 'nbu.figure("dynamic_shapes", rows, run=run)'),
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
