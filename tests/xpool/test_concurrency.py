"""Concurrency: many threads over several host devices, cross-thread releases, the collector, and bounded soaks
run in CI (a per-device limit, injected malloc and free failures, concurrent empty_cache / trim / check / stats /
set_limit; capture states and per-thread streams on the PyTorch and CuPy C paths; scheme expandable's pages).

After every run: the pool's counters equal the backend's own accounting, no device ever held more than its
limit (the backend's high-water mark), nothing leaked, and debug mode reported nothing.
"""
import contextlib
import ctypes
import gc
import os
import queue
import random
import subprocess
import sys
import sysconfig
import threading
import time

import pytest

import xpool
import xpool_twin.testing
from faults import FaultyBackend, InjectedFault, soak_ops
from xpool import Pool
from xpool_twin import HostBackend, TwinBackend


KiB, MiB = 1 << 10, 1 << 20
DEVICES = 4
LIMIT = 24 * MiB                    # per device; set_limit moves it within [LIMIT / 2, LIMIT]
EXPECTED = (xpool.OutOfMemoryError, InjectedFault)



def run_threads(workers, background, stop):
    """Start every thread; once the workers are done, set `stop` and wait for the background threads."""
    for t in workers + background:
        t.start()
    for t in workers:
        t.join()
    stop.set()
    for t in background:
        t.join()

def random_size(rng: random.Random) -> int:
    """Mostly small, some up to 1 MiB, a few large (several size classes per doubling)."""
    r = rng.random()
    if r < 0.6:
        return rng.randrange(0, 16 * KiB)
    if r < 0.9:
        return rng.randrange(16 * KiB, 1 * MiB)
    return rng.randrange(1 * MiB, 5 * MiB)


def soak(seed: int, workers: int, ops: int, debug):
    backend = FaultyBackend(n_devices=DEVICES, malloc_oom=0.02, malloc_error=0.01, free_error=0.1,
                            seed=seed)
    pool = Pool(backend, scheme="seed", classes_per_doubling=2, limit=LIMIT, debug=debug)
    menu = [random_size(random.Random(seed * 7 + j)) for j in range(24)]   # sizes recur, as in training
    errors, stop = [], threading.Event()
    outcomes = {"allocated": 0, "refused": 0}
    start = threading.Barrier(workers + 3)

    def worker(i):
        rng = random.Random(seed * 1000 + i)
        held = []                                   # (allocation, tag)
        start.wait()
        try:
            for _ in range(ops):
                if held and (rng.random() < 0.45 or len(held) > 12):
                    a, tag = held.pop(rng.randrange(len(held)))
                    if ctypes.string_at(a.ptr, a.requested) != bytes([tag]) * a.requested:
                        errors.append(f"block 0x{a.ptr:x} on device {a.device} was overwritten")
                    a.release()
                    continue
                try:
                    n = rng.choice(menu) if rng.random() < 0.8 else random_size(rng)
                    a = pool.allocate(n, device=rng.randrange(DEVICES),
                                      stream=rng.randrange(2))
                except EXPECTED:
                    outcomes["refused"] += 1
                    continue
                tag = rng.randrange(1, 255)
                ctypes.memset(a.ptr, tag, a.requested)   # within the request: debug canaries stay intact
                held.append((a, tag))
                outcomes["allocated"] += 1
        except Exception as e:  # noqa: BLE001 - surfaced below
            errors.append(f"worker {i}: {e!r}")
        finally:
            held.clear()

    def background(name, action):                # a failed free, passed on by empty_cache / trim, is expected
        admin_loop(name, action, seed, start, stop, errors, lambda e: isinstance(e, InjectedFault))

    def release(rng):
        release_some(pool, rng)

    def inspect(rng):
        pool.check()                                 # debug mode: must never report a false corruption
        pool.stats()
        pool.live_blocks(device=rng.randrange(DEVICES))

    def limit(rng):
        pool.set_limit(size=rng.randrange(LIMIT // 2, LIMIT + 1), device=rng.randrange(DEVICES))

    run_threads([threading.Thread(target=worker, args=(i,)) for i in range(workers)],
                [threading.Thread(target=background, args=(name, fn))
                 for name, fn in (("release", release), ("inspect", inspect), ("limit", limit))], stop)
    return pool, backend, errors, outcomes


def assert_exact(pool, backend):
    """The pool's counters against the backend's own accounting, device by device."""
    mallocs = frees = 0
    for d in range(DEVICES):
        st = pool._core.stats(d)
        assert st["bytes_in_use"] == st["blocks_in_use"] == st["bytes_requested"] == 0, st
        assert st["bytes_pending"] == st["bytes_releasing"] == 0, st
        assert st["bytes_reserved"] == st["bytes_cached"] == backend.used(d), (d, st, backend.used(d))
        assert st["device_mallocs"] - st["device_frees"] == st["blocks_cached"], st
        assert st["requests"] == st["hits"] + st["misses"], st
        assert backend.high_water[d] <= LIMIT, (d, backend.high_water[d])
        assert st["peak_bytes_reserved"] <= LIMIT, st
        mallocs += st["device_mallocs"]
        frees += st["device_frees"]
    assert (mallocs, frees) == (backend.mallocs, backend.frees)


def admin_loop(name, action, seed, start, stop, errors, expected):
    """An admin thread of a soak: `action(rng)` every 2 ms (the workers' cache is emptied often, not always) from
    `start` until `stop`; an exception `expected(e)` accepts (an injected fault) is passed over, any other is
    recorded in `errors` and ends the loop."""
    rng = random.Random(f"{seed}-{name}")
    start.wait()
    while not stop.is_set():
        try:
            action(rng)
        except Exception as e:  # noqa: BLE001 - surfaced by the test
            if not expected(e):
                errors.append(f"{name}: {e!r}")
                return
        time.sleep(0.002)


def release_some(pool, rng):
    """Half the time the whole cache, else a trim of one device down to a random size."""
    if rng.random() < 0.5:
        pool.empty_cache()
    else:
        pool.trim(rng.randrange(LIMIT), device=rng.randrange(DEVICES))


@contextlib.contextmanager
def stressed():
    """Many more thread interleavings per operation, and a gc.collect() (the OOM ladder's) that scans only the
    soak's own objects."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(5e-5)
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        sys.setswitchinterval(interval)


@pytest.mark.slow
@pytest.mark.parametrize("seed, workers, ops, debug", [
    (1, 12, 5000, False),
    (2, 12, 5000, False),
    (3, 8, 1000, "raise"),
])
def test_soak(seed, workers, ops, debug):
    with stressed():
        pool, backend, errors, outcomes = soak(seed, workers, soak_ops(ops), debug)
    assert errors == []
    assert_exact(pool, backend)
    # the run did meet what it is meant to survive
    assert outcomes["allocated"] > 0 and outcomes["refused"] > 0
    assert min(backend.injected.values()) > 0, backend.injected
    if debug:
        assert pool._hook.found == []
    # nothing leaked: with frees working again, everything goes back
    backend.free_error = 0.0
    pool.empty_cache()
    assert backend.live() == {} and all(backend.used(d) == 0 for d in range(DEVICES))
    assert_exact(pool, backend)


# ------------------------------------------------------------------ capture states, per-thread streams,
# the PyTorch and CuPy C paths

PER_THREAD = 2                       # cudaStreamPerThread: another stream in each thread
STREAMS = (0, 1, PER_THREAD)
TORCH_ERRORS = ("OutOfMemoryError: ", "InjectedFault: ")   # what xpool_torch_last_error() may say in the soak


class Gate:
    """Pool operations run together; a capture begins or ends alone, between them (a readers-writer lock that
    prefers the writer).  So the capture state a pool call sees when it asks is the one in force at its frees,
    and a free during a capture is the pool's fault, never a race of the test's making."""

    def __init__(self):
        self._cv = threading.Condition()
        self._ops = self._writers = 0
        self._changing = False

    @contextlib.contextmanager
    def op(self):
        with self._cv:
            while self._changing or self._writers:
                self._cv.wait()
            self._ops += 1
        try:
            yield
        finally:
            with self._cv:
                self._ops -= 1
                self._cv.notify_all()

    @contextlib.contextmanager
    def change(self):
        with self._cv:
            self._writers += 1
            while self._changing or self._ops:
                self._cv.wait()
            self._writers -= 1
            self._changing = True
        try:
            yield
        finally:
            with self._cv:
                self._changing = False
                self._cv.notify_all()


class CapturingFaultyBackend(FaultyBackend):
    """FaultyBackend that says which streams capture, as CupyBackend.capturing does on a GPU: explicit streams,
    a global-mode capture seen through the legacy stream, and each thread's own per-thread stream, which only
    that thread can ask about.  A free on a device while any capture of it is on is a violation."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.streams, self.global_mode = set(), set()   # {(device, handle)}, {device}
        self.own = {}                                   # thread ident -> devices its per-thread stream captures
        self._local = threading.local()
        self.violations = []

    def capturing(self, device, stream):
        if stream == PER_THREAD:
            return device in self.own.get(threading.get_ident(), ())
        return (device, stream) in self.streams or (stream == 0 and device in self.global_mode)

    def capture_on(self, device):
        return (any(d == device for d, _ in self.streams) or device in self.global_mode
                or any(device in ds for ds in self.own.values()))

    def free(self, device, ptr, nbytes):
        if self.capture_on(device):
            self.violations.append(f"free of {nbytes} B on device {device} during a capture")
        super().free(device, ptr, nbytes)


def _torch_entry_points():
    lib = ctypes.CDLL(xpool._core.__file__)
    malloc, free, last = lib.xpool_torch_try_malloc, lib.xpool_torch_free, lib.xpool_torch_last_error
    malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    free.restype, free.argtypes = None, [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    last.restype, last.argtypes = ctypes.c_char_p, []
    return malloc, free, last


def soak_paths(seed: int, workers: int, ops: int, scheme: str, debug):
    """Workers on the Python, PyTorch (no GIL) and CuPy C paths, on three streams of four devices, while captures
    begin and end (explicit streams, global mode, the workers' own per-thread streams) and short-lived threads
    use their per-thread streams; with the soak's injected faults, limit changes and concurrent releases."""
    cupy_memory = pytest.importorskip("cupy.cuda.memory")
    backend = CapturingFaultyBackend(n_devices=DEVICES, malloc_oom=0.03, malloc_error=0.02, free_error=0.1,
                                     seed=seed)
    current = threading.local()                     # the stream CuPy's hook sees, per thread
    lookup = ctypes.CFUNCTYPE(ctypes.c_ssize_t, ctypes.c_int)(lambda device: getattr(current, "stream", 0))
    pool = xpool_twin.testing.pool_with_stream_lookup(backend, lookup, scheme=scheme, limit=LIMIT, debug=debug)
    pool._core.bind_torch()
    param, malloc_fn, free_fn = xpool_twin.testing.cfunctions(pool)
    t_malloc, t_free, t_last = _torch_entry_points()
    menu = [random_size(random.Random(seed * 7 + j)) for j in range(24)]
    gate, stop = Gate(), threading.Event()
    errors, keys, lock = [], {}, threading.Lock()   # keys: thread name -> its per-thread key, as the pool keyed it
    counts = dict(allocated=0, refused=0, held_back=0, torch=0, cupy=0, per_thread=0, captures=0, own_captures=0,
                  short_lived=0)
    start = threading.Barrier(workers + 3)

    def count(name, n=1):
        with lock:
            counts[name] += n

    def note_key(name, device, ptr):
        """The per-thread key the pool gave this thread, from its first per-thread block; one per thread."""
        if name in keys:
            return
        key = next((b["stream"] for b in pool.live_blocks(device) if b["ptr"] == ptr), None)
        with lock:
            keys[name] = key

    def take(rng, name):
        """One block on a random path, device and stream; (free function, ptr, nbytes, device) or None."""
        n = rng.choice(menu) if rng.random() < 0.6 else random_size(rng)
        device, stream, path = rng.randrange(DEVICES), rng.choice(STREAMS), rng.random()
        if stream == PER_THREAD and name.startswith("worker"):
            # the long-lived threads' per-thread streams stay on devices 0 and 1: while such a thread lives, its
            # stream counts as capturing there (no other thread can ask it), so nothing goes back on them but
            # by that thread; on devices 2 and 3 only the short-lived threads use theirs
            device = device % 2
        if path < 0.3:                               # PyTorch's entry points, without the GIL
            ptr = t_malloc(n, device, stream)
            if ptr is None:
                text = t_last().decode()
                if not text.startswith(TORCH_ERRORS):
                    errors.append(f"{name}: torch path: {text}")
                count("refused")
                return None
            count("torch")
            release = lambda: t_free(ptr, n, device, stream)                             # noqa: E731
        elif path < 0.5:                             # CuPy's C hook (CFunctionAllocator)
            current.stream = stream
            try:
                mem = cupy_memory.CFunctionAllocatorMemory(n, param, malloc_fn, free_fn, device)
            except EXPECTED:
                count("refused")
                return None
            ptr, holder = mem.ptr, [mem]
            del mem
            count("cupy")
            release = holder.clear                  # CuPy frees the block when its memory object dies
        else:
            try:
                a = pool.allocate(n, device=device, stream=stream)
            except xpool.OutOfMemoryError as e:
                count("refused")
                count("held_back", e.reason.endswith("_capturing"))
                return None
            except InjectedFault:
                count("refused")
                return None
            ptr = a.ptr
            release = a.release
        if stream == PER_THREAD:
            count("per_thread")
            note_key(name, device, ptr)
        count("allocated")
        return release, ptr, n, device, stream

    def own_capture(rng, held, name):
        """This thread's per-thread stream begins (or ends) a capture, on a device where it holds a block on it."""
        me = threading.get_ident()
        with gate.change():
            if me in backend.own:
                del backend.own[me]
                return
            devices = sorted({h[3] for h in held if h[4] == PER_THREAD})
            if devices:
                backend.own[me] = {rng.choice(devices)}
                count("own_captures")

    def worker(i):
        rng = random.Random(seed * 1000 + i)
        name = f"worker-{i}"
        held = []                                   # (release, ptr, nbytes, device, stream, tag)
        start.wait()
        try:
            for _ in range(ops):
                if rng.random() < 0.01:
                    own_capture(rng, held, name)
                    continue
                with gate.op():
                    if held and (rng.random() < 0.45 or len(held) > 12):
                        release, ptr, n, device, stream, tag = held.pop(rng.randrange(len(held)))
                        if ctypes.string_at(ptr, n) != bytes([tag]) * n:
                            errors.append(f"block 0x{ptr:x} on device {device} was overwritten")
                        release()
                        continue
                    got = take(rng, name)
                    if got:
                        tag = rng.randrange(1, 255)
                        ctypes.memset(got[1], tag, got[2])
                        held.append(got + (tag,))
        except Exception as e:  # noqa: BLE001 - surfaced below
            errors.append(f"{name}: {e!r}")
        finally:
            with gate.change():
                backend.own.pop(threading.get_ident(), None)
            with gate.op():
                for release, *_ in held:
                    release()
            held.clear()

    def short_lived(k):
        """A thread that lives for a few blocks on its per-thread stream, then ends (its key must never come back)."""
        rng = random.Random(f"{seed}-short-{k}")
        name = f"short-{k}"
        with gate.op():
            got = [take(rng, name) for _ in range(3)]
            for g in got:
                if g:
                    g[0]()

    def spawner():
        start.wait()
        k = 0
        while not stop.is_set():
            t = threading.Thread(target=short_lived, args=(k,), name=f"short-{k}")
            t.start()
            t.join()
            k += 1
        count("short_lived", k)

    def captures():
        """Explicit-stream and global-mode captures begin and end between operations."""
        rng = random.Random(f"{seed}-captures")
        start.wait()
        while not stop.is_set():
            with gate.change():
                backend.streams, backend.global_mode = set(), set()
                r = rng.random()
                if r < 0.4:                          # a stream that holds a block of the pool captures
                    d = rng.randrange(DEVICES)
                    streams = sorted({b["stream"] for b in pool.live_blocks(d) if b["stream"] >= 0})
                    if streams:
                        backend.streams = {(d, rng.choice(streams))}
                        count("captures")
                elif r < 0.55:                       # some stream of a device captures in global mode
                    backend.global_mode = {rng.randrange(DEVICES)}
                    count("captures")
            time.sleep(0.003)
        with gate.change():
            backend.streams, backend.global_mode = set(), set()

    def background():
        rng = random.Random(f"{seed}-background")
        start.wait()
        while not stop.is_set():
            try:
                with gate.op():
                    r = rng.random()
                    if r < 0.3:
                        pool.empty_cache()
                    elif r < 0.5:
                        pool.trim(rng.randrange(LIMIT), device=rng.randrange(DEVICES))
                    elif r < 0.7:
                        pool.set_limit(size=rng.randrange(LIMIT // 2, LIMIT + 1), device=rng.randrange(DEVICES))
                    else:
                        pool.check()
                        pool.stats()
            except InjectedFault:
                pass
            except Exception as e:  # noqa: BLE001 - surfaced below
                errors.append(f"background: {e!r}")
                return
            time.sleep(0.002)

    run_threads([threading.Thread(target=worker, args=(i,), name=f"worker-{i}") for i in range(workers)],
                [threading.Thread(target=fn) for fn in (spawner, captures, background)], stop)
    return pool, backend, errors, counts, keys


@pytest.mark.slow
@pytest.mark.parametrize("seed, workers, ops, scheme, debug", [
    (4, 10, 3000, "segments", False),
    (5, 10, 3000, "seed", False),
    (6, 6, 1500, "segments", "raise"),
])
def test_soak_capture_per_thread_streams_and_torch(seed, workers, ops, scheme, debug):
    with stressed():
        pool, backend, errors, counts, keys = soak_paths(seed, workers, soak_ops(ops), scheme, debug)
    assert errors == []
    assert backend.violations == []                  # nothing went back to a device while one of its streams captured
    assert_exact(pool, backend)
    # every thread got its own per-thread key, never one of a thread that had ended
    assert None not in keys.values() and all(k < 0 for k in keys.values()), keys
    assert len(set(keys.values())) == len(keys), "a per-thread key was handed to two threads"
    # the run met what it is meant to survive
    for name in ("allocated", "refused", "held_back", "torch", "cupy", "per_thread", "captures", "own_captures"):
        assert counts[name] > 0, counts
    assert counts["short_lived"] >= 10, counts
    assert min(backend.injected.values()) > 0, backend.injected
    if debug:
        assert pool._hook.found == []
    backend.free_error = 0.0
    # every thread has ended and no capture is on: all goes back. A thread's per-thread key counts as ended once its
    # OS thread has run its exit destructors, a moment after Thread.join() returns (it waits for Python's thread
    # state only), so the last threads' memory may be held back for that moment: wait for it, boundedly.
    deadline = time.monotonic() + 5
    while True:
        pool.empty_cache()
        if backend.live() == {} or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert backend.live() == {} and all(backend.used(d) == 0 for d in range(DEVICES))
    assert_exact(pool, backend)


# ------------------------------------------------------------------ scheme expandable: the host twin's
# pages under the same storm, on the Python and PyTorch (no GIL) paths and three streams (the workers' per-thread
# streams among them, which hold back other threads' unmaps on their devices while the workers live), with map,
# unmap and reserve faults and a device that captures throughout

def soak_expandable(seed: int, workers: int, ops: int, debug, capturing_device):
    backend = TwinBackend(capacity=2 * LIMIT, n_devices=DEVICES, granularity=64 * KiB)
    twin = backend.twin
    pool = Pool(backend, scheme="expandable", limit=LIMIT, debug=debug)
    pool._core.bind_torch()
    t_malloc, t_free, t_last = _torch_entry_points()
    if capturing_device is not None:
        twin.set_capturing(capturing_device, True)     # nothing may be unmapped there, for the whole run
    # ranges are reserved mostly at the start: a reserve fault the faults thread arms later may find no reserve
    # left to fail (a CI run did), so the first one is armed before the workers start
    twin.fail_reserves(1)
    menu = [random_size(random.Random(seed * 7 + j)) for j in range(24)]
    errors, stop, most = [], threading.Event(), [0] * DEVICES
    outcomes = {"allocated": 0, "refused": 0, "torch": 0}
    start = threading.Barrier(workers + 4)

    def refused(message: str) -> bool:
        return message.startswith(("OutOfMemoryError", "RuntimeError: xpool (scheme expandable")) or \
            "injected" in message

    def worker(i):
        rng = random.Random(seed * 1000 + i)
        held = []                                        # (ptr, nbytes, device, stream, tag, allocation or None)
        start.wait()
        try:
            for _ in range(ops):
                if held and (rng.random() < 0.45 or len(held) > 12):
                    ptr, n, d, s, tag, a = held.pop(rng.randrange(len(held)))
                    if ctypes.string_at(ptr, n) != bytes([tag]) * n:
                        errors.append(f"block 0x{ptr:x} on device {d} was overwritten")
                    if a is None:
                        t_free(ptr, n, d, s)
                    else:
                        a.release()
                    continue
                n = rng.choice(menu) if rng.random() < 0.8 else random_size(rng)
                d, s = rng.randrange(DEVICES), rng.choice(STREAMS)   # PER_THREAD: keyed per thread on both paths
                if s == PER_THREAD:
                    d %= 2   # while a worker lives, its per-thread stream holds back unmaps of other threads on
                    #          its devices (no other thread can ask it): devices 2 and 3 stay free of them
                if rng.random() < 0.4:                   # PyTorch's path: no GIL on hits, frees and misses
                    ptr = t_malloc(n, d, s)
                    if ptr is None:
                        why = t_last().decode()
                        if not refused(why):
                            errors.append(f"torch path: {why}")
                        outcomes["refused"] += 1
                        continue
                    a = None
                    outcomes["torch"] += 1
                else:
                    try:
                        a = pool.allocate(n, device=d, stream=s)
                    except (xpool.OutOfMemoryError, RuntimeError) as e:
                        if not refused(f"{type(e).__name__}: {e}"):
                            raise
                        outcomes["refused"] += 1
                        continue
                    ptr = a.ptr
                tag = rng.randrange(1, 255)
                ctypes.memset(ptr, tag, n)
                held.append((ptr, n, d, s, tag, a))
                outcomes["allocated"] += 1
        except Exception as e:  # noqa: BLE001 - surfaced below
            errors.append(f"worker {i}: {e!r}")
        finally:
            for ptr, n, d, s, _, a in held:
                if a is None:
                    t_free(ptr, n, d, s)
            held.clear()

    def background(name, action):                # a failed unmap, passed on by empty_cache / trim, is expected
        admin_loop(name, action, seed, start, stop, errors,
                   lambda e: isinstance(e, RuntimeError) and "injected" in str(e))

    def release(rng):
        release_some(pool, rng)

    def inspect(rng):
        pool.check()
        pool.stats()
        for d in range(DEVICES):
            most[d] = max(most[d], twin.mapped_bytes(d))

    def limit(rng):
        pool.set_limit(size=rng.randrange(LIMIT // 2, LIMIT + 1), device=rng.randrange(DEVICES))

    def faults(rng):
        r = rng.random()
        if r < 0.35:
            twin.fail_maps(count=1, kind=rng.choice(["oom", "error"]), after_pages=rng.randrange(3))
        elif r < 0.6:
            twin.fail_unmaps(count=1, after_pages=rng.randrange(2))
        elif r < 0.85:
            twin.fail_reserves(1)
        time.sleep(0.01)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(workers)]
    threads += [threading.Thread(target=background, args=(name, fn)) for name, fn in
                (("release", release), ("inspect", inspect), ("limit", limit), ("faults", faults))]
    for t in threads:
        t.start()
    for t in threads[:workers]:
        t.join()
    stop.set()
    for t in threads[workers:]:
        t.join()
    return pool, twin, errors, outcomes, most


def assert_twin(pool, twin):
    """The pool's counters against the twin's pages, device by device, and its calls."""
    maps = unmaps = 0
    for d in range(DEVICES):
        st = pool._core.stats(d)
        assert st["bytes_in_use"] == st["blocks_in_use"] == st["bytes_requested"] == 0, st
        assert st["bytes_pending"] == st["bytes_releasing"] == 0, st
        assert st["bytes_reserved"] == st["bytes_cached"] == twin.mapped_bytes(d), (d, st, twin.mapped_bytes(d))
        assert st["requests"] == st["hits"] + st["misses"], st
        assert st["peak_bytes_reserved"] <= LIMIT, st
        assert st["device_mallocs"] == st["device_frees"] == 0, st
        maps += st["device_maps"]
        unmaps += st["device_unmaps"]
    c = twin.counters()
    # device_unmaps counts every unmap call that unmapped pages, a failed call's prefix too (the twin counts such a
    # call among its unmap_failures)
    assert maps == c["maps"] and c["unmaps"] <= unmaps <= c["unmaps"] + c["unmap_failures"], (maps, unmaps, c)
    assert c["unmaps_while_capturing"] == 0, c


@pytest.mark.slow
@pytest.mark.parametrize("seed, workers, ops, debug, capturing_device", [
    (11, 10, 3000, False, None),
    (12, 10, 3000, False, 2),
    (13, 6, 800, "raise", 3),
])
def test_soak_expandable(seed, workers, ops, debug, capturing_device):
    with stressed():
        pool, twin, errors, outcomes, most = soak_expandable(seed, workers, soak_ops(ops), debug, capturing_device)
    assert errors == []
    assert_twin(pool, twin)
    assert outcomes["allocated"] > 0 and outcomes["refused"] > 0 and outcomes["torch"] > 0
    assert max(most) <= LIMIT and min(most) > 0
    c = twin.counters()
    assert min(c["map_failures"], c["unmap_failures"], c["reserve_failures"]) > 0, c
    if debug:
        assert pool._hook.found == []
    for d in range(DEVICES):
        twin.set_capturing(d, False)
    twin.fail_maps(count=0)
    twin.fail_unmaps(count=0)
    twin.fail_reserves(0)
    pool.empty_cache()                               # every worker has ended, no capture is on: all goes back
    assert twin.pages() == [] and twin.ranges() == []
    assert_twin(pool, twin)


P = 1 << 16


def expandable(**kw):
    backend = TwinBackend(n_devices=1, granularity=P)
    return Pool(backend, scheme="expandable", **kw), backend


class Cycle:
    """Holds a block in a reference cycle: only the collector frees it."""

    def __init__(self, block):
        self.block, self.me = block, self


@pytest.mark.parametrize("scheme", ["expandable", "segments"])
def test_threads_racing_frees_misses_and_the_collector_see_no_spurious_error(scheme, frozen_gc):
    """Four threads on one stream allocate and free blocks of up to two pages, some left in reference cycles (a
    thread collects once it has left four), while a fifth collects garbage, under a limit above the most they can
    hold at once (each thread two blocks, four in cycles and one in flight, each on pages, or in a 2 MiB small
    segment, of its own): no error of any kind may reach them (a spurious RuntimeError or OutOfMemoryError before),
    and the counters stay exact."""
    backend = TwinBackend(n_devices=1, granularity=P)
    limit = 4 * 7 * 3 * P + 16 * P if scheme == "expandable" else 4 * 7 * (2 << 20) + (8 << 20)
    pool = Pool(backend, scheme=scheme, limit=limit)
    errors, stop = [], threading.Event()

    def worker(seed):
        rng = random.Random(seed)
        held, cycles = [], 0
        try:
            for _ in range(800):
                if len(held) >= 2 or (held and rng.random() < 0.5):
                    b = held.pop(rng.randrange(len(held)))
                    if rng.random() < 0.3:
                        Cycle(b)                      # garbage now, freed by a collection
                        cycles += 1
                    del b
                    if cycles == 4:
                        gc.collect()
                        cycles = 0
                else:
                    held.append(pool.allocate(rng.choice([512, P // 3, P, P + 512, 2 * P]), 0, 0))
        except Exception as e:                        # noqa: BLE001 - every error is the test's failure
            errors.append(repr(e))

    def collector():
        while not stop.wait(0.001):
            gc.collect()

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    c = threading.Thread(target=collector)
    c.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    c.join()
    gc.collect()
    assert errors == []
    s = pool.stats()
    assert s.blocks_in_use == 0 and s.bytes_in_use == 0 and s.bytes_requested == 0
    assert s.bytes_reserved <= limit
    pool.empty_cache()
    assert pool.stats().bytes_reserved == 0 and backend.used(0) == 0
    if scheme == "expandable":
        assert backend.twin.mapped_bytes(0) == 0


# code read: the GIL.  The core declares Py_MOD_GIL_USED; this guards against declaring otherwise
# without making it safe.
@pytest.mark.usefixtures("seed_scheme")
@pytest.mark.skipif(not sysconfig.get_config_var("Py_GIL_DISABLED"), reason="free-threaded CPython only")
def test_free_threaded_python_keeps_the_gil_for_the_core():
    from xpool import _core
    # the extension alone: numpy or CuPy, imported by the package, could turn the GIL on themselves
    code = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('xpool._core', "
            f"{_core.__file__!r}); spec.loader.exec_module(importlib.util.module_from_spec(spec)); "
            "print(sys._is_gil_enabled())")
    env = {k: v for k, v in os.environ.items() if k != "PYTHON_GIL"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.strip() == "True"


STRESS_THREADS, STRESS_DEVICES, STRESS_OPS = 8, 3, 1500


def test_threads_with_cross_thread_release():
    backend = HostBackend(n_devices=STRESS_DEVICES)
    pool = Pool(backend, scheme="seed", classes_per_doubling=4)
    handoff = queue.Queue()            # blocks whose last reference dies on another thread
    barrier = threading.Barrier(STRESS_THREADS)
    errors = []

    def fill(a, tag):
        ctypes.memset(a.ptr, tag, a.requested)

    def intact(a, tag):
        return ctypes.string_at(a.ptr, a.requested) == bytes([tag]) * a.requested

    def worker(seed):
        rng = random.Random(seed)
        backend.set_device(seed % STRESS_DEVICES)
        mine = []
        barrier.wait()
        try:
            for _ in range(STRESS_OPS):
                r = rng.random()
                if r < 0.5 or not mine:
                    n = rng.choice([rng.randrange(0, 4096), rng.randrange(4096, 300_000),
                                    rng.randrange(1 << 20, 3 << 20)])
                    a = pool.allocate(n, device=rng.randrange(STRESS_DEVICES), stream=rng.randrange(2))
                    tag = rng.randrange(1, 255)
                    fill(a, tag)
                    mine.append((a, tag))
                elif r < 0.8:
                    a, tag = mine.pop(rng.randrange(len(mine)))
                    if not intact(a, tag):
                        errors.append(f"block 0x{a.ptr:x} overwritten")
                    a.release() if rng.random() < 0.5 else None
                    del a
                else:
                    handoff.put(mine.pop(rng.randrange(len(mine))))
                while not handoff.empty() and rng.random() < 0.5:
                    try:
                        a, tag = handoff.get_nowait()
                    except queue.Empty:
                        break
                    if not intact(a, tag):
                        errors.append(f"handed-off block 0x{a.ptr:x} overwritten")
                    del a
            for a, tag in mine:
                if not intact(a, tag):
                    errors.append(f"block 0x{a.ptr:x} overwritten at the end")
            mine.clear()
        except Exception as e:  # noqa: BLE001 - surfaced below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(STRESS_THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    while not handoff.empty():
        handoff.get_nowait()
    assert errors == []

    stats = pool.stats()
    for device in stats:
        s = stats[device]
        assert s["bytes_in_use"] == s["bytes_requested"] == s["blocks_in_use"] == 0, device
        assert s["requests"] == s["hits"] + s["misses"] and s["frees"] == s["requests"], device
        assert s["device_mallocs"] - s["device_frees"] == s["blocks_cached"], device
        assert s["bytes_reserved"] == s["bytes_cached"] == backend.used(device), device
    assert stats.device_mallocs == backend.mallocs
    pool.empty_cache()
    assert all(backend.used(d) == 0 for d in range(STRESS_DEVICES)) and backend.frees == backend.mallocs
