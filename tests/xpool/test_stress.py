"""Many threads, several host devices, cross-thread release, canaries: nothing overlaps, bytes reconcile."""
import ctypes
import queue
import random
import threading

from xpool import Pool
from xpool_twin import HostBackend

THREADS, DEVICES, OPS = 8, 3, 1500


def test_threads_with_cross_thread_release():
    backend = HostBackend(n_devices=DEVICES)
    pool = Pool(backend, scheme="seed", classes_per_doubling=4)
    handoff = queue.Queue()            # blocks whose last reference dies on another thread
    barrier = threading.Barrier(THREADS)
    errors = []

    def fill(a, tag):
        ctypes.memset(a.ptr, tag, a.requested)

    def intact(a, tag):
        return ctypes.string_at(a.ptr, a.requested) == bytes([tag]) * a.requested

    def worker(seed):
        rng = random.Random(seed)
        backend.set_device(seed % DEVICES)
        mine = []
        barrier.wait()
        try:
            for _ in range(OPS):
                r = rng.random()
                if r < 0.5 or not mine:
                    n = rng.choice([rng.randrange(0, 4096), rng.randrange(4096, 300_000),
                                    rng.randrange(1 << 20, 3 << 20)])
                    a = pool.allocate(n, device=rng.randrange(DEVICES), stream=rng.randrange(2))
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

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
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
    assert all(backend.used(d) == 0 for d in range(DEVICES)) and backend.frees == backend.mallocs
