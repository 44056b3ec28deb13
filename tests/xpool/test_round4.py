"""The defects an adversarial review found on the expandable path and the settings (issue #43), each held by a test
that failed before its mend: a miss that planned a 0-byte map or a spurious out-of-memory, an ended thread counted as
capturing, debug mode missing a write after free, a partly failed unmap, bad input, a lazy import at exit, the
limit's error; and a threaded soak over the same paths. Over the tests' host twin, pages of 64 KiB."""
import ctypes
import gc
import random
import subprocess
import sys
import textwrap
import threading

import pytest

import xpool
import xpool_twin.testing
from xpool import CorruptionError, OutOfMemoryError, Pool, Settings
from xpool_twin import TwinBackend

P = 1 << 16
PER_THREAD = 2                  # cudaStreamPerThread's handle


def expandable(**kw):
    backend = TwinBackend(n_devices=1, granularity=P)
    return Pool(backend, scheme="expandable", **kw), backend


class Cycle:
    """Holds a block in a reference cycle: only the collector frees it."""

    def __init__(self, block):
        self.block, self.me = block, self


# --- 1. a miss whose free neighbour already holds it

def _cycle_beside_a_run(pool):
    """Page 0: a block kept and a block held only by a reference cycle (its halves); page 1 unmapped by a trim, a run
    right after the held block.  The held block's pointer."""
    keep, held, last = pool.allocate(P // 2, 0, 0), pool.allocate(P // 2, 0, 0), pool.allocate(P, 0, 0)
    ptr = held.ptr
    del last
    assert pool.trim(0) == P
    Cycle(held)
    return keep, ptr


def test_a_block_the_ladders_collection_frees_serves_the_retried_request_with_no_map():
    """The limit refuses the page a request would map; the ladder collects garbage and retries: the block the cycle
    held (half a page, so no release unmapped it) holds the request and is taken, nothing mapped (before: a 0-byte map
    was planned, RuntimeError)."""
    pool, backend = expandable()
    gc.disable()
    try:
        keep, ptr = _cycle_beside_a_run(pool)
        pool.set_limit(P)
        maps = pool.stats().device_maps
        got = pool.allocate(P // 2, 0, 0)
    finally:
        gc.enable()
    s = pool.stats()
    assert got.ptr == ptr and s.device_maps == maps and s.oom_recoveries == 1 and s.oom_errors == 0
    assert s.bytes_in_use == P and s.bytes_reserved == P == backend.twin.mapped_bytes(0)
    del keep, got


def test_a_miss_joins_the_freed_block_before_a_run_with_the_pages_it_lacks():
    pool, backend = expandable()
    gc.disable()
    try:
        keep, ptr = _cycle_beside_a_run(pool)
    finally:
        gc.enable()
    gc.collect()
    maps = pool.stats().device_maps
    got = pool.allocate(P, 0, 0)                      # the freed half page, and the half of a new page it lacks
    s = pool.stats()
    assert got.ptr == ptr and s.device_maps == maps + 1 and s.bytes_reserved == 2 * P == backend.twin.mapped_bytes(0)
    del keep, got
    assert pool.empty_cache() == 2 * P and backend.twin.mapped_bytes(0) == 0


# --- 2. an ended thread's per-thread stream

class CaptureAwareTwin(TwinBackend):
    """The host twin with the backend's capture query (scheme segments asks it): nothing captures."""

    def capturing(self, device: int, stream: int) -> bool:
        return False


@pytest.mark.parametrize("scheme", ["expandable", "segments"])
def test_a_joined_threads_per_thread_stream_no_longer_holds_anything_back(scheme):
    """Thread.join() returns after the thread's Python state is cleared, which ends its stream key: an empty_cache()
    right after the join gives the thread's memory back, every time (before: 1-26 of 30 kept it)."""
    pool = Pool(CaptureAwareTwin(n_devices=1, granularity=P), scheme=scheme)
    for _ in range(30):
        def work():
            pool.allocate(3 * P, 0, PER_THREAD).release()
        t = threading.Thread(target=work)
        t.start()
        t.join()
        assert pool.empty_cache() > 0 and pool.stats().bytes_reserved == 0


def test_a_living_threads_per_thread_stream_still_holds_back_what_this_thread_gives():
    pool, _ = expandable()
    go, done = threading.Event(), threading.Event()

    def work():
        pool.allocate(P, 0, PER_THREAD).release()
        go.set()
        done.wait()
    t = threading.Thread(target=work)
    t.start()
    go.wait()
    try:
        assert pool.empty_cache() == 0                # it may be capturing: nothing goes back on the device
    finally:
        done.set()
        t.join()
    assert pool.empty_cache() == P


# --- 3. debug mode: a miss made of freed bytes

def test_debug_mode_catches_a_write_into_freed_bytes_a_miss_joins():
    """A write into the poisoned free rest of a fresh page, then a miss that joins that rest with new pages: the
    block is checked as a reused one (before: handed out unchecked)."""
    pool, _ = expandable(debug="raise")
    a = pool.allocate(P // 2 - 64, 0, 0)             # the page's second half: free, poisoned
    ctypes.memset(a.ptr + P // 2 + 100, 0x11, 1)     # a stray write into it
    with pytest.raises(CorruptionError, match="written after it was freed"):
        pool.allocate(P, 0, 0)                       # cut from that half and a new page
    del a


def test_debug_mode_hands_out_a_clean_miss_of_freed_bytes():
    pool, _ = expandable(debug="raise")
    a = pool.allocate(P // 2 - 64, 0, 0)
    b = pool.allocate(P, 0, 0)
    assert b.ptr == a.ptr + P // 2
    del a, b
    pool.check()


# --- 7. a partly failed unmap

def test_a_partly_failed_unmap_counts_as_the_call_the_timeline_shows():
    pool, backend = expandable(timeline=100)
    blocks = [pool.allocate(P, 0, 0) for _ in range(3)]
    del blocks
    backend.twin.fail_unmaps(1, after_pages=1)
    with pytest.raises(RuntimeError, match="injected failure"):
        pool.empty_cache()
    s, events = pool.stats(), pool.timeline()
    unmaps = events[events["event"] == "unmap"]
    assert s.device_unmaps == len(unmaps) == 1 and int(unmaps["size"].sum()) == P
    assert s.bytes_reserved == backend.twin.mapped_bytes(0) == 2 * P and s.bytes_cached == 2 * P
    assert pool.empty_cache() == 2 * P and pool.stats().device_unmaps == 2


# --- 6, 8. settings and bad input

def test_keywords_over_a_settings_replace_those_fields_alone_and_say_so():
    base = Settings(limit="1GiB", debug="warn")
    for scheme in ("expandable", "seed", "segments"):
        pool = Pool(TwinBackend(), base, scheme=scheme)
        s = pool.settings
        assert (s.scheme, s.limit, s.debug) == (scheme, 1 << 30, "warn")
        assert (s.source("scheme"), s.source("limit"), s.source("debug")) == ("scheme", "limit", "debug")
        assert s.source("timeline") == "default"
    seed = Settings(scheme="seed", classes_per_doubling=4)
    assert Pool(TwinBackend(), seed, scheme="segments").settings.classes_per_doubling is None
    assert xpool.MemoryPool(base, backend=TwinBackend(), scheme="expandable").settings.scheme == "expandable"


@pytest.mark.parametrize("value", [[1], {}, {1}, bytearray(b"seed"), 3, 2.5])
def test_a_scheme_of_the_wrong_kind_names_the_argument(value):
    with pytest.raises(ValueError, match=r"^scheme=.*expected one of 'segments', 'seed', 'expandable'"):
        Settings(scheme=value)


@pytest.mark.parametrize("call, name", [(lambda: Settings(frontend=[]), "frontend"),
                                        (lambda: Settings().source([]), "name"),
                                        (lambda: Settings(debug=[]), "debug"),
                                        (lambda: Settings(limit={}), "limit")])
def test_bad_input_names_its_argument(call, name):
    with pytest.raises(ValueError, match=rf"^{name}"):
        call()


@pytest.mark.parametrize("ptr", [True, -1, 1.5, "0x10", None, 1 << 64])
def test_check_ipc_names_a_bad_pointer(ptr):
    pool, _ = expandable()
    with pytest.raises(ValueError, match="^ptr must be a device address"):
        pool.check_ipc(ptr, 0)


def test_a_stream_lookup_that_answers_a_negative_number_is_refused():
    """A stream lookup of pool_with_stream_lookup answering -1 (no error set): CuPy's hook refuses it rather than
    key the block with another thread's per-thread key."""
    lookup = ctypes.CFUNCTYPE(ctypes.c_ssize_t, ctypes.c_int)(lambda device: -1)
    pool = xpool_twin.testing.pool_with_stream_lookup(TwinBackend(), lookup)
    param, malloc, _ = xpool_twin.testing.cfunctions(pool)
    c_malloc = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)(malloc)
    with pytest.raises(ValueError, match="not a stream handle"):    # with the GIL, as CuPy calls it
        c_malloc(param, 512, 0)
    assert pool.stats().requests == 0


# --- 9. a debug block freed at interpreter exit

def test_a_debug_block_freed_at_exit_prints_nothing():
    code = textwrap.dedent("""
        import xpool
        from xpool_twin import TwinBackend
        pool = xpool.Pool(TwinBackend(), debug="raise")
        blocks = [pool.allocate(1000) for _ in range(3)]   # alive until the interpreter tears the module down
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stderr == "", r.stderr


# --- 10. a limit smaller than a request's page

def test_a_limit_below_one_page_names_the_page_and_frees_nothing():
    pool, backend = expandable(limit=P // 2)
    with pytest.raises(OutOfMemoryError) as e:
        pool.allocate(512, 0, 0)
    err = e.value
    assert err.reason == "limit_too_small" and err.size == P and err.requested == 512
    assert "64.00 KiB this request of 512 B needs" in str(err) and "nothing was freed" in str(err)
    assert "retried" not in str(err) and backend.twin.counters()["maps"] == 0


def test_a_limit_the_ladder_cannot_meet_says_it_freed_and_retried():
    pool, _ = expandable(limit=2 * P)
    held = [pool.allocate(P, 0, 0) for _ in range(2)]
    with pytest.raises(OutOfMemoryError) as e:
        pool.allocate(P, 0, 0)
    assert e.value.reason == "limit" and "the cache was freed and the request retried" in str(e.value)
    del held


# --- a threaded soak: frees racing misses, reference cycles, the collector

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
