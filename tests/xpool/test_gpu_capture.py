"""A capture on one stream while the pool works on another, on a real GPU (the CPU twin: tests/xpool/test_capture.py).

A cudaFree while any stream of the device captures ends that capture; the pool must give nothing back on the
device then, whichever stream asked. Each test captures a kernel on stream s1 (CuPy's default relaxed mode, so
allocating on s2 meanwhile is legal) while the pool hits its limit, empties its cache or misses on s2; end_capture
fails (cudaErrorStreamCaptureInvalidated) if anything was freed.
"""
import pytest

pytestmark = pytest.mark.gpu
cp = pytest.importorskip("cupy")

MiB = 1 << 20


def _captured_increment(s1, z):
    """Begins a capture on s1 (the current stream) of one kernel on z, an array made before."""
    z += 0                                          # eager first: the kernel is compiled and loaded
    s1.synchronize()
    s1.begin_capture()
    z += 1


def test_the_limit_ladder_on_another_stream_leaves_a_capture_intact():
    import xpool
    pool = xpool.MemoryPool()
    s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    with xpool.use(pool):
        with s1:
            z = cp.zeros(1024, cp.int32)
            cp.empty(8 * MiB, cp.uint8).fill(1)     # freed: a whole free 8 MiB segment of s1
            s1.synchronize()
        with s2:
            held = cp.empty(8 * MiB, cp.uint8)
        pool.set_limit(size=pool.total_bytes() + 2 * MiB)
        before = pool.stats()
        with s1:
            _captured_increment(s1, z)
            with s2:
                with pytest.raises(xpool.OutOfMemoryError) as e:
                    cp.empty(4 * MiB, cp.uint8)     # only freeing s1's segment would make room
            graph = s1.end_capture()                # raises if a cudaFree ended the capture
        assert e.value.reason == "limit_capturing"
        assert (pool.stats() - before).device_frees == 0
        graph.launch(s1)
        s1.synchronize()
        assert int(z.sum()) == 1024
        del held
    pool.free_all_blocks()


def test_a_release_and_a_miss_on_another_stream_give_nothing_back_during_a_capture():
    import xpool
    pool = xpool.MemoryPool()
    s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    with xpool.use(pool):
        with s1:
            z = cp.zeros(1024, cp.int32)
        with s2:
            cp.empty(3 * MiB, cp.uint8).fill(1)     # s2's whole free 3 MiB segment
            s2.synchronize()
        before = pool.stats()
        with s1:
            _captured_increment(s1, z)
            assert pool.empty_cache() == 0          # a stream of the device captures: nothing goes back
            with s2:
                big = cp.empty(6 * MiB, cp.uint8)   # a miss only adds (the one release rule)
            graph = s1.end_capture()                # raises if a cudaFree ended the capture
        assert (pool.stats() - before).device_frees == 0
        graph.launch(s1)
        s1.synchronize()
        assert int(z.sum()) == 1024
        del big
        assert pool.empty_cache() >= 3 * MiB        # no capture now: the cache goes back
        assert (pool.stats() - before).device_frees >= 1
    pool.free_all_blocks()


@pytest.mark.parametrize("scheme", ["segments", "expandable"])
def test_a_destroyed_stream_with_cached_memory_is_never_asked(scheme):
    """A stream dropped with its blocks cached (its handle destroyed), then a give-back that checks for captures:
    asking the destroyed stream is undefined (it crashed the process in the driver, 8bf3303); run in a child so a
    crash fails this test, not the suite."""
    import subprocess
    import sys
    code = f"""
import gc, cupy as cp, xpool
pool = xpool.MemoryPool(scheme={scheme!r})
cp.cuda.set_allocator(pool.malloc)
for i in range(20):
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        if i % 2:
            s.begin_capture()
        a = cp.empty((i + 1) << 20, dtype=cp.uint8)
        a.fill(1)
        if i % 2:
            g = s.end_capture()
            g.launch(s)
            del g
        s.synchronize()
        del a
    del s
    gc.collect()
    pool.empty_cache()
cp.cuda.set_allocator(None)
print("ok", pool.stats(0).bytes_reserved)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["ok", "0"], out.stdout + out.stderr
