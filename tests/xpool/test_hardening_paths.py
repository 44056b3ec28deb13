"""Issue 21: the core on its new paths (capture, per-thread streams, small-block OOM, misses at scale, bad input).

Every test pins one of the issue's eight defects (the number is in its name and its xfail reason), over host
memory: `Pool` and `MemoryPool` over `HostBackend`, PyTorch's entry points through ctypes (as PyTorch calls
them, without the GIL), CuPy's C hook through `CFunctionAllocatorMemory`, and a backend that says which streams
capture (`CaptureBackend`, the CPU twin of `CupyBackend.capturing`).
"""
import ctypes
import os
import subprocess
import sys
import threading

import pytest

import xpool
import xpool_twin
import xpool_twin.testing
from xpool import Pool, _core
from xpool_twin import HostBackend

KiB, MiB = 1 << 10, 1 << 20
PER_THREAD = 2                                  # cudaStreamPerThread's handle


def defect(n: int, what: str):
    return pytest.mark.xfail(strict=True, reason=f"issue 21, defect {n}: {what}")


class CaptureBackend(HostBackend):
    """HostBackend whose `capturing(device, stream)` answers as CUDA would for the captures it is told of.

    - ``streams``: {(device, handle)} being captured;
    - ``global_mode``: devices where some stream (maybe one the pool never saw) captures in global mode: the
      legacy stream (0) then reports it (cudaErrorStreamCaptureImplicit, which CupyBackend reads as True);
    - ``capture_own_stream(device)`` / ``end_own_stream(device)``: the calling thread's per-thread default
      stream (handle 2) captures; only that thread can see it.
    Every ``free`` made while a capture of its device is on is recorded in ``violations`` (on a GPU: the
    capture would end).
    """

    def __init__(self, **kw):
        super().__init__(**kw)
        self.streams, self.global_mode, self.asked, self.violations = set(), set(), [], []
        self.fail_fill = None
        self._own = threading.local()
        self._own_all = set()                       # (thread ident, device): any thread's per-thread capture

    def capture_own_stream(self, device=0):
        self._own.devices = getattr(self._own, "devices", set()) | {device}
        self._own_all.add((threading.get_ident(), device))

    def end_own_stream(self, device=0):
        self._own.devices = getattr(self._own, "devices", set()) - {device}
        self._own_all.discard((threading.get_ident(), device))

    def capturing(self, device, stream):
        self.asked.append((device, stream))
        if stream == PER_THREAD:
            return device in getattr(self._own, "devices", set())
        return (device, stream) in self.streams or (stream == 0 and device in self.global_mode)

    def capture_on(self, device):
        return (any(d == device for d, _ in self.streams) or device in self.global_mode
                or any(d == device for _, d in self._own_all))

    def free(self, device, ptr, nbytes):
        if self.capture_on(device):
            self.violations.append((device, ptr, nbytes))
        super().free(device, ptr, nbytes)

    def fill(self, device, ptr, nbytes, byte):
        if self.fail_fill:
            raise self.fail_fill
        super().fill(device, ptr, nbytes, byte)


def counters(pool, device=0):
    s = pool._core.stats(device)
    return s["device_mallocs"], s["device_frees"], s["bytes_reserved"], s["bytes_cached"]


def assert_exact(pool, backend, device=0):
    s = pool._core.stats(device)
    assert s["bytes_pending"] == s["bytes_releasing"] == 0, s
    assert s["bytes_reserved"] == backend.used(device), (s, backend.used(device))
    assert s["device_mallocs"] - s["device_frees"] == len([1 for d, _ in backend.live().values() if d == device])


# ------------------------------------------------------------------ 1. capture, other streams


def test_1_the_oom_ladder_gives_nothing_back_while_another_stream_of_the_device_captures():
    backend = CaptureBackend(capacity=8 * MiB)
    pool = Pool(backend)
    pool.allocate(3 * MiB, stream=7).release()      # stream 7's whole free segment: the ladder could free it
    held = pool.allocate(3 * MiB, stream=1)
    backend.streams = {(0, 7)}
    before = counters(pool)
    with pytest.raises(xpool.OutOfMemoryError) as e:
        pool.allocate(4 * MiB, stream=1)            # 3 + 3 + 4 > 8: only freeing stream 7's segment makes room
    assert e.value.reason == "device_capturing"
    assert counters(pool) == before and backend.violations == [] and (0, 7) in backend.asked
    assert_exact(pool, backend)
    backend.streams = set()                         # the capture is over: the ladder frees and retries
    assert pool.allocate(4 * MiB, stream=1).size == 4 * MiB and counters(pool)[1] == 1
    del held


def test_1_the_limit_ladder_gives_nothing_back_while_another_stream_of_the_device_captures():
    backend = CaptureBackend()
    pool = Pool(backend, limit=8 * MiB)
    pool.allocate(3 * MiB, stream=7).release()
    held = pool.allocate(3 * MiB, stream=1)
    backend.streams = {(0, 7)}
    with pytest.raises(xpool.OutOfMemoryError) as e:
        pool.allocate(4 * MiB, stream=1)
    assert e.value.reason == "limit_capturing"
    assert counters(pool) == (2, 0, 6 * MiB, 3 * MiB) and backend.violations == []
    del held


def test_1_a_miss_gives_nothing_back_while_another_stream_of_the_device_captures():
    backend = CaptureBackend()
    pool = Pool(backend)
    held7 = pool.allocate(2 * MiB, stream=7)        # stream 7 has a segment on device 0: the pool knows it
    pool.allocate(3 * MiB, stream=1).release()      # stream 1's whole free segment
    backend.streams = {(0, 7)}
    big = pool.allocate(6 * MiB, stream=1)          # a miss only adds (the one release rule): nothing to ask
    assert counters(pool)[:2] == (3, 0) and backend.violations == [] and big.size == 6 * MiB
    assert backend.asked == []
    del held7, big


def test_1_a_global_mode_capture_elsewhere_shows_through_the_legacy_stream():
    backend = CaptureBackend(capacity=8 * MiB)
    pool = Pool(backend)
    held = pool.allocate(3 * MiB, stream=1)
    pool.allocate(2 * MiB, stream=1).release()      # a whole free 2 MiB segment the ladder could give back
    backend.global_mode = {0}                       # some stream of device 0 captures in global mode
    with pytest.raises(xpool.OutOfMemoryError) as e:
        pool.allocate(4 * MiB, stream=1)
    assert e.value.reason == "device_capturing" and (0, 0) in backend.asked and backend.violations == []
    del held


def test_1_empty_cache_skips_a_device_while_one_of_its_streams_captures():
    backend = CaptureBackend()
    pool = Pool(backend)
    pool.allocate(3 * MiB, device=0, stream=7).release()
    pool.allocate(3 * MiB, device=1, stream=7).release()
    backend.streams = {(0, 7)}
    assert pool.empty_cache() == 3 * MiB            # device 1's only
    assert counters(pool, 0) == (1, 0, 3 * MiB, 3 * MiB) and backend.violations == []
    assert pool.trim(0) == 0 and pool._core.release(0, stream=7) == 0
    backend.streams = set()
    assert pool.empty_cache() == 3 * MiB and backend.live() == {}


def test_1_another_live_threads_per_thread_stream_counts_as_possibly_capturing():
    backend = CaptureBackend(capacity=8 * MiB)
    pool = Pool(backend)
    ready, done = threading.Event(), threading.Event()

    def other():                                    # a thread whose per-thread stream may capture
        backend.capture_own_stream(0)
        pool.allocate(3 * MiB, stream=PER_THREAD).release()
        ready.set()
        done.wait(30)
        backend.end_own_stream(0)

    t = threading.Thread(target=other)
    t.start()
    ready.wait(30)
    try:
        held = pool.allocate(3 * MiB, stream=1)
        with pytest.raises(xpool.OutOfMemoryError) as e:
            pool.allocate(4 * MiB, stream=1)        # only the other thread's segment could make room
        assert e.value.reason == "device_capturing" and backend.violations == []
        assert (0, PER_THREAD) not in backend.asked # asking handle 2 here would ask about this thread's stream
    finally:
        done.set()
        t.join()
    assert pool.allocate(4 * MiB, stream=1).size == 4 * MiB   # that thread is gone: its segment goes back
    del held


# ------------------------------------------------------------------ 2. capture, debug mode


def test_2_a_segment_whose_poisoning_failed_stays_cached_while_its_stream_captures():
    backend = CaptureBackend()
    pool = Pool(backend, debug="raise")
    backend.streams = {(0, 5)}
    backend.fail_fill = RuntimeError("memset failed")
    with pytest.raises(RuntimeError, match="memset failed"):
        pool.allocate(1000, stream=5)               # a new 2 MiB segment; poisoning its rest fails
    assert backend.violations == [] and counters(pool) == (1, 0, 2 * MiB, 2 * MiB)
    assert_exact(pool, backend)
    backend.fail_fill, backend.streams = None, set()
    a = pool.allocate(1000, stream=5)               # the cached segment serves, unpoisoned (nothing to check)
    assert counters(pool)[0] == 1 and a.size == 1536   # 1000 B and the 64 B canary, to 512 B
    del a
    pool.check()


def test_2_seed_a_new_block_whose_canary_failed_stays_cached_while_its_stream_captures():
    backend = CaptureBackend()
    pool = Pool(backend, scheme="seed", debug="raise")
    backend.streams = {(0, 5)}
    backend.fail_fill = RuntimeError("memset failed")
    with pytest.raises(RuntimeError, match="memset failed"):
        pool.allocate(1000, stream=5)
    assert backend.violations == [] and counters(pool)[:2] == (1, 0)
    assert_exact(pool, backend)


def test_2_seed_a_freed_block_whose_poisoning_failed_stays_cached_while_its_stream_captures(monkeypatch):
    reports = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: reports.append(u.exc_value))
    backend = CaptureBackend()
    pool = Pool(backend, scheme="seed", debug="raise")
    a = pool.allocate(1000, stream=5)
    backend.streams = {(0, 5)}
    backend.fail_fill = RuntimeError("memset failed")
    with pytest.raises(RuntimeError, match="memset failed"):
        a.release()
    assert backend.violations == [] and counters(pool)[:2] == (1, 0)
    assert pool._core.stats(0)["blocks_cached"] == 1
    assert_exact(pool, backend)


# ------------------------------------------------------------------ 3. per-thread default stream, Python path


def _in_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


def test_3_allocate_on_the_per_thread_stream_keys_the_block_per_thread():
    pool = Pool(HostBackend())
    a = pool.allocate(4096, stream=PER_THREAD)
    ptr = a.ptr
    assert a.stream == PER_THREAD                   # the handle it was asked for
    a.release()
    other = _in_thread(lambda: pool.allocate(4096, stream=PER_THREAD))
    assert other.ptr != ptr                         # another thread's stream: not reused
    assert pool.allocate(4096, stream=PER_THREAD).ptr == ptr   # this thread's: reused
    del other


def test_3_allocate_on_the_backends_current_per_thread_stream_keys_the_block_per_thread():
    backend = HostBackend()
    pool = Pool(backend)

    def alloc():
        backend.set_stream(PER_THREAD)              # this thread's current stream: its per-thread stream
        return pool.allocate(4096)

    a = alloc()
    ptr = a.ptr
    a.release()
    other = _in_thread(alloc)
    assert other.ptr != ptr and alloc().ptr == ptr
    del other


def test_3_release_of_the_per_thread_stream_gives_back_this_threads_blocks_only():
    pool = Pool(HostBackend())
    pool.allocate(3 * MiB, stream=PER_THREAD).release()
    _in_thread(lambda: pool.allocate(5 * MiB, stream=PER_THREAD).release())
    assert pool._core.release(0, stream=PER_THREAD) == 3 * MiB


# ------------------------------------------------------------------ 4. per-thread keys outlive their threads

from fixtures.torch_c import FREE, LAST_ERROR, LIB, MALLOC, TRY_MALLOC, torch_free, torch_malloc  # noqa: E402,F401

@pytest.fixture
def torch_pool():
    """A host-memory pool bound to PyTorch's entry points; every torch block must be back at the end."""
    pool = Pool(HostBackend(n_devices=2))
    pool._core.bind_torch()
    yield pool
    for d in list(pool.stats()):
        assert pool._core.stats(d)["bytes_in_use_torch"] == 0, "a test left a torch block in use"
    pool.empty_cache()


def _threads_in_turn(n, alloc_free):
    """n threads one after another, each taking and freeing one block on its per-thread stream: their pointers.
    Thread idents are reused as threads end, so a key derived from them would hand a dead thread's block on."""
    ptrs = []
    for _ in range(n):
        t = threading.Thread(target=lambda: ptrs.append(alloc_free()))
        t.start()
        t.join()
    return ptrs


def _assert_no_block_of_a_dead_thread_reused(ptrs, pool):
    """No thread was handed a block cached for another thread's stream: every request missed.  An address may come
    again, from the device, once the pool gave the dead thread's block back at a miss (Note [Ended threads' streams]
    in xpool/_alloc.c): each repeat needs a give-back before it."""
    st = pool.stats()
    assert st.hits == 0, f"{st.hits} of {len(ptrs)} threads got a block freed by a thread that had ended"
    repeats = sum(p in ptrs[:i] for i, p in enumerate(ptrs))
    assert repeats <= st.device_frees, (repeats, st.device_frees)


def test_4_torch_path_a_new_thread_never_gets_a_dead_threads_per_thread_block(torch_pool):
    def alloc_free():
        p = torch_malloc(4096, stream=PER_THREAD)
        FREE(p, 4096, 0, PER_THREAD)
        return p
    _assert_no_block_of_a_dead_thread_reused(_threads_in_turn(50, alloc_free), torch_pool)


def test_4_cupy_path_a_new_thread_never_gets_a_dead_threads_per_thread_block():
    cupy_memory = pytest.importorskip("cupy.cuda.memory")
    fn = ctypes.CFUNCTYPE(ctypes.c_ssize_t, ctypes.c_int)(lambda device: PER_THREAD)
    pool = xpool_twin.testing.pool_with_stream_lookup(HostBackend(), ctypes.cast(fn, ctypes.c_void_p).value)
    param, malloc_fn, free_fn = xpool_twin.testing.cfunctions(pool)

    def alloc_free():
        mem = cupy_memory.CFunctionAllocatorMemory(4096, param, malloc_fn, free_fn, 0)
        return mem.ptr                              # freed when mem dies, on return
    _assert_no_block_of_a_dead_thread_reused(_threads_in_turn(50, alloc_free), pool)


def test_4_python_path_a_new_thread_never_gets_a_dead_threads_per_thread_block():
    pool = Pool(HostBackend())

    def record():
        a = pool.allocate(4096, stream=PER_THREAD)
        p = a.ptr
        a.release()
        return p
    ptrs = _threads_in_turn(50, record)
    _assert_no_block_of_a_dead_thread_reused(ptrs, pool)
    # each dead thread's cache went back at the next thread's miss; the last one's at empty_cache()
    assert pool.stats().device_frees == 49
    assert pool.empty_cache() == 2 * MiB and pool._backend.live() == {}


# ------------------------------------------------------------------ 5. out of memory for a small block that fits


def test_5_a_small_block_that_fits_the_free_memory_is_served():
    backend = HostBackend(capacity=4 * MiB)
    pool = Pool(backend)
    held = pool.allocate(3 * MiB)
    a = pool.allocate(4 * KiB)                      # the 2 MiB segment does not fit; the exact size does
    assert a.size == 4 * KiB and backend.used(0) <= 4 * MiB
    assert_exact(pool, backend)
    del held, a


def test_5_out_of_memory_for_a_small_block_reports_the_requests_class():
    backend = HostBackend(capacity=4 * MiB)
    pool = Pool(backend)
    held = pool.allocate(4 * MiB - 2 * KiB)
    with pytest.raises(xpool.OutOfMemoryError) as e:
        pool.allocate(4 * KiB)                      # not even the exact size fits
    assert e.value.size == 4 * KiB and "refused 4.00 KiB" in str(e.value) and "2.00 MiB" not in str(e.value)
    assert_exact(pool, backend)
    del held


# ------------------------------------------------------------------ 6. searching for segments to give back


def _pool_with_free_ranges(n_ranges, **kw):
    """A pool whose stream 0 has `n_ranges` free 512 B ranges inside partly used 2 MiB segments."""
    pool = Pool(HostBackend(), **kw)
    blocks = [pool.allocate(512) for _ in range(2 * n_ranges)]
    keep = blocks[1::2]                             # every other one stays in use: the rest cannot merge
    del blocks
    assert pool._core.stats(0)["blocks_cached"] >= n_ranges
    return pool, keep


def test_6_a_growing_miss_searches_nothing_to_give_back():
    pool, keep = _pool_with_free_ranges(1000)
    size, before = 8 * MiB, pool.stats()
    for _ in range(8):
        size += 512                                 # each one larger than any before
        pool.allocate(size).release()
    assert xpool_twin.testing.release_scan_visits(pool, 0) == 0     # a miss only adds: the one release rule
    assert (pool.stats() - before).device_frees == 0


def _scan_visits_per_release(n_ranges, releases=8):
    pool, keep = _pool_with_free_ranges(n_ranges)
    visits0 = xpool_twin.testing.release_scan_visits(pool, 0)
    for i in range(releases):
        pool.allocate(8 * MiB + 512 * i).release()  # one whole free segment beside the partly used ones
        assert pool.empty_cache() == 8 * MiB + 512 * i
    return (xpool_twin.testing.release_scan_visits(pool, 0) - visits0) / releases


def test_6_empty_cache_does_not_walk_the_free_ranges_of_partly_used_segments():
    few, many = _scan_visits_per_release(100), _scan_visits_per_release(10_000)
    assert many < 10 * max(few, 1), (few, many)     # O(free ranges) would be 100 times as many
    assert many < 200, many


# ------------------------------------------------------------------ 7. unknown devices


def test_7_torch_path_refuses_an_unknown_device_before_counting(torch_pool, monkeypatch):
    reports = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: reports.append(str(u.exc_value)))
    for device in (2, 5, 63):
        with pytest.raises(MemoryError, match=rf"device must be .*\[0, 2\).* got {device}"):
            torch_malloc(100, device=device)
    FREE(0x1000, 100, 5, None)                      # a free on an unknown device: reported, nothing made
    FREE(0x1000, 100, 0, None)                      # a pointer never handed out: named in the report
    assert list(torch_pool.stats()) == [] and len(reports) == 2 and "[0, 2)" in reports[0]
    assert "pointer 0x1000 on device 0 was not handed out" in reports[1], reports[1]


def test_7_cupy_path_refuses_an_unknown_device_before_counting():
    cupy_memory = pytest.importorskip("cupy.cuda.memory")
    pool = Pool(HostBackend(n_devices=2))
    param, malloc_fn, free_fn = xpool_twin.testing.cfunctions(pool)
    with pytest.raises(ValueError, match=r"device must be .*\[0, 2\).* got 5"):
        cupy_memory.CFunctionAllocatorMemory(100, param, malloc_fn, free_fn, 5)
    assert list(pool.stats()) == []


def test_7_core_entry_points_refuse_an_unknown_device():
    pool = Pool(HostBackend(n_devices=2))
    for call in (lambda: pool._core.allocate(100, 5, 0), lambda: pool._core.stats(5),
                 lambda: pool._core.set_limit(5, 100)):
        with pytest.raises(ValueError, match=r"\[0, 2\)"):
            call()
    assert list(pool.stats()) == []


# ------------------------------------------------------------------ 8. bad input

BAD_LIMITS = ["0.5", "0.4B", "1.5", "0.0001KB"]


@pytest.mark.parametrize("text", BAD_LIMITS)
def test_8_a_limit_of_a_fraction_of_a_byte_is_refused(text, monkeypatch):
    with pytest.raises(ValueError, match=r"\blimit\b.*" + text.replace(".", r"\.")):
        Pool(HostBackend(), limit=text)
    monkeypatch.setenv("XPOOL_MEMORY_LIMIT", text)
    with pytest.raises(ValueError, match="XPOOL_MEMORY_LIMIT"):
        Pool(HostBackend())


def test_8_limits_that_are_whole_bytes_still_work(monkeypatch):
    assert Pool(HostBackend(), limit="0.5KiB").get_limit(0) == 512
    assert Pool(HostBackend(), limit="1.5KB").get_limit(0) == 1500
    assert Pool(HostBackend(), limit="0").get_limit(0) == 0


@pytest.mark.parametrize("value", ["bogus", "2", "maybe", "raise it"])
def test_8_a_bad_debug_setting_names_its_variable(value, monkeypatch):
    monkeypatch.setenv("XPOOL_DEBUG", value)
    with pytest.raises(ValueError, match="XPOOL_DEBUG"):
        Pool(HostBackend())
    monkeypatch.delenv("XPOOL_DEBUG")
    with pytest.raises(ValueError, match=r"\bdebug\b"):
        Pool(HostBackend(), debug=value)


def test_8_an_unknown_setting_is_named():
    with pytest.raises(TypeError, match="no_such_setting"):
        Pool(HostBackend(), no_such_setting=1)


@pytest.mark.parametrize("events", [1 << 60, 1 << 63, 1 << 64])
def test_8_a_timeline_too_large_names_its_argument(events, monkeypatch):
    with pytest.raises((ValueError, MemoryError), match="timeline"):
        Pool(HostBackend(), timeline=events)
    monkeypatch.setenv("XPOOL_TIMELINE", str(events))
    with pytest.raises((ValueError, MemoryError), match="XPOOL_TIMELINE"):
        Pool(HostBackend())


def test_8_free_all_blocks_takes_a_stream_handle_and_names_a_bad_one():
    pytest.importorskip("cupy")
    pool = xpool.MemoryPool(backend=HostBackend())
    pool.allocate(3 * MiB, stream=5).release()
    pool.allocate(3 * MiB, stream=6).release()
    pool.free_all_blocks(stream=5)                  # an int handle, as Pool.allocate takes
    assert pool.free_bytes() == 3 * MiB
    with pytest.raises((TypeError, ValueError), match="stream"):
        pool.free_all_blocks(stream="5")


def test_8_torch_path_a_negative_size_is_refused_naming_it(torch_pool):
    with pytest.raises(MemoryError, match=r"size must be >= 0, got -1"):
        torch_malloc(-1)
    assert torch_pool._core.stats(0)["requests"] == 0


class Garbage(HostBackend):
    def __init__(self, count=2, device=0, stream=0):
        super().__init__(n_devices=2)
        self.count, self.device, self.stream = count, device, stream

    def device_count(self):
        return self.count

    def current_device(self):
        return self.device

    def current_stream(self):
        return self.stream


@pytest.mark.parametrize("count", ["2", None, -1, 2.5, True])
def test_8_garbage_device_count_is_refused_naming_it(count):
    with pytest.raises((TypeError, ValueError), match=r"device_count\(\)"):
        Pool(Garbage(count=count))


@pytest.mark.parametrize("device", ["0", None, -1, 2, 1.0])
def test_8_garbage_current_device_is_refused_naming_it(device):
    pool = Pool(Garbage(device=device))
    with pytest.raises((TypeError, ValueError), match=r"current_device\(\)"):
        pool.allocate(100)
    assert list(pool.stats()) == []


@pytest.mark.parametrize("stream", ["0", None, 1 << 64, -1, 1.0])
def test_8_garbage_current_stream_is_refused_naming_it(stream):
    pool = Pool(Garbage(stream=stream))
    with pytest.raises((TypeError, ValueError), match=r"current_stream\(\)"):
        pool.allocate(100)
    assert list(pool.stats()) == []


@pytest.mark.parametrize("lookup", ["1", "4096", "id(object())"])
def test_8_a_bad_stream_lookup_is_refused_not_called(lookup):
    code = ("import xpool, xpool_twin, xpool_twin.testing\n"
            "try:\n"
            f"    p = xpool_twin.testing.pool_with_stream_lookup(xpool_twin.HostBackend(), {lookup})\n"
            "    import cupy.cuda.memory as m\n"
            "    param, f, g = xpool_twin.testing.cfunctions(p)\n"
            "    m.CFunctionAllocatorMemory(100, param, f, g, 0)\n"
            "except (TypeError, ValueError) as e:\n"
            "    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])
    assert out.stdout.startswith("refused:") and "stream_lookup" in out.stdout, out.stdout
