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
