"""Data-parallel training over 1..N GPUs (global batch = per-GPU batch x N), NCCL all-reduce of gradients, in two
modes: one thread per GPU in one process, or one process per GPU (Note [Data-parallel modes], below).

How it reads: `run` -> for each world, a mode's arms (`threads_arms`: a ThreadGroup; `launch`: rank processes
running `rank_main`) -> runner.run_arm for each (trial, allocator) around rank functions built from
train.run_rank -> train.build_row. Nothing calls back up.

    df = ddp.run(worlds=(1, 2))                   # writes data/ddp_scaling.csv
    python -m xlab.experiments ddp --worlds 1 2 --modes threads processes --trials 5
"""
from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import multiprocessing as mp
import os
import pathlib
import pickle
import queue as queue_module
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings

from tqdm.auto import tqdm

from tapegpt import GPTConfig, load_corpus
from xlab import allocators as registry
from xlab.nvml import UtilSampler
from xlab.paths import repo_root, write_csv
from xlab.provenance import git_commit, provenance

from . import runner, train
from .single_gpu import TRIALS

# Note [Data-parallel modes]
# Two modes, the same allocators, trials interleaved across them (A B C D, A B C D, ...):
# - threads: one process, one Python thread per GPU, one NCCL communicator per thread (ThreadGroup: ncclCommInitRank
#   from each thread, NCCL's one-device-per-thread pattern; the calls release the GIL). The all-reduce is fenced
#   (train.Fenced, Note [The fence] in train.py) during warm-up, and in the timed steps only for allocators that
#   call the device once warm: a cudaMalloc/cudaFree during a peer's NCCL kernel deadlocks. The gradient
#   all-reduce is not overlapped with the backward pass: the tape runs backward as one call with no per-gradient
#   hook, so buckets on a side stream would need the workload changed.
# - processes: one process per GPU, started by mpirun (mpi4py) where it exists, else by multiprocessing spawn; each
#   rank runs the interleaved trials itself, so launch, CUDA and NCCL start-up are paid once.
# World 1 is the plain one-GPU loop in both modes (no communicator, no all-reduce), so a speedup is over training
# on one GPU, not over a one-rank all-reduce. Every run carries its checks: the loss curve against a single-GPU
# run on the same global batch (loss_rel_diff_max <= 1e-6) and the parameters across ranks after the run
# (param_rank_diff_max < 1e-6). NVLink multicast stays off: NCCL_NVLS_ENABLE=0 in every process (no_multicast).
BARRIER_TIMEOUT = 600      # seconds: a rank that waits longer than this has lost a peer


def no_multicast() -> None:
    """NCCL_NVLS_ENABLE=0 for this process and every process it starts (multicast can wedge shared GPUs)."""
    if os.environ.get("NCCL_NVLS_ENABLE", "0") != "0":
        warnings.warn("NCCL_NVLS_ENABLE was set to something other than 0; setting it to 0")
    os.environ["NCCL_NVLS_ENABLE"] = "0"


class NcclComm:
    """Sum all-reduce and broadcast of one CuPy array, in place, on the current stream."""

    def __init__(self, comm):
        self.comm = comm

    @staticmethod
    def _dtype(a):
        from cupy.cuda import nccl
        return {"float32": nccl.NCCL_FLOAT32, "float64": nccl.NCCL_FLOAT64}[a.dtype.name]

    def allreduce(self, buf):
        import cupy
        from cupy.cuda import nccl
        self.comm.allReduce(buf.data.ptr, buf.data.ptr, buf.size, self._dtype(buf), nccl.NCCL_SUM,
                            cupy.cuda.get_current_stream().ptr)

    def bcast(self, buf, root=0):
        import cupy
        self.comm.bcast(buf.data.ptr, buf.size, self._dtype(buf), root, cupy.cuda.get_current_stream().ptr)


def reference_losses(cfg, data, batch, steps, warmup, cpu=False) -> list:
    """The one-GPU loss curve (CuPy's pool, or NumPy) on the same global batch: what DDP must match."""
    xp = _xp(cpu)
    with (contextlib.nullcontext() if cpu else xp.cuda.Device(0)):
        with runner.installed("numpy" if cpu else "cupy_pool", False, [0]) as alloc:
            return train.run_rank(alloc, cfg, data, batch, steps, warmup, xp=xp)["losses"]


def _xp(cpu):
    return importlib.import_module("numpy" if cpu else "cupy")


# --- threads: one process, a thread per GPU
class ThreadGroup:
    """`world` ranks as threads, each with a Fenced communicator; ranks(batch): the runner's rank function."""

    def __init__(self, world, cfg, data, warmup, cpu=False):
        self.world, self.cfg, self.data, self.warmup, self.cpu = world, cfg, data, warmup, cpu
        self.xp = xp = _xp(cpu)
        self.device_ctx = None if cpu else xp.cuda.Device
        self.sampler = None if cpu else UtilSampler(range(world))     # rank 0 starts and stops it for all GPUs
        if world == 1:
            self.comms = [None]
        elif cpu:
            host = train.HostComm(world)
            self.comms = [host.rank(r) for r in range(world)]
        else:
            from cupy.cuda import nccl
            uid = nccl.get_unique_id()
            self.comms = runner.run_threads(world, lambda r: NcclComm(nccl.NcclCommunicator(world, uid, r)),
                                            self.device_ctx)
        self.barrier = threading.Barrier(world, timeout=BARRIER_TIMEOUT)
        # one rank needs no collective (and no fence): world 1 is the same loop without an all-reduce
        self.fenced = ([train.Fenced(self.comms[r], self.barrier.wait, train.synchronizer(xp, r))
                        for r in range(world)] if world > 1 else [None])

    def ranks(self, batch):
        """ranks(alloc, steps) -> every rank's run_rank dict, one thread per rank."""
        def run(alloc, steps):
            return runner.run_threads(self.world, lambda r: train.run_rank(
                alloc, self.cfg, self.data, batch, steps, self.warmup, xp=self.xp, device=r, rank=r,
                world=self.world, comm=self.fenced[r], barrier=self.barrier.wait if self.world > 1 else None,
                sampler=self.sampler if r == 0 else None), self.device_ctx)
        return run

    def close(self):
        if not self.cpu and self.world > 1:
            runner.run_threads(self.world, lambda r: self.comms[r].comm.destroy(), self.device_ctx)


def threads_arms(world, names, cfg, data, batch, steps, warmup, count_steps, cpu=False, progress=True,
                 trials=TRIALS) -> list:
    """[(trial, runner.run_arm result)] of every trial and allocator, interleaved, on `world` threads."""
    group = ThreadGroup(world, cfg, data, warmup, cpu)
    try:
        return [(t, runner.run_arm(name, group.ranks(batch), steps, count_steps, range(world), count=t == 0))
                for t, name in tqdm(runner.interleaved(trials, names), desc=f"threads x{world}",
                                    disable=not progress)]
    finally:
        group.close()


# --- processes: one process per GPU
def rank_main(rank, world, uid, spec, barrier) -> list:
    """One rank of the processes mode: every (trial, allocator) in turn on GPU `rank`, [(trial, run_arm result)]. uid:
    NCCL's unique id (from rank 0); spec: the run's settings; barrier: a function meeting every rank."""
    no_multicast()
    import cupy
    from cupy.cuda import nccl
    cfg, data = GPTConfig(**spec["config"]), load_corpus()
    with cupy.cuda.Device(rank):
        comm = NcclComm(nccl.NcclCommunicator(world, uid, rank)) if world > 1 else None
        sampler = UtilSampler([rank])

        def ranks(alloc, n):
            return [train.run_rank(alloc, cfg, data, spec["batch"], n, spec["warmup"], xp=cupy, device=rank,
                                   rank=rank, world=world, comm=comm, barrier=barrier, sampler=sampler)]

        try:
            return [(t, runner.run_arm(name, ranks, spec["steps"], spec["count_steps"], [rank], count=t == 0))
                    for t, name in tqdm(runner.interleaved(spec["trials"], spec["allocators"]),
                                        desc=f"processes x{world}",
                                        disable=rank != 0 or not spec.get("progress", True))]
        finally:
            if comm is not None:
                comm.comm.destroy()


def worker_main(spec_path) -> None:
    """An `mpirun`-launched rank: NCCL id from rank 0, every rank's results to rank 0's result_path."""
    from mpi4py import MPI
    from cupy.cuda import nccl
    spec = pickle.loads(pathlib.Path(spec_path).read_bytes())
    c = MPI.COMM_WORLD
    uid = c.bcast(nccl.get_unique_id() if c.rank == 0 else None, root=0)
    results = c.gather(rank_main(c.rank, c.size, uid, spec, c.Barrier), root=0)
    if c.rank == 0:
        pathlib.Path(spec["result_path"]).write_bytes(pickle.dumps(results))


def _spawned_rank(rank, world, uid, spec, barrier, queue):
    try:
        timeout = spec.get("barrier_timeout", BARRIER_TIMEOUT)
        queue.put((rank, rank_main(rank, world, uid, spec, lambda: barrier.wait(timeout)), None))
    except BaseException:             # noqa: BLE001 - the parent reports it
        queue.put((rank, None, traceback.format_exc()))


def pick_launcher(launcher="auto") -> str:
    """'mpirun' for "auto" when it and mpi4py are there, else 'spawn'; anything else as given."""
    if launcher != "auto":
        return launcher
    return "mpirun" if shutil.which("mpirun") and importlib.util.find_spec("mpi4py") else "spawn"


def launch(world, spec, launcher="auto") -> list:
    """Start `world` rank processes (mpirun or spawn): [rank] -> rank_main's list."""
    launcher = pick_launcher(launcher)
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", **{train.ADAMW_ENV: train.adamw_form()},
               PYTHONPATH=os.pathsep.join(p for p in (str(repo_root()), os.environ.get("PYTHONPATH")) if p))
    with tempfile.TemporaryDirectory(prefix="xpool-ddp-") as tmp:
        spec = dict(spec, result_path=os.path.join(tmp, "results.pkl"))
        if launcher == "mpirun":
            spec_path = os.path.join(tmp, "spec.pkl")
            pathlib.Path(spec_path).write_bytes(pickle.dumps(spec))
            env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
            cmd = ["mpirun", "-np", str(world), "--oversubscribe", "--bind-to", "none",
                   "-x", "NCCL_NVLS_ENABLE", "-x", "PYTHONPATH", "-x", train.ADAMW_ENV,
                   sys.executable, "-m", "xlab.experiments", "worker", spec_path]
            if os.geteuid() == 0:
                cmd.insert(1, "--allow-run-as-root")
            subprocess.run(cmd, env=env, check=True, timeout=spec.get("barrier_timeout", BARRIER_TIMEOUT) * 2)
            return pickle.loads(pathlib.Path(spec["result_path"]).read_bytes())
        if launcher == "spawn":
            return _spawn(world, spec, env)
    raise ValueError(f"unknown launcher {launcher!r}; use auto, mpirun or spawn")


def _spawn(world, spec, env):
    from cupy.cuda import nccl
    ctx = mp.get_context("spawn")
    queue, barrier = ctx.Queue(), ctx.Barrier(world)
    uid = nccl.get_unique_id()
    os.environ["PYTHONPATH"] = env["PYTHONPATH"]     # spawned children inherit os.environ
    procs = [ctx.Process(target=_spawned_rank, args=(r, world, uid, spec, barrier, queue), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results = [None] * world
    # a rank hung inside NCCL never exits: give up after twice the barrier timeout, as mpirun's launch does
    limit = 2 * spec.get("barrier_timeout", BARRIER_TIMEOUT)
    deadline = time.monotonic() + limit
    try:
        for _ in range(world):
            while True:
                try:
                    rank, result, error = queue.get(timeout=10)
                    break
                except queue_module.Empty:
                    dead = [p for p in procs if p.exitcode not in (None, 0)]
                    if dead:
                        raise RuntimeError(f"rank process exited with {dead[0].exitcode}") from None
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"rank processes still running after {limit} s") from None
            if error:
                raise RuntimeError(f"rank {rank} failed:\n{error}")
            results[rank] = result
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    return results


def merge_ranks(per_rank: list) -> list:
    """launch()'s [rank][i] -> [(trial, one run_arm result with every rank's runs)], as threads_arms's."""
    out = []
    for i, (trial, first) in enumerate(per_rank[0]):
        counted = None if first["counted"] is None else [r[i][1]["counted"][0] for r in per_rank]
        out.append((trial, dict(allocator=first["allocator"], counted_steps=first["counted_steps"],
                                timed=[r[i][1]["timed"][0] for r in per_rank], counted=counted)))
    return out


def run(modes=("threads", "processes"), worlds=(1, 2), allocators=None, batch=32, steps=6, warmup=3,
        count_steps=3, config=None, launcher="auto", out="data/ddp_scaling.csv", cpu=False, progress=True,
        trials=TRIALS, resume=False):
    """Data-parallel training (Note [Data-parallel modes]): one row per (mode, world, trial, allocator),
    written to `out` (None: none) after each block. cpu: threads mode on NumPy (tests the code, measures nothing);
    resume: keep the (world, mode) blocks an interrupted run of this commit and these settings completed."""
    no_multicast()
    allocators = registry.parse(allocators or registry.SETS["ddp"])
    if cpu:
        modes, allocators = tuple(m for m in modes if m == "threads"), ("numpy",)
    else:
        registry.require_gpus(max(worlds), "ddp.run")
    cfg, data = train.make_config(config), load_corpus()
    spec = dict(allocators=list(allocators), batch=batch, steps=steps, warmup=warmup, count_steps=count_steps,
                config=dataclasses.asdict(cfg), progress=progress, trials=trials, barrier_timeout=BARRIER_TIMEOUT)
    rows, done = (runner.resumed(out, ("world", "mode", "trial", "allocator"), commit=git_commit(), steps=steps,
                                 warmup=warmup, batch=batch, config=train.config_name(config))
                  if resume else ([], set()))
    for world in worlds:
        todo = [m for m in modes if not all((world, m, t, a) in done for t, a in runner.interleaved(trials, allocators))]
        if not todo:
            continue
        ref = reference_losses(cfg, data, batch * world, steps, warmup, cpu)
        for mode in todo:
            rows = [r for r in rows if (r["world"], r["mode"]) != (world, mode)]    # a block is redone whole
            if mode == "threads":
                results, how = threads_arms(world, allocators, cfg, data, batch, steps, warmup, count_steps, cpu,
                                            progress, trials), "threads"
            elif mode == "processes":
                how = pick_launcher(launcher)
                results = merge_ranks(launch(world, spec, how))
            else:
                raise ValueError(f"unknown mode {mode!r}; use threads or processes")
            for trial, m in results:
                row = train.build_row(mode, m, world, batch, cfg, steps, warmup, ref_losses=ref, launcher=how,
                                      config=train.config_name(config), trial=trial)
                rows.append({**row, **provenance(experiment="ddp", trials=trials)})
            write_csv(train.frame(rows), out)      # what is done survives a later failure
    return train.frame(rows)
