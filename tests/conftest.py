"""GPU tests are marked and skipped where no GPU is visible; the rest run on a CPU."""
import pytest


def _n_gpus() -> int:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


N_GPUS = _n_gpus()


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
