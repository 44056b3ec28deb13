"""tapegpt.graph.CapturedStep's protocol on a CPU, over a stand-in for CuPy's streams and graphs, and the registry's
`_graph` arms. The GPU tests (test_gpu_graph.py) check the real capture, bit for bit."""
import contextlib
import gc
import types

import numpy as np
import pytest
import xpool_twin

from tapegpt import GPT, get_batch, load_corpus
from tapegpt import graph as graph_mod
from xlab import allocators as registry
from xlab.experiments import train


class FakeCuda:
    """Streams, graphs and the thread-local allocator, recorded: a graph's replay reruns the captured function
    into the arrays it returned at capture (what a CUDA graph does to its static outputs)."""

    def __init__(self, fn, fail_in_capture=False):
        self.fn, self.fail_in_capture = fn, fail_in_capture
        self.log, self.allocator, self.capturing = [], None, False
        cuda = self

        class Stream:
            def __init__(self, non_blocking=False):
                self.ptr = id(self)

            def record(self):
                return "event"

            def wait_event(self, event):
                cuda.log.append("wait")

            def __enter__(self):
                cuda.log.append("enter side")
                return self

            def __exit__(self, *exc):
                cuda.log.append("exit side")

            def begin_capture(self):
                cuda.capturing = True
                cuda.log.append("begin")

            def end_capture(self):
                cuda.capturing = False
                cuda.log.append("end")
                return Graph(getattr(cuda, "captured", None))

            def synchronize(self):
                pass

        class Graph:
            def __init__(self, captured):
                self.captured = captured

            def upload(self, stream):
                pass

            def launch(self, stream=None):
                (x, y), (loss, grads) = self.captured
                new_loss, new_grads = cuda.fn(x, y)
                np.copyto(loss, new_loss)
                for k in grads:
                    np.copyto(grads[k], new_grads[k])

        self.Stream = Stream
        self.main = Stream()

    def get_current_stream(self):
        return self.main

    @contextlib.contextmanager
    def using_allocator(self, malloc):
        prev, self.allocator = self.allocator, malloc
        try:
            yield
        finally:
            self.allocator = prev


class FakeModel:
    """A NumPy GPT whose loss_and_grads records how it ran (allocator, capturing, gc) and returns fresh arrays."""

    def __init__(self, cfg, fail_in_capture=False):
        self.gpt = GPT(cfg, xp=np)
        self.cuda = FakeCuda(self._eager, fail_in_capture)
        self.xp = types.SimpleNamespace(cuda=self.cuda, copyto=np.copyto, empty_like=np.empty_like)
        self.calls = []

    def _eager(self, x, y):
        loss, grads = self.gpt.loss_and_grads(x, y)
        return np.array(loss), {k: g.copy() for k, g in grads.items()}

    def loss_and_grads(self, x, y):
        self.calls.append((self.cuda.allocator, self.cuda.capturing, gc.isenabled()))
        if self.cuda.capturing and self.cuda.fail_in_capture:
            raise RuntimeError("a synchronising call while capturing")
        out = self._eager(x, y)
        if self.cuda.capturing:
            self.cuda.captured = ((x, y), out)
        return out


@pytest.fixture
def fake(monkeypatch):
    cfg = train.make_config("tiny")

    def make(**kw):
        model = FakeModel(cfg, **kw)
        monkeypatch.setattr(graph_mod, "array_module", lambda a: model.xp)
        return model, cfg
    return make


def malloc(size):   # the private pool's malloc, as a token: the fake never allocates through it
    raise AssertionError("not called by the stand-in")


def test_replays_give_the_eager_steps_losses_and_gradients(fake):
    model, cfg = fake()
    step = graph_mod.CapturedStep(model, malloc)
    data = load_corpus()
    for i in range(3):
        x, y = get_batch(data, 2, cfg.block_size, i)
        loss, grads = step(x, y)
        want_loss, want_grads = model._eager(x, y)
        assert loss == want_loss
        assert all(np.array_equal(grads[k], want_grads[k]) for k in grads)
        assert x is not step._x          # the graph reads its own input arrays, refilled each call
    assert step.captures == 1
    # one warm-up run and one captured, both with the private pool, the capture with the collector off
    assert model.calls[:2] == [(malloc, False, True), (malloc, True, False)]
    assert model.cuda.allocator is None and gc.isenabled()
    assert model.cuda.log.count("begin") == model.cuda.log.count("end") == 1


def test_a_failed_capture_ends_it_restores_the_collector_and_allocator(fake):
    model, cfg = fake(fail_in_capture=True)
    step = graph_mod.CapturedStep(model, malloc, warmup=2)
    x, y = get_batch(load_corpus(), 2, cfg.block_size, 0)
    with pytest.raises(RuntimeError, match="synchronising"):
        step(x, y)
    assert model.cuda.log.count("begin") == model.cuda.log.count("end") == 1
    assert gc.isenabled() and model.cuda.allocator is None and step.graph is None
    assert [c[1] for c in model.calls] == [False, False, True]     # two warm-up runs, then the capture


def test_another_shape_or_dtype_is_refused_naming_the_argument(fake):
    model, cfg = fake()
    step = graph_mod.CapturedStep(model, malloc)
    data = load_corpus()
    x, y = get_batch(data, 2, cfg.block_size, 0)
    step(x, y)
    x3, y3 = get_batch(data, 3, cfg.block_size, 0)
    with pytest.raises(ValueError, match=r"^x has shape \(3, 16\)"):
        step(x3, y)
    with pytest.raises(ValueError, match=r"^y has shape .* dtype int32"):
        step(x, y.astype(np.int32))
    assert step.captures == 1


def test_bad_arguments():
    cfg = train.make_config("tiny")
    with pytest.raises(TypeError, match="CuPy"):
        graph_mod.CapturedStep(GPT(cfg, xp=np), malloc)
    with pytest.raises(ValueError, match="warmup must be at least 1"):
        graph_mod.CapturedStep(FakeModel(cfg), malloc, warmup=0)


# --- the registry's graph arms

@pytest.fixture
def host_pools(monkeypatch):
    """xpool.MemoryPool over host memory: the registry's xpool arms without a GPU."""
    import functools

    import xpool
    monkeypatch.setattr("xpool.MemoryPool", functools.partial(xpool.MemoryPool, backend=xpool_twin.HostBackend()))


def test_graph_arms_are_pools_with_the_name_given(host_pools):
    for name, kind in (("xpool_graph", registry.XPool), ("xpool_seed_graph", registry.XPool),
                       ("xpool_k4_graph", registry.XPool)):
        alloc = registry.make(name)
        assert isinstance(alloc, kind) and alloc.graph and alloc.name == name
        assert not registry.make(name[:-len("_graph")]).graph


@pytest.mark.parametrize("name", ["raw_graph", "cupy_async_graph", "noop_graph", "numpy_graph"])
def test_an_allocator_that_cannot_capture_is_refused(name):
    with pytest.raises(ValueError, match=f"allocator '{name}'.*cannot capture"):
        registry.make(name)


def test_an_unknown_base_name_is_refused():
    with pytest.raises(ValueError, match="unknown allocator 'nope'"):
        registry.make("nope_graph")


def test_xpool_graph_pools_are_private_counted_and_released(host_pools):
    import xpool
    alloc = registry.make("xpool_seed_graph")
    assert alloc.graph_pool_bytes(0) is None         # no private pool yet
    p1, p2 = alloc.graph_pool(), alloc.graph_pool()
    assert p1 is not p2 and p1 is not alloc.pool
    assert p1.settings.scheme == alloc.pool.settings.scheme == "seed"
    from cupy.cuda import memory
    param, malloc_fn, free_fn = p2._core.cfunctions()
    # a block of a private pool (CuPy's memory object on device 0) counts there, and in the arm's device mallocs
    held = memory.CFunctionAllocatorMemory(3000, param, malloc_fn, free_fn, 0)
    assert alloc.graph_pool_bytes(0) == p1.total_bytes() + p2.total_bytes() > 0
    assert alloc.device_mallocs(0) == 1               # the main pool made none
    del held
    alloc.release()
    assert alloc._private == [] and alloc.pool is None


def test_a_graph_arm_needs_cupy(host_pools):
    alloc = registry.make("xpool_graph")
    with pytest.raises(ValueError, match="captures CUDA graphs: it needs CuPy"):
        train.run_rank(alloc, train.make_config("tiny"), load_corpus(), 2, steps=1, warmup=0, xp=np)
