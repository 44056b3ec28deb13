"""xpool under CuPy on a real GPU (marked: skipped where no GPU is visible)."""
import threading

import numpy as np
import pytest

import xpool

cp = pytest.importorskip("cupy")


def workload(seed=0):
    """A handful of CuPy computations whose bits we compare across allocators."""
    rng = np.random.default_rng(seed)
    a = cp.asarray(rng.standard_normal((257, 129), dtype=np.float32))
    b = cp.asarray(rng.standard_normal((129, 65), dtype=np.float32))
    out = [a @ b, cp.exp(a).sum(axis=0), cp.sort(a.ravel()), cp.cumsum(a, axis=1),
           cp.fft.fft(a[:, :64]).real.astype(cp.float32), (a[:, :65] * b[:65].T.sum()).max(axis=1)]
    return [x.get().tobytes() for x in out]


@pytest.mark.gpu
def test_results_are_bit_identical_raw_xpool_cupy_pool():
    prev = cp.cuda.get_allocator()
    results = {}
    try:
        for name, alloc in [("raw", None), ("cupy_pool", cp.cuda.MemoryPool().malloc),
                            ("xpool", xpool.MemoryPool().malloc),
                            ("xpool_k4", xpool.MemoryPool(scheme="seed", classes_per_doubling=4).malloc),
                            ("xpool_seed", xpool.MemoryPool(scheme="seed").malloc)]:
            cp.cuda.set_allocator(alloc)
            results[name] = workload()
    finally:
        cp.cuda.set_allocator(prev)
    assert results["xpool"] == results["raw"] == results["cupy_pool"] == results["xpool_k4"] == results["xpool_seed"]


@pytest.mark.gpu
def test_warm_loop_makes_no_device_mallocs(pool):
    x = cp.arange(1 << 20, dtype=cp.float32)

    def step():
        y = cp.sin(x) * 2 + 1
        z = y.reshape(1024, -1) @ y.reshape(-1, 1024)
        return float(z.sum()) + float(cp.sort(y)[-1])

    step()
    before = pool.stats()
    for _ in range(20):
        step()
    delta = pool.stats() - before
    assert delta.requests > 20 and delta.device_mallocs == 0 and delta.hits == delta.requests


def test_array_sees_requested_length_and_block_is_reused(mem):
    mem.pool()
    a = mem.empty(1000)
    assert a.nbytes == 1000
    if mem.kind == "cupy":
        assert a.obj.data.mem.size == 1000
    ptr = a.ptr
    del a
    b = mem.empty(900)
    assert b.ptr == ptr


def test_streams_do_not_share_blocks(mem):
    mem.pool()
    s1, s2 = mem.stream(), mem.stream()
    with s1:
        a = mem.empty(4096)
        p1 = a.ptr
        del a
    with s2:
        b = mem.empty(4096)
        assert b.ptr != p1
    with s1:
        c = mem.empty(4096)
        assert c.ptr == p1


def stream_key(pool, array, device=0):
    """The stream the pool filed the array's block under."""
    (block,) = [b for b in pool._core.live_blocks(device) if b["ptr"] == array.data.ptr]
    return block["stream"]


@pytest.mark.gpu
def test_blocks_are_keyed_by_cupys_current_stream(pool):
    """The hook asks CuPy for the device's current stream on every request (get_stream_ptr(device)): it
    follows `with stream:` (nested), `stream.use()`, and the per-thread default stream (keyed by thread)."""
    s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    a = cp.empty(4096, dtype=cp.uint8)
    assert stream_key(pool, a) == cp.cuda.get_current_stream().ptr
    with s1:
        b = cp.empty(4096, dtype=cp.uint8)
        with s2:
            c = cp.empty(4096, dtype=cp.uint8)
        d = cp.empty(4096, dtype=cp.uint8)
    assert [stream_key(pool, x) for x in (b, c, d)] == [s1.ptr, s2.ptr, s1.ptr]
    s2.use()
    try:
        e = cp.empty(4096, dtype=cp.uint8)
    finally:
        cp.cuda.Stream.null.use()
    assert stream_key(pool, e) == s2.ptr
    with cp.cuda.Stream.ptds:
        f = cp.empty(4096, dtype=cp.uint8)
        g = cp.empty(4096, dtype=cp.uint8)
    other = {}

    def on_another_thread():
        with cp.cuda.Stream.ptds:
            other["h"] = cp.empty(4096, dtype=cp.uint8)
            other["key"] = stream_key(pool, other["h"])

    t = threading.Thread(target=on_another_thread)
    t.start()
    t.join()
    # a thread's own key, negative, never another thread's (Note [Per-thread stream keys])
    assert stream_key(pool, f) == stream_key(pool, g) < 0 and other["key"] < 0 and other["key"] != stream_key(pool, f)
    assert stream_key(pool, cp.empty(4096, dtype=cp.uint8)) == cp.cuda.get_current_stream().ptr
    for s in (s1, s2):
        s.synchronize()


def test_limit_and_out_of_memory(mem):
    pool = mem.pool()
    pool.set_limit(size=100 << 20)
    keep = mem.empty(48 << 20)                          # a 48 MiB segment
    with pytest.raises(xpool.OutOfMemoryError, match="limit") as info:
        mem.empty(60 << 20)                             # 60 MiB more: over the limit
    if mem.kind == "cupy":
        assert isinstance(info.value, cp.cuda.memory.OutOfMemoryError)
        keep.obj.fill(1)
        assert int(keep.obj.sum()) == 48 << 20         # live arrays untouched
    assert pool.stats(0).bytes_in_use == keep.nbytes
    pool.set_limit(size=0)


def test_device_oom_recovers_by_freeing_the_cache(mem):
    pool = mem.pool()
    free, total = mem.free(), mem.total()
    chunk = int(free * 0.45)
    with mem.stream():                                 # another stream's: a miss here does not give it back
        a = mem.empty(chunk)
        del a                                          # cached, not free on the device
    b = mem.empty(int(free * 0.7))                     # only fits once the cache is released
    assert pool.stats(0).oom_recoveries == 1
    del b
    with pytest.raises(xpool.OutOfMemoryError, match="device 0"):
        mem.empty(total * 2)


@pytest.mark.gpu
def test_debug_mode_poisons_and_catches_overrun():
    prev = cp.cuda.get_allocator()
    p = xpool.MemoryPool(debug="raise")
    cp.cuda.set_allocator(p.malloc)
    try:
        a = cp.arange(256, dtype=cp.float32)
        stale = cp.ndarray(a.shape, a.dtype, memptr=cp.cuda.MemoryPointer(
            cp.cuda.UnownedMemory(a.data.ptr, a.nbytes, None, 0), 0))
        del a
        # read on the host: a device-side isnan would allocate its output where `a` was (best fit) first
        assert np.isnan(stale.get()).all()             # use-after-free reads NaN
        b = cp.zeros(100, dtype=cp.uint8)
        wide = cp.ndarray((101,), cp.uint8, memptr=cp.cuda.MemoryPointer(
            cp.cuda.UnownedMemory(b.data.ptr, 101, None, 0), 0))
        wide[100] = 7                                  # one byte past the end
        cp.cuda.runtime.deviceSynchronize()
        del b, wide
        with pytest.raises(xpool.CorruptionError, match="requested 100 B"):
            cp.empty(8, dtype=cp.uint8)
    finally:
        cp.cuda.set_allocator(prev)


@pytest.mark.gpu
@pytest.mark.multigpu
def test_block_released_on_another_thread_returns_to_its_device(pool):
    with cp.cuda.Device(1):
        a = cp.empty(1 << 20, dtype=cp.uint8)
        ptr = a.data.ptr
    box = [a]
    del a

    def other():
        with cp.cuda.Device(0):
            box.clear()

    t = threading.Thread(target=other)
    t.start()
    t.join()
    st = pool.stats()
    assert st[1]["blocks_cached"] == 1 and st[1]["blocks_in_use"] == 0
    with cp.cuda.Device(1):
        assert cp.empty(1 << 20, dtype=cp.uint8).data.ptr == ptr


@pytest.mark.gpu
@pytest.mark.multigpu
def test_each_device_allocates_on_its_own_current_stream(pool):
    """A stream made current on device 1 keys device 1's blocks only; device 0 keeps its own current stream."""
    with cp.cuda.Device(1):
        s = cp.cuda.Stream(non_blocking=True)
        with s:
            b = cp.empty(4096, dtype=cp.uint8)
            with cp.cuda.Device(0):
                a = cp.empty(4096, dtype=cp.uint8)
                default0 = cp.cuda.get_current_stream().ptr
    assert stream_key(pool, b, device=1) == s.ptr
    assert stream_key(pool, a, device=0) == default0 != s.ptr
    s.synchronize()
