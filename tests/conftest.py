"""GPU tests are marked and skipped where no GPU is visible; the rest run on a CPU.  ``--deep`` (or
XPOOL_TESTS_DEEP=1) runs the soaks and the largest hypothesis searches at full size (tests/xpool/faults.py)."""
import os

import pytest


def _n_gpus() -> int:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


N_GPUS = _n_gpus()


def pytest_addoption(parser):
    parser.addoption("--deep", action="store_true",
                     help="the soaks and the largest hypothesis searches at full size (also XPOOL_TESTS_DEEP=1)")


def pytest_configure(config):
    if config.getoption("--deep"):
        os.environ["XPOOL_TESTS_DEEP"] = "1"        # read as the test modules are imported


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none visible)")
    skip_multi = pytest.mark.skip(reason=f"needs 2+ CUDA GPUs ({N_GPUS} visible)")
    for item in items:
        if "gpu" in item.keywords and N_GPUS < 1:
            item.add_marker(skip_gpu)
        if "multigpu" in item.keywords and N_GPUS < 2:
            item.add_marker(skip_multi)


@pytest.fixture
def pool():
    """A fresh xpool.MemoryPool installed as CuPy's allocator for one GPU test; its cache is emptied after."""
    cp = pytest.importorskip("cupy")
    import xpool
    prev = cp.cuda.get_allocator()
    p = xpool.MemoryPool()
    cp.cuda.set_allocator(p.malloc)
    yield p
    cp.cuda.set_allocator(prev)
    p.empty_cache()


class Memory:
    """One device's memory for a test body that runs on either backend: the host twin on a CPU (CI), CuPy on a GPU.

    ``pool(**settings)`` makes an ``xpool.MemoryPool`` over a fresh backend of the kind and makes it current;
    ``empty(nbytes)`` holds a block of it (a CuPy array on a GPU, the pool's block on the twin), given back when the
    last reference goes; ``stream()`` is a new stream, a context that makes it current; ``free()`` the device's free
    bytes. The twin's device has ``capacity`` bytes (CuPy's: the GPU's)."""

    def __init__(self, kind: str, capacity: int = 4 << 30):
        self.kind, self.capacity = kind, capacity
        self.backend = self._pool = None
        self._streams = 0

    @property
    def backend_class(self):
        if self.kind == "cupy":
            from xpool.backends import CupyBackend
            return CupyBackend
        from xpool_twin import TwinBackend
        return TwinBackend

    def new_backend(self, cls=None):
        cls = cls or self.backend_class
        return cls() if self.kind == "cupy" else cls(capacity=self.capacity)

    def pool(self, backend=None, **settings):
        import xpool
        self.backend = backend or self.new_backend()
        self._pool = xpool.MemoryPool(backend=self.backend, **settings)
        return self._pool

    def empty(self, nbytes: int, pool=None):
        pool = pool or self._pool
        if self.kind == "cupy":
            import cupy as cp
            import xpool
            with xpool.use(pool):
                return _Held(cp.empty(nbytes, dtype=cp.uint8))
        return _Held(pool.allocate(nbytes))

    def fill(self, held, byte: int) -> None:
        """Write `byte` over a held block's bytes asked for, as a kernel would."""
        if self.kind == "cupy":
            held.obj.fill(byte)
        else:
            self.backend.fill(0, held.ptr, held.nbytes, byte)

    def stream(self):
        if self.kind == "cupy":
            import cupy as cp
            return cp.cuda.Stream(non_blocking=True)
        self._streams += 1
        return _TwinStream(self.backend, 0x5000 + 16 * self._streams)

    def page(self) -> int:
        """The granularity of the device's mapped pages (scheme expandable)."""
        if self.kind == "cupy":
            import cupy as cp
            from xpool_twin import Ops
            return Ops(self.backend.vmm()).granularity(cp.cuda.Device().id)
        return self.backend.twin.granularity(0)

    def total(self) -> int:
        return self.backend.total_memory(0)

    def free(self) -> int:
        if self.kind == "cupy":
            import cupy as cp
            cp.cuda.Device().synchronize()
            return cp.cuda.runtime.memGetInfo()[0]
        return self.capacity - self.backend.used(0) - self.backend.twin.mapped_bytes(0)   # segments, pages


class _Held:
    """A block held: ``ptr`` and ``nbytes`` (the bytes asked for), on either backend."""

    def __init__(self, obj):
        self.obj = obj
        self.ptr = obj.data.ptr if hasattr(obj, "data") else obj.ptr
        self.nbytes = obj.nbytes if hasattr(obj, "nbytes") else obj.requested


class _TwinStream:
    """A stream of the twin: a handle, current on this thread inside ``with``."""

    def __init__(self, backend, ptr: int):
        self.backend, self.ptr, self._before = backend, ptr, []

    def __enter__(self):
        self._before.append(self.backend.current_stream())
        self.backend.set_stream(self.ptr)
        return self

    def __exit__(self, *exc):
        self.backend.set_stream(self._before.pop())

    def synchronize(self):
        pass


@pytest.fixture(params=["twin", pytest.param("cupy", marks=pytest.mark.gpu)])
def mem(request):
    """One test body on both backends: the host twin (every machine) and CuPy (a GPU; skipped without one)."""
    if request.param == "cupy":
        pytest.importorskip("cupy")
    m = Memory(request.param)
    yield m
    if m._pool is not None:
        m._pool.empty_cache()
