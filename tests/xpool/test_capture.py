"""A stream being captured into a CUDA graph: the pool gives nothing back (cudaFree would end the capture).

Over host memory, with a backend that says which streams capture (CupyBackend asks cudaStreamIsCapturing); the
GPU test of the captured training step is tests/lab/test_gpu_graph.py."""
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
