"""The pool under CuPy on a real GPU: limits per device and under threads, failed frees, huge requests through CuPy's
C path, check() under concurrency (marked: skipped where no GPU is visible)."""
import threading

import pytest

import xpool

cp = pytest.importorskip("cupy")
MiB = 1 << 20


def test_limit_argument_is_per_device_and_a_share_of_each(mem):
    pool = mem.pool(limit="1%")
    total = mem.total()
    assert abs(pool.get_limit() - total / 100) <= 1
    with pytest.raises(xpool.OutOfMemoryError) as info:
        mem.empty(total // 50)                         # alone larger than the limit
    assert info.value.reason == "limit_too_small"
    held = mem.empty(total // 160)                     # 0.625%: fits; a second one does not, beside it
    with pytest.raises(xpool.OutOfMemoryError) as info:
        mem.empty(total // 160)
    assert info.value.reason == "limit" and held.nbytes == total // 160


@pytest.mark.gpu
@pytest.mark.multigpu
def test_limit_argument_holds_on_a_second_gpu():
    pool = xpool.MemoryPool(limit="64MiB")
    with cp.cuda.Device(1), xpool.use(pool):
        assert pool.get_limit() == 64 * MiB
        a = cp.empty(48 * MiB, dtype=cp.uint8)
        with pytest.raises(xpool.OutOfMemoryError, match="limit"):
            cp.empty(48 * MiB, dtype=cp.uint8)
        del a
    assert pool.stats(device=1).peak_bytes_reserved <= 64 * MiB


def test_limit_holds_when_threads_share_a_gpu(mem):
    limit = 64 * MiB
    pool = mem.pool(limit=limit)
    errors, barrier = [], threading.Barrier(8)

    def worker():
        try:
            if mem.kind == "cupy":
                cp.cuda.Device(0).use()
            barrier.wait()
            for _ in range(20):
                held = []
                for _ in range(3):
                    try:
                        held.append(mem.empty(12 * MiB))        # 16 MiB class
                    except xpool.OutOfMemoryError as e:
                        assert e.reason == "limit"
                del held
        except Exception as e:  # noqa: BLE001 - surfaced below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    st = pool._core.stats(0)
    assert st["peak_bytes_reserved"] <= limit and st["bytes_in_use"] == st["bytes_pending"] == 0
    pool.empty_cache()
    assert pool._core.stats(0)["bytes_reserved"] == 0


def test_a_failed_cuda_free_keeps_the_block(mem):
    class FlakyFree(mem.backend_class):
        fail_next = 0

        def free(self, device, ptr, nbytes):
            if self.fail_next:
                self.fail_next -= 1
                raise RuntimeError("injected: cudaFree failed")
            super().free(device, ptr, nbytes)

    backend = mem.new_backend(FlakyFree)
    pool = mem.pool(backend, scheme="seed")                  # one device allocation per block
    arrays = [mem.empty(MiB) for _ in range(8)]
    del arrays
    backend.fail_next = 1
    with pytest.raises(RuntimeError, match="injected"):
        pool.free_all_blocks()
    assert (pool.n_free_blocks(), pool.total_bytes()) == (1, MiB)      # kept, counted
    assert pool.stats().device_frees == 7                      # the other seven went back
    pool.free_all_blocks()
    assert (pool.n_free_blocks(), pool.total_bytes()) == (0, 0)


@pytest.mark.gpu
def test_a_request_near_2_64_through_cupys_c_path_is_refused_in_debug_mode():
    from cupy.cuda import memory
    pool = xpool.MemoryPool(debug="raise")
    for n in (2**64 - 1, 2**64 - 64):
        with pytest.raises(ValueError, match="larger than any device"):
            memory.CFunctionAllocatorMemory(n, *pool._core.cfunctions(), 0)
    assert list(pool.stats()) == []


def test_check_is_quiet_while_threads_allocate_in_debug_mode(mem):
    pool = mem.pool(debug="raise")
    stop, errors = threading.Event(), []

    def churn():
        try:
            while not stop.is_set():
                a = mem.empty(4000)
                mem.fill(a, 1)
                b = mem.empty(70_000)
                mem.fill(b, 3)
                del a, b
        except Exception as e:  # noqa: BLE001 - surfaced below
            errors.append(repr(e))

    threads = [threading.Thread(target=churn) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        for _ in range(100):
            pool.check()
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert errors == [] and pool._hook.found == []
