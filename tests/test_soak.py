"""The bounded soak of issue #11, run in CI: many threads over several host devices under a per-device limit,
with injected malloc and free failures and concurrent empty_cache / trim / check / stats / set_limit.

After every run: the pool's counters equal the backend's own accounting, no device ever held more than its
limit (the backend's high-water mark), nothing leaked, and debug mode reported nothing.
"""
import ctypes
import gc
import random
import sys
import threading
import time

import pytest

import xpool
from faults import FaultyBackend, InjectedFault
from xpool import Pool

KiB, MiB = 1 << 10, 1 << 20
DEVICES = 4
LIMIT = 24 * MiB                    # per device; set_limit moves it within [LIMIT / 2, LIMIT]
EXPECTED = (xpool.OutOfMemoryError, InjectedFault)


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

    def background(name, action):
        rng = random.Random(f"{seed}-{name}")
        start.wait()
        while not stop.is_set():
            try:
                action(rng)
            except InjectedFault:                    # a failed free, passed on by empty_cache / trim
                pass
            except Exception as e:  # noqa: BLE001 - surfaced below
                errors.append(f"{name}: {e!r}")
                return
            time.sleep(0.002)                        # the workers' cache is emptied often, not always

    def release(rng):
        if rng.random() < 0.5:
            pool.empty_cache()
        else:
            pool.trim(rng.randrange(LIMIT), device=rng.randrange(DEVICES))

    def inspect(rng):
        pool.check()                                 # debug mode: must never report a false corruption
        pool.snapshot()
        pool.live_blocks(device=rng.randrange(DEVICES))

    def limit(rng):
        pool.set_limit(size=rng.randrange(LIMIT // 2, LIMIT + 1), device=rng.randrange(DEVICES))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(workers)]
    threads += [threading.Thread(target=background, args=(name, fn))
                for name, fn in (("release", release), ("inspect", inspect), ("limit", limit))]
    for t in threads:
        t.start()
    for t in threads[:workers]:
        t.join()
    stop.set()
    for t in threads[workers:]:
        t.join()
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


@pytest.mark.slow
@pytest.mark.parametrize("seed, workers, ops, debug", [
    (1, 12, 5000, False),
    (2, 12, 5000, False),
    (3, 8, 1000, "raise"),
])
def test_soak(seed, workers, ops, debug):
    interval = sys.getswitchinterval()
    sys.setswitchinterval(5e-5)                      # many more interleavings per operation
    gc.freeze()                                      # the OOM ladder's gc.collect() scans only the soak's objects
    try:
        pool, backend, errors, outcomes = soak(seed, workers, ops, debug)
    finally:
        gc.unfreeze()
        sys.setswitchinterval(interval)
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


# ------------------------------------------------------------------ scheme expandable (issue 22): the host twin's
# pages under the same storm, on the Python and PyTorch (no GIL) paths, with map, unmap and reserve faults and a
# device that captures throughout

def _torch_calls():
    lib = ctypes.CDLL(xpool._core.__file__)
    malloc, free, last = lib.xpool_torch_try_malloc, lib.xpool_torch_free, lib.xpool_torch_last_error
    malloc.restype, malloc.argtypes = ctypes.c_void_p, [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    free.restype, free.argtypes = None, [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    last.restype, last.argtypes = ctypes.c_char_p, []
    return malloc, free, last


def soak_expandable(seed: int, workers: int, ops: int, debug, capturing_device):
    backend = xpool.HostBackend(capacity=2 * LIMIT, n_devices=DEVICES, granularity=64 * KiB)
    twin = backend.twin
    pool = Pool(backend, scheme="expandable", limit=LIMIT, debug=debug, release_idle=8)
    pool._core.bind_torch()
    t_malloc, t_free, t_last = _torch_calls()
    if capturing_device is not None:
        twin.set_capturing(capturing_device, True)     # nothing may be unmapped there, for the whole run
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
                d, s = rng.randrange(DEVICES), rng.randrange(2)
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

    def background(name, action):
        rng = random.Random(f"{seed}-{name}")
        start.wait()
        while not stop.is_set():
            try:
                action(rng)
            except RuntimeError as e:                    # a failed unmap, passed on by empty_cache / trim
                if "injected" not in str(e):
                    errors.append(f"{name}: {e!r}")
                    return
            except Exception as e:  # noqa: BLE001 - surfaced below
                errors.append(f"{name}: {e!r}")
                return
            time.sleep(0.002)

    def release(rng):
        if rng.random() < 0.5:
            pool.empty_cache()
        else:
            pool.trim(rng.randrange(LIMIT), device=rng.randrange(DEVICES))

    def inspect(rng):
        pool.check()
        pool.snapshot()
        for d in range(DEVICES):
            most[d] = max(most[d], twin.mapped_bytes(d))

    def limit(rng):
        pool.set_limit(size=rng.randrange(LIMIT // 2, LIMIT + 1), device=rng.randrange(DEVICES))

    def faults(rng):
        r = rng.random()
        if r < 0.4:
            twin.fail_maps(count=1, kind=rng.choice(["oom", "error"]), after_pages=rng.randrange(3))
        elif r < 0.7:
            twin.fail_unmaps(count=1, after_pages=rng.randrange(2))
        elif r < 0.8:
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
    assert (maps, unmaps) == (c["maps"], c["unmaps"]) and c["unmaps_while_capturing"] == 0, c


@pytest.mark.slow
@pytest.mark.parametrize("seed, workers, ops, debug, capturing_device", [
    (11, 10, 3000, False, None),
    (12, 10, 3000, False, 2),
    (13, 6, 800, "raise", 1),
])
def test_soak_expandable(seed, workers, ops, debug, capturing_device):
    interval = sys.getswitchinterval()
    sys.setswitchinterval(5e-5)
    gc.freeze()
    try:
        pool, twin, errors, outcomes, most = soak_expandable(seed, workers, ops, debug, capturing_device)
    finally:
        gc.unfreeze()
        sys.setswitchinterval(interval)
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
    pool.empty_cache()
    assert twin.pages() == [] and twin.ranges() == []
    assert_twin(pool, twin)
