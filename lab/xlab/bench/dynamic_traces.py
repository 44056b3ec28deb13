"""Record the allocation timelines of the dynamic-shape benchmark's workloads on a GPU, for replay on a CPU.

Each workload runs once, in a process of its own (PyTorch keeps its first allocator), under an xpool pool of
`--scheme` (its default settings) with its timeline on; every request and free goes to
`data/memory_trace_dyn_<workload>.csv.gz` with the step it belongs to (events before the first step's end are step
0) and the run's provenance, in the columns `xlab.memory_study` replays (its DYN_TRACES and HELD_OUT_TRACES). The
GPU's own peaks and device calls ride along (`gpu_*` columns), so a replay on the host twin can be checked against
the run it came from.

Besides the benchmark's workloads, `test_b4` and `test_b32_perparam` are the loop of
`tests/lab/test_gpu_expandable.py::test_training_maps_and_unmaps_nothing_once_warm` (10 steps, the previous step's
loss and grads alive while the next one runs). Under `--scheme segments` the GPU's timeline holds every device
malloc (a miss) and free (a release) itself; `data/segments_trace_dyn_test_*.csv.gz` are such timelines (recorded
at 8443035).

    python -m xlab.bench.dynamic_traces                     # every workload, scheme expandable, into data/
    python -m xlab.bench.dynamic_traces --workloads torch_varlen --seeds 1,2    # other realizations: ..._s1 ...
    python -m xlab.bench.dynamic_traces --workloads cupy_mix --cpu --out build/traces   # the code, on a CPU
    python -m xlab.bench.dynamic_traces --host --seeds 0,1,2,3,4    # CPU: cupy_fill's and cupy_image's host traces

Two workloads' requests can be had without a GPU (`--host`, HOST_TRACES), into
`data/memory_trace_host_dyn_<workload>[_s<seed>].csv.gz` in the same columns (gpu "none", no gpu_* columns):
cupy_fill's are its plan (dynamic_workloads.fill_plan: an array per planned request, freed at the end of its last step
in the order the workload drops them, nothing else allocated on the device), so that trace is the GPU's requests
exactly; cupy_image's are NumPy's and SciPy's on the CPU at the benchmark's size, through NumPy's allocation hook
(xlab.numpy_traces.NumpyRecorder): the same arrays as cupyx.scipy.ndimage's outputs and the FFTs' results, without
CuPy's own temporaries and cuFFT's work areas, so it stands in for the GPU's until `scripts/gpu_suite.sh traces`
records them.
"""
from __future__ import annotations

import argparse
import contextlib
import pathlib
import sys
import time
from functools import partial

import numpy as np
import pandas as pd

import xpool
from xlab.bench import dynamic
from xlab.experiments.train import Window
from xlab.memory_study import TIMELINE_COLUMNS
from xlab.provenance import provenance

CAPACITY = 4_000_000        # timeline events (72 bytes each)


def test_loop(steps, warmup, seed, window, gpu=True, small=False, after_step=lambda: None, *, batch, foreach):
    """The GPU test's loop: x, y, loss and grads rebound each step, so the previous step's live into the next."""
    from tapegpt import GPT, AdamW, GPTConfig, get_batch, load_corpus
    from xlab.bench.dynamic_workloads import _xp
    xp = _xp(gpu)
    cfg = GPTConfig(batch_size=batch) if not small else GPTConfig(batch_size=2, block_size=32, n_layer=2,
                                                                  n_embd=32, n_head=2, n_ffn=64)
    data = load_corpus()
    model = GPT(cfg, xp=xp)
    opt = AdamW(model.params, lr=1e-3, foreach=foreach)
    with window:
        for i in range(steps + warmup):
            x, y = get_batch(data, cfg.batch_size, cfg.block_size, i, xp=xp)
            loss, grads = model.loss_and_grads(x, y)
            opt.step(grads)
            after_step()
        window.dispatched()
    return dict(batch=batch, shape=f"T {cfg.block_size}, previous step kept")


TESTS = {"test_b4": ("cupy", partial(test_loop, batch=4, foreach=True), 5, 5),
         "test_b32_perparam": ("cupy", partial(test_loop, batch=32, foreach=False), 5, 5)}


def spec(name):
    """(framework, fn, steps, warmup) of a benchmark workload or a test loop."""
    if name in TESTS:
        return TESTS[name]
    w = dynamic.WORKLOADS[name]
    return w.framework, w.fn, w.steps, w.warmup


def record(name, scheme, gpu, small, seed=0) -> pd.DataFrame:
    """One workload under a fresh pool with its timeline on: the trace (one row per event, with its step)."""
    framework, fn, steps, warmup = spec(name)
    if gpu:
        pool = xpool.MemoryPool(scheme=scheme, timeline=CAPACITY)
    else:                                                   # on a CPU: no request reaches it
        from xpool_twin import TwinBackend                 # the tests' host twin holds scheme expandable
        pool = xpool.Pool(TwinBackend(), scheme=scheme, timeline=CAPACITY)
    marks, sync = [], (lambda: None)
    if framework == "torch":
        import torch
        if gpu:
            xpool.enable_torch(pool=pool)
            sync = torch.cuda.synchronize
        ctx = contextlib.nullcontext()
    else:
        if gpu:
            import cupy
            sync = cupy.cuda.Device().synchronize
        ctx = xpool.use(pool) if gpu else contextlib.nullcontext()
    with ctx:
        info = fn(steps, warmup, seed, Window(lambda: 0, sync), gpu, small,
                  after_step=lambda: marks.append(time.monotonic_ns()))
    sync()
    tl = pool.timeline()
    if tl.attrs.get("dropped"):
        raise RuntimeError(f"{name}: the timeline dropped {tl.attrs['dropped']} events; raise CAPACITY")
    tl["step"] = np.searchsorted(np.asarray(marks, dtype=np.int64), tl["t_ns"].to_numpy(), side="right")
    st = pool.stats()
    calls = st.device_mallocs + st.device_frees + st.device_maps + st.device_unmaps
    return tl[TIMELINE_COLUMNS].assign(
        workload=name, scheme=scheme, release_on_miss="never", steps=steps, warmup=warmup,   # every scheme's one rule
        seed=seed, batch=info["batch"], shape=info["shape"],
        gpu_peak_bytes_reserved=st.peak_bytes_reserved, gpu_peak_bytes_requested=st.peak_bytes_requested,
        gpu_device_calls=calls,
        **provenance(experiment="dynamic_trace"))


HOST_TRACES = ("cupy_fill", "cupy_image")     # --host: exactly (cupy_fill), or NumPy's stand-in (cupy_image)


def plan_trace(name: str, seed: int = 0) -> pd.DataFrame:
    """cupy_fill's requests at the benchmark's size, from its plan: every array made in its step and freed at the end of
    its last one (the ring's order), the arrays left after the last step freed after it (the teardown)."""
    from xlab.bench import dynamic_workloads as wl
    _, _, steps, warmup = spec(name)
    plan, rows, ring, ids = wl.fill_plan(warmup + steps, seed), [], [], iter(range(1, 1 << 62))
    for i, made in enumerate(plan + [[]]):
        last_step = i == len(plan)
        for b, last in made:
            ptr = next(ids) << 12
            rows.append((i, "alloc_miss", ptr, b))
            ring.append((last, ptr, b))
        keep = [] if last_step else [r for r in ring if r[0] > i]
        rows += [(i, "free", ptr, b) for last, ptr, b in ring if last_step or last <= i]
        ring = keep
    return pd.DataFrame(rows, columns=["step", "event", "ptr", "requested"])


def host_trace(name: str, seed: int = 0) -> pd.DataFrame:
    """One of HOST_TRACES at the benchmark's size, without a GPU, in record()'s columns (gpu_* left out)."""
    if name not in HOST_TRACES:
        raise ValueError(f"name must be one of {', '.join(HOST_TRACES)}, got {name!r}")
    framework, fn, steps, warmup = spec(name)
    if name == "cupy_fill":
        tl, info, how = plan_trace(name, seed), dict(batch=0, shape=""), "plan"
    else:
        from xlab.numpy_traces import NumpyRecorder
        rec, marks = NumpyRecorder(), []
        with rec:
            info = fn(steps, warmup, seed, Window(lambda: 0, lambda: None), False, False,
                      after_step=lambda: marks.append(len(rec.events)))
        ev = np.array(rec.events, dtype=np.int64).reshape(-1, 3)
        tl = pd.DataFrame({"step": np.searchsorted(np.asarray(marks), np.arange(len(ev)), side="right"),
                           "event": np.where(ev[:, 0] == 1, "alloc_miss", "free"), "ptr": ev[:, 1],
                           "requested": ev[:, 2]})                     # a free: the bytes NumPy frees
        how = "numpy"
    if name == "cupy_fill":
        from xlab.bench import dynamic_workloads as wl
        lo, hi = wl.FILL_SIZES
        info = dict(batch=0, shape=f"{wl.FILL_ARRAYS} arrays/step, {lo}-{hi} B")
    prov = provenance(experiment="dynamic_trace")
    prov["gpu"] = "none (the plan)" if how == "plan" else "none (NumPy and SciPy on the CPU)"
    return tl.assign(t_s=0.0, device=0, stream=0, size=tl["requested"], bytes_in_use=0, bytes_cached=0,
                     bytes_reserved=0)[TIMELINE_COLUMNS].assign(
        workload=name, scheme="none", release_on_miss="none", steps=steps, warmup=warmup, seed=seed,
        batch=info["batch"], shape=info["shape"], requests_from=how, **prov)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", default="cupy_mix,torch_varlen,gpt_varlen,gpt_b4,test_b4,test_b32_perparam,"
                                          "torch_fixed,gpt_b32,resnet_varres,resnet_fixed")
    p.add_argument("--scheme", default="expandable", choices=xpool.settings.SCHEMES)
    p.add_argument("--out", default="data", help="directory for memory_trace_dyn_<workload>.csv.gz")
    p.add_argument("--seeds", default="0", help="comma-separated seeds (default 0); seed s > 0 writes "
                                                "memory_trace_dyn_<workload>_s<s>.csv.gz")
    p.add_argument("--cpu", action="store_true", help="NumPy and PyTorch's CPU, small sizes: tests the code")
    p.add_argument("--host", action="store_true",
                   help=f"CPU: the host traces of {', '.join(HOST_TRACES)} (--workloads: among them; default both)")
    a = p.parse_args(argv)
    try:
        seeds = [int(x) for x in a.seeds.split(",")]
        if any(x < 0 for x in seeds):
            raise ValueError
    except ValueError:
        p.error(f"--seeds must be whole numbers >= 0, comma-separated; got {a.seeds!r}")
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.host:
        names = HOST_TRACES if a.workloads == p.get_default("workloads") else a.workloads.split(",")
        bad = [n for n in names if n not in HOST_TRACES]
        if bad:
            p.error(f"--host records {', '.join(HOST_TRACES)}; got {', '.join(bad)}")
        for name, seed in ((n, s) for n in names for s in seeds):
            tl = host_trace(name, seed)
            path = out / f"memory_trace_host_dyn_{name}{f'_s{seed}' if seed else ''}.csv.gz"
            tl.to_csv(path, index=False)
            print(f"{name}: {len(tl)} events, {tl['step'].max() + 1} steps ({tl['requests_from'].iloc[0]}) -> {path}",
                  flush=True)
        return 0
    for name, seed in ((n, s) for n in a.workloads.split(",") for s in seeds):
        t0 = time.perf_counter()
        tl = dynamic.in_process(record, name, a.scheme, not a.cpu, a.cpu, seed)
        path = out / f"memory_trace_dyn_{name}{f'_s{seed}' if seed else ''}.csv.gz"
        tl.to_csv(path, index=False)
        r = tl.iloc[0] if len(tl) else {}
        print(f"{name}: {len(tl)} events, {tl['step'].max() + 1 if len(tl) else 0} steps, GPU peak reserved / "
              f"requested {r.get('gpu_peak_bytes_reserved', 0) / max(r.get('gpu_peak_bytes_requested', 1), 1):.3f},"
              f" {r.get('gpu_device_calls', 0)} device calls, {time.perf_counter() - t0:.0f} s -> {path}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
