"""A stream being captured into a CUDA graph: the pool gives nothing back (cudaFree would end the capture).

Over host memory, with a backend that says which streams capture (CupyBackend asks cudaStreamIsCapturing); the
GPU test of the captured training step is tests/lab/test_gpu_graph.py."""
import sys
import threading

import pytest

import xpool
from xpool import Pool
from xpool_twin import HostBackend


MiB = 1 << 20


class CapturingBackend(HostBackend):
    """HostBackend whose `capturing(device, stream)` says True for the streams in `.capturing_streams`."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.capturing_streams, self.asked, self.fail = set(), [], None

    def capturing(self, device, stream):
        self.asked.append((device, stream))
        if self.fail:
            raise self.fail
        return stream in self.capturing_streams


def make(capacity=None, **kw):
    backend = CapturingBackend(capacity=capacity)
    return Pool(backend, **kw), backend


def counters(pool):
    s = pool.stats()
    return s.device_mallocs, s.device_frees, s.bytes_reserved


def test_nothing_goes_back_while_a_stream_captures():
    pool, backend = make()
    five = pool.allocate(2 * MiB, stream=5)     # stream 5 holds a segment: the pool asks about it
    pool.allocate(3 * MiB, stream=5).release()  # a whole free 3 MiB segment of stream 5
    backend.capturing_streams = {5}
    assert pool.empty_cache() == 0 and pool.trim(0) == 0
    assert counters(pool) == (2, 0, 5 * MiB) and backend.used(0) == 5 * MiB and (0, 5) in backend.asked
    big = pool.allocate(6 * MiB, stream=5)      # a miss adds, capturing or not
    assert counters(pool) == (3, 0, 11 * MiB) and big.size == 6 * MiB
    backend.capturing_streams = set()
    assert pool.empty_cache() == 3 * MiB        # capture over: the cache goes back
    assert counters(pool) == (3, 1, 8 * MiB)
    del five, big


def test_out_of_memory_while_capturing_keeps_the_cache_and_says_why():
    pool, backend = make(capacity=8 * MiB)
    held = pool.allocate(3 * MiB, stream=5)
    cached = pool.allocate(4 * MiB, stream=5)
    del cached                                  # 4 MiB cached: freeing it would make room
    backend.capturing_streams = {5}
    before = counters(pool)
    with pytest.raises(xpool.OutOfMemoryError, match="capturing a CUDA graph") as e:
        pool.allocate(5 * MiB, stream=5)
    assert e.value.reason == "device_capturing" and counters(pool) == before
    s = pool.stats()
    assert s.bytes_cached == 4 * MiB and s.bytes_in_use == 3 * MiB and s.oom_recoveries == 0
    backend.capturing_streams = set()
    fits = pool.allocate(5 * MiB, stream=5)     # not capturing: the ladder frees the cache and retries
    assert fits.size == 5 * MiB and pool.stats().oom_recoveries == 1
    del held


def test_the_limit_while_capturing_keeps_the_cache_and_says_why():
    pool, backend = make(limit=8 * MiB)
    cached = pool.allocate(6 * MiB, stream=5)
    del cached
    backend.capturing_streams = {5}
    with pytest.raises(xpool.OutOfMemoryError, match="the xpool limit refused .* capturing") as e:
        pool.allocate(7 * MiB, stream=5)        # too big for the cached 6 MiB: a miss, 13 MiB against 8
    assert e.value.reason == "limit_capturing"
    assert counters(pool) == (1, 0, 6 * MiB) and pool.stats().bytes_cached == 6 * MiB


def test_a_capture_holds_back_every_stream_of_its_device_and_no_other_device():
    """Nothing goes back on a device while a stream of it captures (cudaFree synchronises the whole device):
    stream 1's cache stays while stream 5, which holds a block there, captures; device 1 is free."""
    pool, backend = make()
    five = pool.allocate(2 * MiB, stream=5)     # stream 5 holds a segment on device 0: the pool asks about it
    pool.allocate(3 * MiB, stream=1).release()
    pool.allocate(3 * MiB, device=1, stream=1).release()
    backend.capturing_streams = {5}
    assert pool.empty_cache(device=0) == 0 and (0, 5) in backend.asked
    assert counters(pool) == (3, 0, 8 * MiB)
    assert pool.empty_cache(device=1) == 3 * MiB  # device 1 has no capturing stream: gives back as usual
    assert pool.stats(1).device_frees == 1 and pool.stats(0).device_frees == 0
    del five


class VouchingBackend(CapturingBackend):
    """A backend that says which streams may be asked (CupyBackend.stream_alive: a destroyed stream must not be)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.alive, self.vouched = set(), []

    def stream_alive(self, device, stream):
        self.vouched.append((device, stream))
        return stream in self.alive


def test_a_stream_the_backend_cannot_vouch_for_is_never_asked():
    """The pool holds memory for stream 5, whose handle may since have been destroyed (asking it crashed the
    driver on an H200): only the legacy and the request's streams are asked unless the backend vouches for 5."""
    backend = VouchingBackend()
    pool = Pool(backend)
    five = pool.allocate(2 * MiB, stream=5)
    pool.allocate(3 * MiB, stream=1).release()
    backend.capturing_streams = {5}
    assert pool.empty_cache() == 3 * MiB        # 5 was not asked, so its capture was not seen
    assert (0, 5) in backend.vouched and (0, 5) not in backend.asked
    assert pool.stats().device_frees == 1
    pool.allocate(3 * MiB, stream=1).release()
    backend.alive = {5}                         # now vouched for: asked, capturing, nothing goes back
    assert pool.empty_cache() == 0
    assert (0, 5) in backend.asked and pool.stats().device_frees == 1
    del five


def test_cupy_backend_vouches_only_for_streams_whose_objects_live(monkeypatch):
    """CupyBackend.stream_alive over a stand-in for CuPy: the legacy, per-thread and current streams always;
    another only while the CuPy stream object seen at a request on it lives."""
    import sys
    import types

    class Stream:
        def __init__(self, ptr):
            self.ptr = ptr

    current = {"s": Stream(0)}
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(get_current_stream=lambda device=-1: current["s"]))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    b = xpool.backends.CupyBackend.__new__(xpool.backends.CupyBackend)
    b._streams = {}
    assert b.stream_alive(0, 0) and b.stream_alive(0, 2) and not b.stream_alive(0, 0x7000)
    s = Stream(0x7000)
    current["s"] = s
    assert b.current_stream() == 0x7000 and b.stream_alive(0, 0x7000)      # current, and now seen
    current["s"] = Stream(0)
    assert b.stream_alive(0, 0x7000)                                        # seen, its object alive
    del s
    assert not b.stream_alive(0, 0x7000) and b._streams == {}              # gone: never asked again


def test_the_per_thread_stream_is_asked_by_its_handle():
    pool, backend = make()
    held = pool.allocate(2 * MiB, stream=2)      # cudaStreamPerThread: keyed per thread inside the pool
    pool.allocate(3 * MiB, stream=2).release()
    backend.capturing_streams = {2}
    assert pool.empty_cache() == 0
    assert (0, 2) in backend.asked and counters(pool)[1] == 0
    del held


def test_a_failing_capturing_query_fails_the_release_and_leaks_nothing():
    pool, backend = make()
    pool.allocate(3 * MiB, stream=5).release()
    backend.fail = RuntimeError("cudaStreamIsCapturing failed")
    with pytest.raises(RuntimeError, match="cudaStreamIsCapturing failed"):
        pool.empty_cache()
    s = pool.stats()
    assert (s.device_mallocs, s.device_frees, s.bytes_in_use, s.bytes_cached) == (1, 0, 0, 3 * MiB)
    assert backend.used(0) == 3 * MiB
    backend.fail = None
    assert pool.empty_cache() == 3 * MiB and backend.used(0) == 0


def test_a_failing_capturing_query_fails_the_ladder_and_leaks_nothing():
    pool, backend = make(capacity=8 * MiB)
    pool.allocate(3 * MiB, stream=5).release()
    backend.fail = RuntimeError("cudaStreamIsCapturing failed")
    with pytest.raises(RuntimeError, match="cudaStreamIsCapturing failed"):
        pool.allocate(6 * MiB, stream=5)         # 3 + 6 > 8: the ladder must ask before it frees the cache
    s = pool.stats()
    assert (s.device_mallocs, s.device_frees, s.bytes_in_use, s.bytes_cached) == (1, 0, 0, 3 * MiB)
    assert backend.used(0) == 3 * MiB
    backend.fail = None
    assert pool.allocate(6 * MiB, stream=5).size == 6 * MiB and pool.stats().oom_recoveries == 1


def test_a_backend_without_capturing_is_never_asked():
    pool = Pool(HostBackend())
    pool.allocate(3 * MiB).release()
    assert pool.empty_cache() == 3 * MiB         # gives back as before
    assert pool.stats().device_frees == 1


def test_a_miss_asks_nothing():
    pool, backend = make()
    pool.allocate(3 * MiB, stream=5).release()   # a miss never gives back: no question
    pool.allocate(6 * MiB, stream=5)
    pool.allocate(1000, stream=5)
    pool.allocate(1000, stream=7)
    assert backend.asked == []


KiB = 1 << 10
PER_THREAD = 2                                  # cudaStreamPerThread's handle


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


def core_counters(pool, device=0):
    s = pool._core.stats(device)
    return s["device_mallocs"], s["device_frees"], s["bytes_reserved"], s["bytes_cached"]


def assert_exact(pool, backend, device=0):
    s = pool._core.stats(device)
    assert s["bytes_pending"] == s["bytes_releasing"] == 0, s
    assert s["bytes_reserved"] == backend.used(device), (s, backend.used(device))
    assert s["device_mallocs"] - s["device_frees"] == len([1 for d, _ in backend.live().values() if d == device])


def test_the_oom_ladder_gives_nothing_back_while_another_stream_of_the_device_captures():
    backend = CaptureBackend(capacity=8 * MiB)
    pool = Pool(backend)
    pool.allocate(3 * MiB, stream=7).release()      # stream 7's whole free segment: the ladder could free it
    held = pool.allocate(3 * MiB, stream=1)
    backend.streams = {(0, 7)}
    before = core_counters(pool)
    with pytest.raises(xpool.OutOfMemoryError) as e:
        pool.allocate(4 * MiB, stream=1)            # 3 + 3 + 4 > 8: only freeing stream 7's segment makes room
    assert e.value.reason == "device_capturing"
    assert core_counters(pool) == before and backend.violations == [] and (0, 7) in backend.asked
    assert_exact(pool, backend)
    backend.streams = set()                         # the capture is over: the ladder frees and retries
    assert pool.allocate(4 * MiB, stream=1).size == 4 * MiB and core_counters(pool)[1] == 1
    del held


def test_the_limit_ladder_gives_nothing_back_while_another_stream_of_the_device_captures():
    backend = CaptureBackend()
    pool = Pool(backend, limit=8 * MiB)
    pool.allocate(3 * MiB, stream=7).release()
    held = pool.allocate(3 * MiB, stream=1)
    backend.streams = {(0, 7)}
    with pytest.raises(xpool.OutOfMemoryError) as e:
        pool.allocate(4 * MiB, stream=1)
    assert e.value.reason == "limit_capturing"
    assert core_counters(pool) == (2, 0, 6 * MiB, 3 * MiB) and backend.violations == []
    del held


def test_a_miss_gives_nothing_back_while_another_stream_of_the_device_captures():
    backend = CaptureBackend()
    pool = Pool(backend)
    held7 = pool.allocate(2 * MiB, stream=7)        # stream 7 has a segment on device 0: the pool knows it
    pool.allocate(3 * MiB, stream=1).release()      # stream 1's whole free segment
    backend.streams = {(0, 7)}
    big = pool.allocate(6 * MiB, stream=1)          # a miss only adds (the one release rule): nothing to ask
    assert core_counters(pool)[:2] == (3, 0) and backend.violations == [] and big.size == 6 * MiB
    assert backend.asked == []
    del held7, big


def test_a_global_mode_capture_elsewhere_shows_through_the_legacy_stream():
    backend = CaptureBackend(capacity=8 * MiB)
    pool = Pool(backend)
    held = pool.allocate(3 * MiB, stream=1)
    pool.allocate(2 * MiB, stream=1).release()      # a whole free 2 MiB segment the ladder could give back
    backend.global_mode = {0}                       # some stream of device 0 captures in global mode
    with pytest.raises(xpool.OutOfMemoryError) as e:
        pool.allocate(4 * MiB, stream=1)
    assert e.value.reason == "device_capturing" and (0, 0) in backend.asked and backend.violations == []
    del held


def test_empty_cache_skips_a_device_while_one_of_its_streams_captures():
    backend = CaptureBackend()
    pool = Pool(backend)
    pool.allocate(3 * MiB, device=0, stream=7).release()
    pool.allocate(3 * MiB, device=1, stream=7).release()
    backend.streams = {(0, 7)}
    assert pool.empty_cache() == 3 * MiB            # device 1's only
    assert core_counters(pool, 0) == (1, 0, 3 * MiB, 3 * MiB) and backend.violations == []
    assert pool.trim(0) == 0 and pool._core.release(0, stream=7) == 0
    backend.streams = set()
    assert pool.empty_cache() == 3 * MiB and backend.live() == {}


def test_another_live_threads_per_thread_stream_counts_as_possibly_capturing():
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


def test_a_segment_whose_poisoning_failed_stays_cached_while_its_stream_captures():
    backend = CaptureBackend()
    pool = Pool(backend, debug="raise")
    backend.streams = {(0, 5)}
    backend.fail_fill = RuntimeError("memset failed")
    with pytest.raises(RuntimeError, match="memset failed"):
        pool.allocate(1000, stream=5)               # a new 2 MiB segment; poisoning its rest fails
    assert backend.violations == [] and core_counters(pool) == (1, 0, 2 * MiB, 2 * MiB)
    assert_exact(pool, backend)
    backend.fail_fill, backend.streams = None, set()
    a = pool.allocate(1000, stream=5)               # the cached segment serves, unpoisoned (nothing to check)
    assert core_counters(pool)[0] == 1 and a.size == 1536   # 1000 B and the 64 B canary, to 512 B
    del a
    pool.check()


def test_seed_a_new_block_whose_canary_failed_stays_cached_while_its_stream_captures():
    backend = CaptureBackend()
    pool = Pool(backend, scheme="seed", debug="raise")
    backend.streams = {(0, 5)}
    backend.fail_fill = RuntimeError("memset failed")
    with pytest.raises(RuntimeError, match="memset failed"):
        pool.allocate(1000, stream=5)
    assert backend.violations == [] and core_counters(pool)[:2] == (1, 0)
    assert_exact(pool, backend)


def test_seed_a_freed_block_whose_poisoning_failed_stays_cached_while_its_stream_captures(monkeypatch):
    reports = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: reports.append(u.exc_value))
    backend = CaptureBackend()
    pool = Pool(backend, scheme="seed", debug="raise")
    a = pool.allocate(1000, stream=5)
    backend.streams = {(0, 5)}
    backend.fail_fill = RuntimeError("memset failed")
    with pytest.raises(RuntimeError, match="memset failed"):
        a.release()
    assert backend.violations == [] and core_counters(pool)[:2] == (1, 0)
    assert pool._core.stats(0)["blocks_cached"] == 1
    assert_exact(pool, backend)
