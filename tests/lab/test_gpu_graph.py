"""The training step captured as a CUDA graph over a private pool (tapegpt.graph), on a real GPU."""
import numpy as np
import pytest

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")


def _train(cfg, steps, private=None, foreach=True):
    """Loss curve and final parameters of `steps` steps, eager (private None) or captured over `private`."""
    from tapegpt import GPT, AdamW, get_batch, load_corpus
    from tapegpt.graph import CapturedStep
    data = load_corpus()
    model = GPT(cfg, xp=cp)
    opt = AdamW(model.params, lr=1e-3, foreach=foreach)
    step = CapturedStep(model, private.malloc) if private is not None else model.loss_and_grads
    losses = cp.zeros(steps, dtype=cfg.dtype)
    for i in range(steps):
        x, y = get_batch(data, cfg.batch_size, cfg.block_size, i, xp=cp)
        loss, grads = step(x, y)
        losses[i] = loss
        opt.step(grads)
    params = {k: cp.asnumpy(v) for k, v in model.params.items()}
    return cp.asnumpy(losses), params, step


@pytest.mark.parametrize("private_kind", ["xpool", "cupy_pool"])
@pytest.mark.parametrize("batch,foreach", [(4, True), (32, True), (4, False)])
def test_captured_training_is_bit_identical_to_eager(pool, private_kind, batch, foreach):
    import xpool
    from tapegpt import GPTConfig
    cfg = GPTConfig(batch_size=batch)
    eager_losses, eager_params, _ = _train(cfg, 6, foreach=foreach)
    private = xpool.MemoryPool() if private_kind == "xpool" else cp.cuda.MemoryPool()
    losses, params, step = _train(cfg, 6, private, foreach=foreach)
    assert step.captures == 1
    assert np.array_equal(losses, eager_losses), (losses, eager_losses)
    for k in eager_params:
        assert np.array_equal(params[k], eager_params[k]), k


def test_replays_make_no_device_calls_in_either_pool(pool):
    import xpool
    from tapegpt import GPT, AdamW, GPTConfig, get_batch, load_corpus
    from tapegpt.graph import CapturedStep
    cfg = GPTConfig(batch_size=4)
    data, private = load_corpus(), xpool.MemoryPool()
    model = GPT(cfg, xp=cp)
    opt = AdamW(model.params, lr=1e-3)
    step = CapturedStep(model, private.malloc)
    for i in range(8):
        if i == 3:
            before, before_private = pool.stats(), private.stats()
        x, y = get_batch(data, cfg.batch_size, cfg.block_size, i, xp=cp)
        loss, grads = step(x, y)
        opt.step(grads)
    cp.cuda.Device().synchronize()
    d, dp = pool.stats() - before, private.stats() - before_private
    assert d.device_mallocs == 0 and d.device_frees == 0
    assert dp.requests == 0, "the private pool is the graph's alone: replays allocate nothing from it"
    assert dp.device_mallocs == 0 and dp.device_frees == 0
    assert private.total_bytes() > 0


def test_another_shape_is_refused_and_the_graph_still_replays(pool):
    import xpool
    from tapegpt import GPT, GPTConfig, get_batch, load_corpus
    from tapegpt.graph import CapturedStep
    cfg = GPTConfig(n_layer=2, batch_size=4)
    data = load_corpus()
    model = GPT(cfg, xp=cp)
    step = CapturedStep(model, xpool.MemoryPool().malloc)
    x, y = get_batch(data, 4, cfg.block_size, 0, xp=cp)
    first = float(step(x, y)[0])
    x2, y2 = get_batch(data, 2, cfg.block_size, 0, xp=cp)
    with pytest.raises(ValueError, match="x has shape"):
        step(x2, y2)
    assert float(step(x, y)[0]) == first
    assert float(model.loss_and_grads(x, y)[0]) == first      # eager gives the same bits


def test_a_graph_arm_runs_and_matches_its_eager_arm():
    from xlab import allocators as registry
    from xlab.experiments import train
    from tapegpt import load_corpus
    cfg = train.make_config("small")
    data = load_corpus()
    out = {}
    for name in ("xpool", "xpool_graph", "cupy_pool_graph"):
        alloc = registry.make(name)
        alloc.install()
        try:
            out[name] = train.run_rank(alloc, cfg, data, 4, steps=4, warmup=2, xp=cp)
        finally:
            alloc.uninstall()
            alloc.release([0])
    assert not out["xpool"]["graph"] and out["xpool_graph"]["graph"] and out["cupy_pool_graph"]["graph"]
    assert out["xpool_graph"]["losses"] == out["xpool"]["losses"]
    assert out["cupy_pool_graph"]["losses"] == out["xpool"]["losses"]
    assert out["xpool_graph"]["device_mallocs"] == 0
    assert out["xpool_graph"]["graph_pool_bytes"] > 0


def test_a_capture_with_the_installed_pool_is_not_ended_by_a_give_back(pool):
    """A miss above the high-water mark gives whole idle segments back first (cudaFree): not while the stream
    captures, which the cudaFree would end. CupyBackend asks cudaStreamIsCapturing."""
    MiB = 1 << 20
    side = cp.cuda.Stream(non_blocking=True)
    with side:
        a = cp.empty(3 * MiB, dtype=cp.uint8)
        del a                                           # a whole free 3 MiB segment of `side`, at the mark
        for _ in range(70):                             # idle for more than 64 requests: a miss may give it back
            cp.empty(512, dtype=cp.uint8)
        side.synchronize()
        assert pool._backend.capturing(0, side.ptr) is False
        before = pool.stats()
        side.begin_capture()
        try:
            assert pool._backend.capturing(0, side.ptr) is True
            b = cp.empty(6 * MiB, dtype=cp.uint8)       # a miss above the mark, inside the capture
            b.fill(7)
        finally:
            graph = side.end_capture()
        graph.launch(side)
        side.synchronize()
    d = pool.stats() - before
    assert d.device_frees == 0 and d.device_mallocs == 1
    assert int(b[-1]) == 7
