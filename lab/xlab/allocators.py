"""The allocators behind the arms the lab compares: the table of arms (ARMS) is xlab.shared's, what each column
means, its families (xpool_k<N>, _debug, _graph) and how each allocator counts in its Note [The arms table].

    alloc = make("cupy_pool"); alloc.install(); ...; alloc.uninstall(); alloc.release([0])
    arm("xpool_k4_debug").label, arm("raw").color, parse(["raw", "xpool"])   # names are checked once, here

To add an arm: a row (and, for a CuPy allocator, an Allocator subclass); every experiment, benchmark, replay, plot
and report reads it. Counters are per device and None where an allocator cannot count exactly.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from collections import defaultdict

import xpool
# the arms table and its names live in xlab.shared (both floors read it); here, the allocators behind its rows
from xlab.shared import (ARMS, DEFAULT_SCHEME, KIB, LEGACY, MIB, SETS, TORCH_DEFAULT_SCHEME, Arm,  # noqa: F401
                         arg, arm, by_scheme, canonical, label, ordered, parse)



class NoGPU(RuntimeError):
    """Fewer CUDA GPUs are visible than a measurement needs."""


def require_gpus(n: int = 1, what: str = "this measurement") -> None:
    """Raise NoGPU, naming `what` needs them, unless at least n CUDA GPUs are visible."""
    from xlab.provenance import gpu_info
    have = gpu_info()["n_gpus"]
    if have < n:
        raise NoGPU(f"{what} needs {n} CUDA GPU{'s' * (n > 1)}; {have} visible "
                    f"(CPU-only machine? the CPU paths are the unit tests and --cpu-smoke)")


def limit_bytes(nbytes) -> int:
    """`nbytes` as a memory limit in bytes (0: none); ValueError naming it unless a whole number >= 0."""
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"nbytes must be a whole number of bytes >= 0 (0: no limit), got {nbytes!r}")
    return nbytes


class Allocator:
    """While installed, CuPy allocates through `malloc_fn()`; counters read per device (None: not counted)."""

    # What an arm can do: make() sets these from its row of ARMS (the defaults: an arm that can do none of it)
    name = "?"
    free_counting = False   # counts exactly and for free, so the timed run itself gives the counts
    device_calls_when_warm = False   # allocates from the device on every request, warm or not
    can_capture = False     # graph_pool() gives private pools, so a `_graph` arm of it can exist
    graph = False           # a `_graph` arm: the training step is captured (xlab.experiments.train)

    def __init__(self):
        self.counting = False
        self._previous = None
        self._private = []      # the private pools graph_pool() made, alive until release()

    def malloc_fn(self):
        return self.pool.malloc

    def install(self, counting: bool = False) -> None:
        import cupy
        self.counting = counting
        self._previous = cupy.cuda.get_allocator()
        cupy.cuda.set_allocator(self.malloc_fn())    # process-wide: every thread allocates through it

    def uninstall(self) -> None:
        import cupy
        cupy.cuda.set_allocator(self._previous)

    def tracking(self):
        """Context each allocating thread enters (CuPy's memory hooks are thread-local)."""
        return contextlib.nullcontext()

    def sample(self, device: int) -> None:
        """Called after every training step on `device`."""

    def device_mallocs(self, device: int):
        """Counters on `device`: None where this allocator does not count (Note [The arms table])."""
        return None

    peak_reserved = peak_requested = graph_pool_bytes = device_mallocs

    def release(self, devices=()) -> None:
        """Give cached memory back and drop the pools (call after every array made under it is gone)."""
        self.trim(devices)
        self.pool, self._private = None, []    # a dead pool frees the split blocks too

    def trim(self, devices=()) -> None:
        """Give cached blocks back but stay usable (so no arm is timed beside another's cache)."""

    def set_limit(self, nbytes: int, device: int = 0) -> None:
        """Cap the bytes this allocator may hold on `device`, in use and cached, the way it allows (0: no cap; Note
        [Memory caps]); ValueError for an allocator that has no cap."""
        raise ValueError(f"allocator {self.name!r} has no memory limit")

    def check(self) -> None:
        """Raise what a debug mode found (xpool.CorruptionError); nothing for allocators without one."""

    def graph_pool(self):
        """A private pool of this kind for one captured graph, alive until release() (ValueError: cannot capture)."""
        if not self.can_capture:
            raise ValueError(f"allocator {self.name!r} cannot capture a CUDA graph: capture needs a pool that "
                             "makes no cudaMalloc/cudaFree once warm")
        pool = self._make_private()
        self._private.append(pool)
        return pool

    def _make_private(self):
        raise NotImplementedError


class _Freed:
    """Owner of one raw block: its death is the block's cudaFree, so it tells the counter."""

    __slots__ = ("counter", "device", "size", "memptr")

    def __init__(self, counter, device, size, memptr):
        self.counter, self.device, self.size, self.memptr = counter, device, size, memptr

    def __del__(self):
        self.counter._freed(self.device, self.size)


class _Live:
    """Device mallocs and frees, and live/peak requested bytes, per device (shared by all threads)."""

    def __init__(self):
        self._lock = threading.Lock()        # guards the dicts
        self.mallocs, self.frees, self.live, self.peak = (defaultdict(int) for _ in range(4))

    def _allocated(self, device, size, device_malloc=True):
        with self._lock:
            self.mallocs[device] += device_malloc
            self.live[device] += size
            self.peak[device] = max(self.peak[device], self.live[device])

    def _freed(self, device, size):
        with self._lock:
            self.live[device] -= size
            self.frees[device] += 1

    def wrap(self, mp, size):
        """CuPy block `mp` of `size` bytes, counted: its device malloc now, its device free when it dies."""
        from cupy.cuda import memory
        self._allocated(mp.device_id, size)
        owner = _Freed(self, mp.device_id, size, mp)     # its death frees mp
        return memory.MemoryPointer(memory.UnownedMemory(mp.ptr, size, owner, mp.device_id), 0)


class _Counted(Allocator):
    """An allocator whose counters, while counting, are `self.live`'s (a _Live)."""

    def device_mallocs(self, device):
        return self.live.mallocs[device] if self.counting else None

    def peak_requested(self, device):
        return self.live.peak[device] if self.counting else None


class Raw(_Counted):
    """cudaMalloc/cudaFree for every array (`cupy.cuda.set_allocator(None)`)."""

    def __init__(self):
        super().__init__()
        self.live = _Live()

    def malloc_fn(self):
        return self._counting_malloc if self.counting else None

    def _counting_malloc(self, size):
        from cupy.cuda import memory
        mp = memory._malloc(size)              # CuPy's raw path: one cudaMalloc (none for 0 bytes)
        return self.live.wrap(mp, size) if size else mp

    peak_reserved = _Counted.peak_requested


def _hook_class():
    from cupy.cuda import memory_hook

    class CountingHook(memory_hook.MemoryHook):
        """Counts the pool's cudaMallocs (alloc_*) and its live requested bytes (malloc_*/free_*)."""

        name = "xpool_counting_hook"

        def __init__(self):
            self.live = _Live()
            self._size = {}                     # mem_ptr -> requested bytes; guarded by live._lock

        def alloc_preprocess(self, device_id, mem_size):
            with self.live._lock:
                self.live.mallocs[device_id] += 1

        def malloc_postprocess(self, device_id, size, mem_size, mem_ptr, pmem_id):
            if mem_ptr:
                self.live._allocated(device_id, size, device_malloc=False)
                with self.live._lock:
                    self._size[mem_ptr] = size

        def free_postprocess(self, device_id, mem_size, mem_ptr, pmem_id):
            with self.live._lock:
                size = self._size.pop(mem_ptr, None)
            if size is not None:
                self.live._freed(device_id, size)

    return CountingHook


class RawHeld(Raw):
    """raw with one 512-byte block held alive: do other live blocks make a raw pair cheap?"""

    def install(self, counting: bool = False) -> None:
        from cupy.cuda import memory
        super().install(counting)
        self._held = memory._malloc(512)

    def uninstall(self) -> None:
        self._held = None
        super().uninstall()


class CupyPool(_Counted):
    """CuPy's default best-fit pool (`cupy.cuda.MemoryPool`), fresh for each run."""

    def __init__(self):
        import cupy
        super().__init__()
        self.pool = cupy.cuda.MemoryPool()
        self.hook = _hook_class()()
        self.live = self.hook.live
        self._reserved = defaultdict(int)     # device -> highest total_bytes() seen

    def tracking(self):
        return self.hook if self.counting else contextlib.nullcontext()

    def sample(self, device):
        import cupy
        with cupy.cuda.Device(device):
            self._reserved[device] = max(self._reserved[device], self.pool.total_bytes())

    def peak_reserved(self, device):
        self.sample(device)
        return self._reserved[device]

    def _make_private(self):
        import cupy
        return cupy.cuda.MemoryPool()

    def set_limit(self, nbytes, device=0):
        import cupy
        with cupy.cuda.Device(device):
            self.pool.set_limit(size=limit_bytes(nbytes))

    def graph_pool_bytes(self, device):
        import cupy
        if not self._private:
            return None
        with cupy.cuda.Device(device):
            return sum(p.total_bytes() for p in self._private)

    def trim(self, devices=()):
        import cupy
        for d in devices:
            with cupy.cuda.Device(d):
                self.pool.free_all_blocks()
                for p in self._private:
                    p.free_all_blocks()


class CupyAsync(_Counted):
    """CuPy's `MemoryAsyncPool` (cudaMallocAsync on the current stream), counted: peak reserved from the device's
    pool (cudaMemPoolAttrReservedMemHigh); while counting, each block wrapped as raw's are, so its cudaMallocAsync,
    cudaFreeAsync and requested bytes are seen."""

    def __init__(self):
        import cupy
        super().__init__()
        self.pool = cupy.cuda.MemoryAsyncPool()

    def trim(self, devices=()):
        import cupy
        for d in devices:
            with cupy.cuda.Device(d):
                cupy.cuda.Device(d).synchronize()
                self.pool.free_all_blocks()

    def set_limit(self, nbytes, device=0):
        """CuPy's soft limit of the device's pool: Note [Memory caps]."""
        import cupy
        with cupy.cuda.Device(device):
            self.pool.set_limit(size=limit_bytes(nbytes))

    def install(self, counting: bool = False) -> None:
        from cupy.cuda import runtime
        runtime.memPoolSetAttribute(self._handle(runtime.getDevice()), runtime.cudaMemPoolAttrReservedMemHigh, 0)
        self.live = _Live()
        super().install(counting)

    @staticmethod
    def _handle(device):
        from cupy.cuda import runtime
        return runtime.deviceGetMemPool(device)       # MemoryAsyncPool('current') allocates from it

    def malloc_fn(self):
        pool_malloc, live = self.pool.malloc, self.live

        def malloc(size):
            mp = pool_malloc(size)
            return live.wrap(mp, size) if size else mp     # its death: one cudaFreeAsync
        return malloc if self.counting else pool_malloc

    def device_calls(self, device):
        return self.live.mallocs[device] + self.live.frees[device] if self.counting else None

    def peak_reserved(self, device):
        from cupy.cuda import runtime
        return int(runtime.memPoolGetAttribute(self._handle(device), runtime.cudaMemPoolAttrReservedMemHigh))


class XPool(Allocator):
    """xpool.MemoryPool: its default scheme (`xpool`), the design's (`xpool_seed`), or k classes per doubling."""

    def __init__(self, classes_per_doubling: int | None = None, debug=None, scheme: str | None = None, **settings):
        super().__init__()
        self._settings = dict(debug=debug or False, **settings, **{k: v for k, v in (
            ("classes_per_doubling", classes_per_doubling), ("scheme", scheme)) if v is not None})
        self.pool = xpool.MemoryPool(**self._settings)

    def _make_private(self):
        return xpool.MemoryPool(**self._settings)     # the arm's own settings: same scheme, same debug mode

    def _stat(self, device, key, pool=None):
        pool = pool or self.pool
        # a build before the freeze (xlab.builds) counts through snapshot(); this one through stats()
        counters = (pool.snapshot() if hasattr(type(pool), "snapshot") else pool.stats()).per_device.get(device)
        return counters.get(key, 0) if counters else 0     # a build before the expandable scheme has no maps

    def device_mallocs(self, device):   # the expandable scheme's maps are its device allocations
        return sum(self._stat(device, "device_mallocs", p) + self._stat(device, "device_maps", p)
                   for p in [self.pool, *self._private])

    def graph_pool_bytes(self, device):
        return sum(self._stat(device, "bytes_reserved", p) for p in self._private) if self._private else None

    peak_reserved = functools.partialmethod(_stat, key="peak_bytes_reserved")
    peak_requested = functools.partialmethod(_stat, key="peak_bytes_requested")

    def check(self):
        for p in [self.pool, *self._private]:
            if p.settings.debug:
                p.check()

    def set_limit(self, nbytes, device=0):
        self.pool.set_limit(size=limit_bytes(nbytes), device=device)

    def trim(self, devices=()):
        for p in [self.pool, *self._private]:
            p.empty_cache()


class CupyTorch(Allocator):
    """PyTorch's caching allocator as CuPy's: each request a `torch.empty(n, uint8)` on CuPy's current device,
    handed over as an UnownedMemory that goes back to PyTorch's cache when CuPy drops it."""

    def __init__(self):
        super().__init__()
        try:
            import torch
        except ImportError as e:
            raise ImportError(f"allocator 'cupy_torch' needs PyTorch ({e})") from e
        if not torch.cuda.is_available():
            raise NoGPU("allocator 'cupy_torch' needs PyTorch built with CUDA and a visible GPU")
        self.torch = torch

    def malloc_fn(self):
        from cupy.cuda import memory, runtime
        torch, u8 = self.torch, self.torch.uint8

        def malloc(size):
            device = runtime.getDevice()
            t = torch.empty(size, dtype=u8, device=torch.device("cuda", device))
            return memory.MemoryPointer(memory.UnownedMemory(t.data_ptr(), size, t, device), 0)
        return malloc

    def _stat(self, device, key):
        return int(self.torch.cuda.memory_stats(device).get(key, 0))

    device_mallocs = functools.partialmethod(_stat, key="segment.all.allocated")   # cudaMallocs since the start
    peak_reserved = functools.partialmethod(_stat, key="reserved_bytes.all.peak")
    peak_requested = functools.partialmethod(_stat, key="requested_bytes.all.peak")

    def set_limit(self, nbytes, device=0):
        cuda = self.torch.cuda
        total = cuda.mem_get_info(device)[1]               # cudaMemGetInfo's total, what the fraction is of
        cuda.set_per_process_memory_fraction(min(1.0, limit_bytes(nbytes) / total) if nbytes else 1.0, device)

    def install(self, counting=False):
        self.torch.cuda.init()      # PyTorch's allocator knows no device before CUDA is initialised
        for d in range(self.torch.cuda.device_count()):
            self.torch.cuda.reset_peak_memory_stats(d)
        super().install(counting)

    def trim(self, devices=()):
        self.torch.cuda.empty_cache()


class Noop(Allocator):
    """The floor: a Python callable handing out one pre-made block (CuPy's array path alone; timing only)."""

    def __init__(self, capacity: int = 96 * MIB):
        super().__init__()
        self.capacity = capacity
        self.block = None

    def install(self, counting: bool = False) -> None:
        from cupy.cuda import memory
        self.block = memory._malloc(self.capacity)
        super().install(counting)

    def uninstall(self) -> None:
        super().uninstall()
        self.block = self.cfa = None

    def malloc_fn(self):
        block = self.block
        return lambda size: block


class CNoop(Noop):
    """The floor of CuPy's C-callback path (CFunctionAllocator, xpool.MemoryPool's): one pre-made block."""

    cfa = None

    def malloc_fn(self):
        from cupy.cuda.memory import CFunctionAllocator

        from xlab._probes import noop_cfunctions
        param, malloc, free = noop_cfunctions(self.block.ptr)
        self.cfa = CFunctionAllocator(param, malloc, free, self.block)
        return self.cfa.malloc


class Host(Allocator):
    """NumPy stand-in for --cpu-smoke and tests: installs nothing, counts nothing."""

    def install(self, counting=False):
        self.counting = counting

    def uninstall(self):
        pass

    def set_limit(self, nbytes, device=0):
        """Nothing to cap: the NumPy stand-in allocates nothing of its own."""
        limit_bytes(nbytes)


# --- the dynamic-shape benchmark's arms (xlab.bench.dynamic; Note [Dynamic-shape benchmark] in xlab/bench/dynamic.py)

# Note [Dynamic-shape benchmark: device calls]
# device_calls_per_step (the rows' counted_in says from which run) sums, per arm:
# - xpool: device_mallocs + device_frees (+ device_maps + device_unmaps) from its own snapshot: for the CuPy
#   workloads in the counting run (its bytes from the timed run, which are the same), for PyTorch's in their one run;
# - PyTorch (torch, torch_expandable): num_device_alloc + num_device_free of torch.cuda.memory_stats(). In
#   c10/cuda/CUDACachingAllocator.cpp num_device_alloc grows in alloc_block (a cudaMalloc) and in map_block (an
#   expandable segment mapping a range of pages: one count per range), num_device_free in release_block and
#   unmap_block. The arm checks memory_snapshot()'s is_expandable, so a setting that did not take fails the arm
#   (check_torch_setting, also for the arm that hands CuPy PyTorch's blocks);
# - PyTorch's expandable segments serving CuPy (cupy_torch_expandable): torch_expandable installed as CuPy's
#   allocator in a process of its own, counted as PyTorch's arms are: the one peer that maps pages into reserved
#   ranges, as xpool's expandable scheme does;
# - RMM (rmm_pool): PoolMemoryResource(CudaMemoryResource, initial_pool_size=0) under a StatisticsResourceAdaptor
#   (cudaMallocs = total_count, cudaFrees = total_count - current_count, reserved = peak_bytes) and a second one
#   above the pool (peak requested). Starting empty it grows by max(request, pool size); RMM's default, half the
#   free memory at once, would make the ratio meaningless. Bytes from the timed run, calls from the counting run;
# - CuPy's pool: its cudaMallocs through a memory hook (it calls cudaFree only in free_all_blocks and on out of
#   memory, so frees are 0 mid-run), peak requested from the hook, in a second, counting run;
# - CuPy's async pool: every cudaMallocAsync and cudaFreeAsync (each block wrapped, as raw's counting variant does)
#   and the live requested bytes in a counting run; peak reserved from the device pool's
#   cudaMemPoolAttrReservedMemHigh (reset at install). The driver's own mapping behind the pool is not seen.

# Note [Memory caps]
# A cap of C bytes (xlab.bench.dynamic_scale's runs under a cap) bounds what an allocator holds on the device, in
# use and cached, as a GPU of C bytes would; set_limit sets it the way each allocator allows (0 lifts it). What
# libraries take beside the allocator (the CUDA context, cuBLAS's and cuFFT's handles) is not capped, for any arm.
# - xpool: its `limit` (Pool.set_limit on the device, what the setting sets on every device): bytes in use, cached
#   and in flight; past it the ladder empties the cache and retries, then OutOfMemoryError (reason "limit"), which
#   PyTorch receives as a RuntimeError naming it (xpool/_torch.c).
# - CuPy's MemoryPool: set_limit(size=C) bounds total_bytes(); past it the pool frees its free blocks, retries,
#   then OutOfMemoryError.
# - CuPy's MemoryAsyncPool (CuPy 13 and 14, cupy/cuda/memory.pyx): set_limit(size=C) is a soft limit: it sets the
#   device pool's cudaMemPoolAttrReleaseThreshold to C (the pool keeps at most C across a synchronisation), and
#   CuPy's malloc raises OutOfMemoryError, without a retry, when the pool's free bytes cannot hold a request and its
#   reserved bytes (cudaMemPoolAttrReservedMemCurrent) plus the request pass C. Allocations made from the driver's
#   pool by other code are not bounded, which is why CuPy calls it soft; here CuPy is its one user.
# - RMM: LimitingResourceAdaptor(upstream, C) between the pool and the device (the pool's upstream), so it bounds
#   what the pool takes from the device; over the pool it would bound the requested bytes, which never pass the
#   uncapped run's peak, so it would never act. Past it the pool tries smaller growths, then out_of_memory
#   (Python's MemoryError). PoolMemoryResource's maximum_pool_size would do the same.
# - PyTorch's caching allocator (torch, torch_expandable, and cupy_torch_expandable serving CuPy):
#   torch.cuda.set_per_process_memory_fraction(C / total), total cudaMemGetInfo's: alloc_block refuses a new segment,
#   or a mapping of expandable segments, when reserved + its size passes fraction x total
#   (c10/cuda/CUDACachingAllocator.cpp); malloc then frees the cached blocks and retries, then torch.OutOfMemoryError.
#   It holds for the process: set before every run, 1.0 to lift it.
# - numpy (the CPU's stand-in): nothing to cap.
class RmmPool(Allocator):
    """RMM's pool (PoolMemoryResource over CudaMemoryResource, empty at first) through rmm_cupy_allocator, counted by a
    StatisticsResourceAdaptor under it (cudaMallocs, cudaFrees, reserved bytes) and one above it (requested bytes)."""

    name = "rmm_pool"
    free_counting = True      # an adaptor's count is a lock per call, beside rmm_cupy_allocator's Python

    def __init__(self):
        super().__init__()
        self._mr_before = None
        self._build(0)

    def _build(self, limit: int) -> None:
        """The resources, device up: statistics (cudaMalloc and cudaFree), RMM's limiting adaptor where `limit` is
        set (Note [Memory caps]), the pool, statistics (requests)."""
        try:
            import rmm.mr
        except ImportError as e:
            raise ImportError(f"allocator 'rmm_pool' needs RMM (pip install rmm-cu13 or rmm-cu12): {e}") from e
        self.upstream = rmm.mr.StatisticsResourceAdaptor(rmm.mr.CudaMemoryResource())
        below = rmm.mr.LimitingResourceAdaptor(self.upstream, limit) if limit else self.upstream
        self.pool = rmm.mr.PoolMemoryResource(below, initial_pool_size=0)
        self.top = rmm.mr.StatisticsResourceAdaptor(self.pool)

    def set_limit(self, nbytes, device=0):
        """RMM's limiting adaptor takes its limit when made, under the pool: the resources are made anew, so only
        before install (ValueError after)."""
        if self._mr_before is not None:
            raise ValueError("rmm_pool: set the limit before install (the limiting adaptor sits under the pool)")
        self._build(limit_bytes(nbytes))

    def malloc_fn(self):
        from rmm.allocators.cupy import rmm_cupy_allocator
        return rmm_cupy_allocator                      # allocates from the current device resource: self.top

    def install(self, counting: bool = False) -> None:
        import rmm.mr
        self._mr_before = rmm.mr.get_current_device_resource()
        rmm.mr.set_current_device_resource(self.top)
        super().install(counting)

    def uninstall(self) -> None:
        import rmm.mr
        super().uninstall()
        rmm.mr.set_current_device_resource(self._mr_before)
        self._mr_before = None

    def device_calls(self, device):
        c = self.upstream.allocation_counts
        return 2 * c.total_count - c.current_count     # cudaMallocs + cudaFrees

    def device_mallocs(self, device):
        return self.upstream.allocation_counts.total_count

    def peak_reserved(self, device):
        return self.upstream.allocation_counts.peak_bytes

    def peak_requested(self, device):
        return self.top.allocation_counts.peak_bytes

    def release(self, devices=()) -> None:
        self.top = self.pool = self.upstream = self._mr_before = None    # the pool's death frees its blocks


class TorchExpandable(CupyTorch):
    """`torch` (or `cupy_torch`: arm cupy_torch_expandable) with expandable segments (process-wide: make it in a
    process of its own)."""

    name = "torch_expandable"
    SETTING = "expandable_segments:True"

    def __init__(self):
        import os
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = self.SETTING    # where PyTorch is imported after this
        super().__init__()
        set_settings = (getattr(self.torch._C, "_accelerator_setAllocatorSettings", None)   # and where it was
                        or self.torch.cuda.memory._set_allocator_settings)               # imported before
        set_settings(self.SETTING)


def allocator_class(name: str) -> type | None:
    """The Allocator class that makes arm `name` (its row's `make`), None for an arm the lab does not install."""
    row = arm(name)
    return None if row.make is None else globals()[row.make]


def make(name: str, **kwargs) -> Allocator:
    """A fresh allocator by name (see `arm`), not installed; `kwargs` go to its class."""
    row = arm(name)
    if row.make is None:
        raise ValueError(f"arm {name!r} ({row.framework}) is not an allocator the lab installs into CuPy")
    alloc = allocator_class(name)(**dict(row.kwargs), **kwargs)
    alloc.name, alloc.graph = row.name, row.graph
    alloc.free_counting, alloc.can_capture = row.exact, row.can_capture
    alloc.device_calls_when_warm = row.device_calls_when_warm
    return alloc
