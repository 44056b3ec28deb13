"""The allocators under test, by name: each installs itself as CuPy's allocator and counts what it can exactly.

    alloc = make("cupy_pool"); alloc.install(); ...; alloc.uninstall(); alloc.release([0])

Counters are per device and None where the allocator cannot count exactly:
- raw: every cudaMalloc is one array; the counting variant (`install(counting=True)`) wraps CuPy's
  `_malloc` so each block's malloc and free is seen (requested = reserved: there is no cache).
- cupy_pool: device mallocs and live requested bytes from a CuPy MemoryHook, entered per thread only
  while counting (hooks cost time); reserved bytes from `total_bytes()` after every step (it only grows
  between `free_all_blocks` calls, so the last sample is the peak).
- xpool, xpool_seed, xpool_kN: the pool's own exact counters; counting is free, so the timed run counts too.
  `xpool` is xpool.MemoryPool's default scheme, `xpool_seed` the design's scheme (size classes, k = 1),
  `xpool_kN` the design's scheme with N classes per doubling; `_debug` after any of them turns debug mode on.
- torch: PyTorch's caching allocator handing CuPy its blocks (torch.empty wrapped in UnownedMemory); its own
  counters (torch.cuda.memory_stats) are exact and free.
- cupy_async, noop, c_noop: timing only.
- `<pool>_graph` (xpool, xpool_seed, xpool_kN, cupy_pool): that pool, with each training step's forward and
  backward pass captured once as a CUDA graph (tapegpt.graph.CapturedStep) over a private pool of the same kind
  (`graph_pool`), replayed every step. Only pools can capture: capture must not call cudaMalloc/cudaFree. The
  private pools' device mallocs count with the arm's; their bytes are `graph_pool_bytes`, apart from the peaks.

`device_calls_when_warm` says whether an allocator still calls the device (cudaMalloc/cudaFree, or their
stream-ordered forms) once its cache is warm: the threads-mode training fences collectives for those only.
"""
from __future__ import annotations

import contextlib
import re
import threading
from collections import defaultdict

KIB, MIB = 1 << 10, 1 << 20


class NoGPU(RuntimeError):
    """Fewer CUDA GPUs are visible than a measurement needs."""


def require_gpus(n: int = 1, what: str = "this measurement") -> None:
    """Raise NoGPU with a clear message unless at least n CUDA GPUs are visible.

    Args:
        n: GPUs needed.
        what: what needs them, for the message.

    Raises:
        NoGPU: fewer are visible.
    """
    from xlab.provenance import gpu_info
    have = gpu_info()["n_gpus"]
    if have < n:
        raise NoGPU(f"{what} needs {n} CUDA GPU{'s' * (n > 1)}; {have} visible "
                    f"(CPU-only machine? the CPU paths are the unit tests and --cpu-smoke)")


class Allocator:
    """While installed, CuPy allocates through `malloc_fn()`; counters read per device (None: not counted)."""

    name = "?"
    free_counting = False   # True: counting costs nothing, so the timed run itself gives the counts
    device_calls_when_warm = False   # True: allocates from the device on every request, warm or not
    can_capture = False     # True: graph_pool() gives private pools, so a `_graph` arm of it can exist
    graph = False           # True: a `_graph` arm: the training step is captured (xlab.experiments.train)

    def __init__(self):
        self.counting = False
        self._previous = None
        self._private = []      # the private pools graph_pool() made, alive until release()

    def malloc_fn(self):
        raise NotImplementedError

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
        return None

    def peak_reserved(self, device: int):
        return None

    def peak_requested(self, device: int):
        return None

    def release(self, devices=()) -> None:
        """Give cached memory back (call after every array made under it is gone)."""

    def trim(self, devices=()) -> None:
        """Give cached blocks back to the device but stay usable (the benchmark calls it on every other arm
        before timing one, so no arm runs beside another arm's cached blocks)."""

    def check(self) -> None:
        """Raise what a debug mode found (xpool.CorruptionError); nothing for allocators without one."""

    def graph_pool(self):
        """A new private pool of this allocator's kind for one captured graph: its `malloc` goes to
        tapegpt.graph.CapturedStep. It lives until release(), which gives its blocks back (after the graph is gone).

        Raises:
            ValueError: this allocator cannot capture (it calls the device on every request).
        """
        if not self.can_capture:
            raise ValueError(f"allocator {self.name!r} cannot capture a CUDA graph: capture needs a pool that "
                             "makes no cudaMalloc/cudaFree once warm")
        pool = self._make_private()
        self._private.append(pool)
        return pool

    def _make_private(self):
        raise NotImplementedError

    def graph_pool_bytes(self, device: int):
        """Bytes the private pools hold on `device` (None: no private pool, or not counted)."""
        return None


class _Freed:
    """Owner of one raw block: its death is the block's cudaFree, so it tells the counter."""

    __slots__ = ("counter", "device", "size", "memptr")

    def __init__(self, counter, device, size, memptr):
        self.counter, self.device, self.size, self.memptr = counter, device, size, memptr

    def __del__(self):
        self.counter._freed(self.device, self.size)


class _Live:
    """Device mallocs and live/peak requested bytes per device (shared by all threads)."""

    def __init__(self):
        self._lock = threading.Lock()        # guards the three dicts
        self.mallocs = defaultdict(int)
        self.live = defaultdict(int)
        self.peak = defaultdict(int)

    def _allocated(self, device, size, device_malloc=True):
        with self._lock:
            self.mallocs[device] += device_malloc
            self.live[device] += size
            self.peak[device] = max(self.peak[device], self.live[device])

    def _freed(self, device, size):
        with self._lock:
            self.live[device] -= size


class Raw(Allocator):
    """cudaMalloc/cudaFree for every array (`cupy.cuda.set_allocator(None)`)."""

    name = "raw"
    device_calls_when_warm = True

    def __init__(self):
        super().__init__()
        self.live = _Live()

    def malloc_fn(self):
        return self._counting_malloc if self.counting else None

    def _counting_malloc(self, size):
        from cupy.cuda import memory
        mp = memory._malloc(size)              # CuPy's raw path: one cudaMalloc (none for 0 bytes)
        if size == 0:
            return mp
        d = mp.device_id
        self.live._allocated(d, size)
        owner = _Freed(self.live, d, size, mp)
        return memory.MemoryPointer(memory.UnownedMemory(mp.ptr, size, owner, d), 0)

    def device_mallocs(self, device):
        return self.live.mallocs[device] if self.counting else None

    def peak_reserved(self, device):
        return self.live.peak[device] if self.counting else None

    peak_requested = peak_reserved


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
    """raw, with one 512-byte cudaMalloc block held alive while installed.

    A raw pair's cost depends on what else the device holds (68 µs at 4 KiB measured alone, 2.6-10 µs beside other
    live blocks: see xlab.bench.alloc); a plausible cause is the driver packing small allocations into chunks it
    maps once, which a live block keeps mapped. This arm, timed beside `raw` alone, tests that.
    """

    name = "raw_held"

    def install(self, counting: bool = False) -> None:
        from cupy.cuda import memory
        super().install(counting)
        self._held = memory._malloc(512)

    def uninstall(self) -> None:
        self._held = None
        super().uninstall()


class CupyPool(Allocator):
    """CuPy's default best-fit pool (`cupy.cuda.MemoryPool`), fresh for each run."""

    name = "cupy_pool"
    can_capture = True

    def __init__(self):
        import cupy
        super().__init__()
        self.pool = cupy.cuda.MemoryPool()
        self.hook = _hook_class()()
        self._reserved = defaultdict(int)     # device -> highest total_bytes() seen

    def malloc_fn(self):
        return self.pool.malloc

    def tracking(self):
        return self.hook if self.counting else contextlib.nullcontext()

    def sample(self, device):
        import cupy
        with cupy.cuda.Device(device):
            self._reserved[device] = max(self._reserved[device], self.pool.total_bytes())

    def device_mallocs(self, device):
        return self.hook.live.mallocs[device] if self.counting else None

    def peak_reserved(self, device):
        self.sample(device)
        return self._reserved[device]

    def peak_requested(self, device):
        return self.hook.live.peak[device] if self.counting else None

    def _make_private(self):
        import cupy
        return cupy.cuda.MemoryPool()

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

    def release(self, devices=()):
        self.trim(devices)
        self.pool, self._private = None, []    # a dead pool frees the split blocks too


class CupyAsync(Allocator):
    """CuPy's `MemoryAsyncPool` (cudaMallocAsync on the current stream)."""

    name = "cupy_async"
    device_calls_when_warm = True             # cudaMallocAsync/cudaFreeAsync on every request

    def __init__(self):
        import cupy
        super().__init__()
        self.pool = cupy.cuda.MemoryAsyncPool()

    def malloc_fn(self):
        return self.pool.malloc

    def trim(self, devices=()):
        import cupy
        for d in devices:
            with cupy.cuda.Device(d):
                cupy.cuda.Device(d).synchronize()
                self.pool.free_all_blocks()

    def release(self, devices=()):
        self.trim(devices)
        self.pool = None


def schemes_supported() -> bool:
    """True when xpool.MemoryPool takes `scheme=` (the segment scheme of issue #14 is in this checkout)."""
    import inspect

    import xpool
    return "scheme" in inspect.signature(xpool.MemoryPool).parameters


def xpool_kwargs(scheme: str | None, classes_per_doubling: int | None) -> dict:
    """xpool.MemoryPool's arguments for a registry name's scheme and k: the one place that maps names to them.

    scheme None: the pool's default scheme. Where MemoryPool has no `scheme=` yet, 'seed' is its only scheme
    (size classes): `xpool` and `xpool_seed` are then both its default, k = 1.

    Args:
        scheme: "xpool", "seed" or None (the pool's default).
        classes_per_doubling: k, or None.

    Returns:
        A dict of keyword arguments.
    """
    kwargs = {}
    if classes_per_doubling is not None:
        kwargs["classes_per_doubling"] = classes_per_doubling
    if scheme is not None and schemes_supported():
        kwargs["scheme"] = scheme
    return kwargs


class XPool(Allocator):
    """xpool.MemoryPool: its default scheme (`xpool`), the design's (`xpool_seed`), or k classes per doubling."""

    free_counting = True
    can_capture = True

    def __init__(self, classes_per_doubling: int | None = None, debug=None, scheme: str | None = None,
                 name: str | None = None):
        import xpool
        super().__init__()
        base = (f"xpool_k{classes_per_doubling}" if classes_per_doubling is not None
                else "xpool" if scheme is None else f"xpool_{scheme}")
        self.name = name or base + ("_debug" if debug else "")
        self._settings = dict(xpool_kwargs(scheme, classes_per_doubling), debug=debug or False)
        self.pool = xpool.MemoryPool(**self._settings)

    def _make_private(self):
        import xpool
        return xpool.MemoryPool(**self._settings)     # the arm's own settings: same scheme, same debug mode

    def malloc_fn(self):
        return self.pool.malloc

    def _stat(self, device, key, pool=None):
        counters = (pool or self.pool).snapshot().per_device.get(device)
        return counters[key] if counters else 0

    def device_mallocs(self, device):
        return sum(self._stat(device, "device_mallocs", p) for p in [self.pool, *self._private])

    def graph_pool_bytes(self, device):
        if not self._private:
            return None
        return sum(self._stat(device, "bytes_reserved", p) for p in self._private)

    def peak_reserved(self, device):
        return self._stat(device, "peak_bytes_reserved")

    def peak_requested(self, device):
        return self._stat(device, "peak_bytes_requested")

    def check(self):
        for p in [self.pool, *self._private]:
            if p.debug:
                p.check()

    def trim(self, devices=()):
        for p in [self.pool, *self._private]:
            p.empty_cache()

    def release(self, devices=()):
        self.trim(devices)
        self.pool, self._private = None, []


class Torch(Allocator):
    """PyTorch's caching allocator as CuPy's: each request is a `torch.empty(n, uint8)` on CuPy's current device,
    handed to CuPy as `MemoryPointer(UnownedMemory(ptr, n, tensor, device), 0)`; the block goes back to PyTorch's
    cache when CuPy drops the tensor. Both use the legacy default stream unless told otherwise.
    """

    name = "torch"
    free_counting = True

    def __init__(self):
        super().__init__()
        try:
            import torch
        except ImportError as e:
            raise ImportError(f"allocator 'torch' needs PyTorch ({e})") from e
        if not torch.cuda.is_available():
            raise NoGPU("allocator 'torch' needs PyTorch built with CUDA and a visible GPU")
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

    def device_mallocs(self, device):
        return self._stat(device, "segment.all.allocated")     # cudaMallocs since the process began

    def peak_reserved(self, device):
        return self._stat(device, "reserved_bytes.all.peak")

    def peak_requested(self, device):
        return self._stat(device, "requested_bytes.all.peak")

    def install(self, counting=False):
        self.torch.cuda.init()      # PyTorch's allocator knows no device before CUDA is initialised
        for d in range(self.torch.cuda.device_count()):
            self.torch.cuda.reset_peak_memory_stats(d)
        super().install(counting)

    def trim(self, devices=()):
        self.torch.cuda.empty_cache()

    release = trim


class Noop(Allocator):
    """The floor: a Python callable handing out one pre-made block (the cost of CuPy's array path alone).

    Every array aliases the same memory: for timing allocation only, never for computing. The block lives only
    while installed, so no other arm is ever timed beside it.
    """

    name = "noop"

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
    """The floor of CuPy's C-callback path (CFunctionAllocator), which xpool.MemoryPool uses:
    a C allocator that hands out one pre-made block and does nothing on free."""

    name = "c_noop"
    cfa = None

    def malloc_fn(self):
        from cupy.cuda.memory import CFunctionAllocator

        from xpool import _core
        param, malloc, free = _core.noop_cfunctions(self.block.ptr)
        self.cfa = CFunctionAllocator(param, malloc, free, self.block)
        return self.cfa.malloc


class Host(Allocator):
    """NumPy stand-in for --cpu-smoke and tests: installs nothing, counts nothing."""

    name = "numpy"
    free_counting = True

    def install(self, counting=False):
        self.counting = counting

    def uninstall(self):
        pass


FACTORIES = {"raw": Raw, "raw_held": RawHeld, "cupy_pool": CupyPool, "cupy_async": CupyAsync, "torch": Torch,
             "noop": Noop, "c_noop": CNoop, "numpy": Host}
NAMES = ("raw", "raw_held", "cupy_pool", "cupy_async", "torch", "xpool", "xpool_seed", "xpool_k1", "xpool_k4",
         "xpool_k1_debug", "noop", "c_noop", "numpy")   # xpool_kN: any N; _debug after any xpool name
GRAPH_SUFFIX = "_graph"   # after a pool's name: its training steps are captured as CUDA graphs
_XPOOL = re.compile(r"xpool(?:_k(?P<k>\d+)|_(?P<scheme>seed))?(?P<debug>_debug)?")


def xpool_arms() -> tuple[str, str]:
    """The two xpool arms the experiments compare: the default scheme and the design's (`xpool`, `xpool_seed`)
    where MemoryPool has schemes, else its two class settings (`xpool_k1`, `xpool_k4`)."""
    return ("xpool", "xpool_seed") if schemes_supported() else ("xpool_k1", "xpool_k4")


def make(name: str, **kwargs) -> Allocator:
    """A fresh allocator by name.

    Args:
        name: raw, raw_held, cupy_pool, cupy_async, torch, xpool, xpool_seed, xpool_k<N> (any of the xpool
            names with `_debug` appended: debug mode), noop, c_noop, numpy; a pool's name with `_graph` appended
            (cupy_pool_graph, xpool_graph, ...): that pool, training steps captured as CUDA graphs.
        **kwargs: passed to the allocator's class.

    Returns:
        An Allocator, not installed.

    Raises:
        ValueError: an unknown name.
    """
    if name.endswith(GRAPH_SUFFIX):
        base = name[:-len(GRAPH_SUFFIX)]
        cls = XPool if _XPOOL.fullmatch(base) else FACTORIES.get(base)
        if cls is not None and not cls.can_capture:     # refused before anything is made
            raise ValueError(f"allocator {name!r}: {base!r} cannot capture a CUDA graph (only pools can: "
                             f"{', '.join(n + GRAPH_SUFFIX for n in ('cupy_pool', 'xpool', 'xpool_seed'))})")
        alloc = make(base, **kwargs)                     # an unknown base name raises here
        alloc.graph, alloc.name = True, name
        return alloc
    m = _XPOOL.fullmatch(name)
    if m:
        k = int(m["k"]) if m["k"] else (1 if m["scheme"] == "seed" else None)
        scheme = m["scheme"] or (None if k else "xpool")     # `xpool` names its scheme: $XPOOL_SCHEME cannot move it
        return XPool(k, debug="raise" if m["debug"] else None, scheme=scheme, name=name, **kwargs)
    if name not in FACTORIES:
        raise ValueError(f"unknown allocator {name!r}; known: {', '.join(NAMES)} (xpool_k<N> for any N; a pool's name "
                         f"+ _graph: its CUDA-graph arm)")
    return FACTORIES[name](**kwargs)



# --- Arms of the dynamic-shape benchmark (xlab.bench.dynamic; Note [Dynamic-shape benchmark]), appended ---------

class _LiveFrees(_Live):
    """_Live, counting the frees too."""

    def __init__(self):
        super().__init__()
        self.frees = defaultdict(int)

    def _freed(self, device, size):
        super()._freed(device, size)
        with self._lock:
            self.frees[device] += 1


class CupyAsyncCounted(CupyAsync):
    """cupy_async, counted: peak reserved from the device's memory pool (cudaMemPoolAttrReservedMemHigh, reset at
    install); in the counting run each block wrapped, as raw's counting variant does, so that its cudaMallocAsync,
    its cudaFreeAsync and the live requested bytes are seen."""

    def install(self, counting: bool = False) -> None:
        from cupy.cuda import runtime
        runtime.memPoolSetAttribute(self._handle(runtime.getDevice()), runtime.cudaMemPoolAttrReservedMemHigh, 0)
        self.live = _LiveFrees()
        super().install(counting)

    @staticmethod
    def _handle(device):
        from cupy.cuda import runtime
        return runtime.deviceGetMemPool(device)       # MemoryAsyncPool('current') allocates from it

    def malloc_fn(self):
        from cupy.cuda import memory
        pool_malloc, live = self.pool.malloc, self.live

        def malloc(size):
            mp = pool_malloc(size)
            if size:
                live._allocated(mp.device_id, size)
                owner = _Freed(live, mp.device_id, size, mp)     # its death frees mp: one cudaFreeAsync
                mp = memory.MemoryPointer(memory.UnownedMemory(mp.ptr, size, owner, mp.device_id), 0)
            return mp
        return malloc if self.counting else pool_malloc

    def device_calls(self, device):
        return self.live.mallocs[device] + self.live.frees[device] if self.counting else None

    def device_mallocs(self, device):
        return self.live.mallocs[device] if self.counting else None

    def peak_reserved(self, device):
        from cupy.cuda import runtime
        return int(runtime.memPoolGetAttribute(self._handle(device), runtime.cudaMemPoolAttrReservedMemHigh))

    def peak_requested(self, device):
        return self.live.peak[device] if self.counting else None


class RmmPool(Allocator):
    """RMM's pool (`rmm.mr.PoolMemoryResource` over `CudaMemoryResource`), CuPy's allocator through
    `rmm.allocators.cupy.rmm_cupy_allocator`, counted by two `StatisticsResourceAdaptor`s: one under the pool (its
    cudaMallocs, cudaFrees, reserved bytes), one above it (requested bytes). It starts empty (initial_pool_size=0),
    as CuPy's and xpool's pools do, and grows by max(request, pool size)."""

    name = "rmm_pool"
    free_counting = True      # an adaptor's count is a lock per call, beside rmm_cupy_allocator's Python

    def __init__(self):
        super().__init__()
        try:
            import rmm.mr
        except ImportError as e:
            raise ImportError(f"allocator 'rmm_pool' needs RMM (pip install rmm-cu13 or rmm-cu12): {e}") from e
        self.upstream = rmm.mr.StatisticsResourceAdaptor(rmm.mr.CudaMemoryResource())
        self.pool = rmm.mr.PoolMemoryResource(self.upstream, initial_pool_size=0)
        self.top = rmm.mr.StatisticsResourceAdaptor(self.pool)

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


class TorchExpandable(Torch):
    """`torch` with expandable segments, set before PyTorch's allocator makes its first block (make it in a process
    of its own: the setting is process-wide)."""

    name = "torch_expandable"
    SETTING = "expandable_segments:True"

    def __init__(self):
        import os
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = self.SETTING    # where PyTorch is imported after this
        super().__init__()
        set_settings = (getattr(self.torch._C, "_accelerator_setAllocatorSettings", None)   # and where it was
                        or self.torch.cuda.memory._set_allocator_settings)               # imported before
        set_settings(self.SETTING)


FACTORIES.update(cupy_async=CupyAsyncCounted, rmm_pool=RmmPool, torch_expandable=TorchExpandable)
NAMES += ("rmm_pool", "torch_expandable")
