"""The allocators under test, by name: each installs itself as CuPy's allocator and counts what it can exactly.

    alloc = make("cupy_pool"); alloc.install(); ...; alloc.uninstall(); alloc.release([0])

Counters are per device and None where the allocator cannot count exactly:
- raw: every cudaMalloc is one array; the counting variant (`install(counting=True)`) wraps CuPy's
  `_malloc` so each block's malloc and free is seen (requested = reserved: there is no cache).
- cupy_pool: device mallocs and live requested bytes from a CuPy MemoryHook, entered per thread only
  while counting (hooks cost time); reserved bytes from `total_bytes()` after every step (it only grows
  between `free_all_blocks` calls, so the last sample is the peak).
- xpool_kN: the pool's own exact counters; counting is free, so the timed run counts too.
- cupy_async, noop: timing only.
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
    """Raise NoGPU with a clear message unless at least n CUDA GPUs are visible."""
    from xlab.provenance import gpu_info
    have = gpu_info()["n_gpus"]
    if have < n:
        raise NoGPU(f"{what} needs {n} CUDA GPU{'s' * (n > 1)}; {have} visible "
                    f"(CPU-only machine? the CPU paths are the unit tests and --cpu-smoke)")


class Allocator:
    """While installed, CuPy allocates through `malloc_fn()`; counters read per device (None: not counted)."""

    name = "?"
    free_counting = False   # True: counting costs nothing, so the timed run itself gives the counts

    def __init__(self):
        self.counting = False
        self._previous = None

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

    def check(self) -> None:
        """Raise what a debug mode found (xpool.CorruptionError); nothing for allocators without one."""


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


class CupyPool(Allocator):
    """CuPy's default best-fit pool (`cupy.cuda.MemoryPool`), fresh for each run."""

    name = "cupy_pool"

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

    def release(self, devices=()):
        import cupy
        for d in devices:
            with cupy.cuda.Device(d):
                self.pool.free_all_blocks()
        self.pool = None                       # a dead pool frees the split blocks too


class CupyAsync(Allocator):
    """CuPy's `MemoryAsyncPool` (cudaMallocAsync on the current stream)."""

    name = "cupy_async"

    def __init__(self):
        import cupy
        super().__init__()
        self.pool = cupy.cuda.MemoryAsyncPool()

    def malloc_fn(self):
        return self.pool.malloc

    def release(self, devices=()):
        import cupy
        for d in devices:
            with cupy.cuda.Device(d):
                cupy.cuda.Device(d).synchronize()
                self.pool.free_all_blocks()
        self.pool = None


class XPool(Allocator):
    """xpool.MemoryPool: scheme xpool (segments; classes_per_doubling None), or seed with k classes per doubling."""

    free_counting = True

    def __init__(self, classes_per_doubling: int | None = None, debug=None, name: str | None = None):
        import xpool
        super().__init__()
        k = classes_per_doubling
        self.name = name or ("xpool" if k is None else f"xpool_k{k}") + ("_debug" if debug else "")
        self.pool = xpool.MemoryPool(k, scheme="xpool" if k is None else "seed", debug=debug or False)

    def malloc_fn(self):
        return self.pool.malloc

    def _stat(self, device, key):
        counters = self.pool.snapshot().per_device.get(device)
        return counters[key] if counters else 0

    def device_mallocs(self, device):
        return self._stat(device, "device_mallocs")

    def peak_reserved(self, device):
        return self._stat(device, "peak_bytes_reserved")

    def peak_requested(self, device):
        return self._stat(device, "peak_bytes_requested")

    def check(self):
        if self.pool.debug:
            self.pool.check()

    def release(self, devices=()):
        self.pool.empty_cache()
        self.pool = None


class Noop(Allocator):
    """The floor: a Python callable handing out one pre-made block (the cost of CuPy's array path alone).

    Every array aliases the same memory: for timing allocation only, never for computing.
    """

    name = "noop"

    def __init__(self, capacity: int = 96 * MIB):
        from cupy.cuda import memory
        super().__init__()
        self.capacity = capacity
        self.block = memory._malloc(capacity)

    def malloc_fn(self):
        block = self.block
        return lambda size: block

    def release(self, devices=()):
        self.block = None


class CNoop(Noop):
    """The floor of CuPy's C-callback path (CFunctionAllocator), which xpool.MemoryPool uses:
    a C allocator that hands out one pre-made block and does nothing on free."""

    name = "c_noop"

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


FACTORIES = {"raw": Raw, "cupy_pool": CupyPool, "cupy_async": CupyAsync, "noop": Noop, "c_noop": CNoop,
             "numpy": Host}
NAMES = ("raw", "cupy_pool", "cupy_async", "xpool", "xpool_debug", "xpool_seed", "xpool_k4", "xpool_k1_debug",
         "noop", "c_noop", "numpy")   # xpool: scheme xpool; xpool_seed = xpool_k1: the design's classes; xpool_kN: any N


def make(name: str, **kwargs) -> Allocator:
    """A fresh allocator by name: raw, cupy_pool, cupy_async, xpool, xpool_seed, xpool_k<N>, noop, numpy."""
    m = re.fullmatch(r"xpool(?:_k(\d+)|_(seed))?(_debug)?", name)
    if m:
        k = 1 if m.group(2) else (int(m.group(1)) if m.group(1) else None)
        return XPool(k, debug="raise" if m.group(3) else None, name=name, **kwargs)
    if name not in FACTORIES:
        raise ValueError(f"unknown allocator {name!r}; known: {', '.join(NAMES)} (xpool_k<N> for any N)")
    return FACTORIES[name](**kwargs)
