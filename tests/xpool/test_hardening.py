"""Issue #11: the allocator under faults, races and hostile input.

One test (or a few) per defect and per smaller finding; each failed on the code before the fix.
"""
import ctypes
import os
import subprocess
import sys
import sysconfig
import threading
import time

import numpy as np
import pytest

import xpool
from faults import AddressBackend, FaultyBackend, InjectedFault, in_child
from xpool import Pool
from xpool_twin import HostBackend
from xpool.debug import CANARY, DEFAULT_TAIL, POISON, DebugHook


@pytest.fixture(autouse=True)
def _design_scheme(monkeypatch):
    """These tests spell out the bytes of the design's size classes: they run under scheme seed.  Scheme
    segments (the default) has its own in tests/xpool/test_segments.py."""
    monkeypatch.setenv("XPOOL_SCHEME", "seed")


KiB, MiB = 1 << 10, 1 << 20
needs_fork = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")


def cupy_memory():
    """CuPy's C allocator path (CFunctionAllocatorMemory) works without a GPU."""
    return pytest.importorskip("cupy.cuda.memory")


def c_path(pool):
    return pool._core.cfunctions()


def wait_for(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "the other thread never got there"
        time.sleep(0.001)


# 1. heap corruption: a request near 2**64 through CuPy's C path, in debug mode
@pytest.mark.parametrize("nbytes", [2**64 - 1, 2**64 - 64, 2**64 - 4096, 2**63, 2**48 + 1])
def test_request_near_2_64_through_cupys_c_path_is_refused(nbytes):
    memory = cupy_memory()
    pool = xpool.MemoryPool(backend=HostBackend(), debug="raise")
    with pytest.raises(ValueError, match="larger than any device"):
        memory.CFunctionAllocatorMemory(nbytes, *c_path(pool), 0)
    assert list(pool.stats()) == [] and pool._backend.mallocs == 0


# 2. limit= and XPOOL_MEMORY_LIMIT hold on every device, not only the current one
def test_limit_argument_holds_on_every_device():
    pool = Pool(HostBackend(n_devices=4), limit=1 * MiB)
    for d in range(4):
        assert pool.get_limit(device=d) == MiB
        with pytest.raises(xpool.OutOfMemoryError) as info:
            pool.allocate(2 * MiB, device=d)
        assert info.value.reason == "limit_too_small"     # larger than the limit itself: refused at once
    assert pool._backend.mallocs == 0


def test_limit_from_environment_holds_on_every_device(monkeypatch):
    monkeypatch.setenv("XPOOL_MEMORY_LIMIT", "1MiB")
    pool = Pool(HostBackend(n_devices=4))
    assert [pool.get_limit(device=d) for d in range(4)] == [MiB] * 4
    monkeypatch.setenv("XPOOL_MEMORY_LIMIT", "25%")
    pool = Pool(HostBackend(capacity=8 * MiB, n_devices=4))
    assert [pool.get_limit(device=d) for d in (3, 1)] == [2 * MiB] * 2
    with pytest.raises(xpool.OutOfMemoryError, match="limit"):
        pool.allocate(3 * MiB, device=2)
    pool.set_limit(size=4 * MiB, device=2)                 # per device, as before
    assert pool.allocate(3 * MiB, device=2).size == 4 * MiB


# 3. the limit holds when threads share a device and the lock is dropped for the backend
def test_limit_holds_when_threads_share_a_device():
    backend = FaultyBackend(malloc_delay=0.01)   # a slow malloc: every thread is inside it at once
    threads, limit = 8, 3 * MiB
    pool = Pool(backend, limit=limit)
    barrier = threading.Barrier(threads)
    held, errors = [], []

    def worker():
        try:
            for _ in range(2):
                barrier.wait()
                try:
                    held.append(pool.allocate(MiB))
                except xpool.OutOfMemoryError as e:
                    assert e.reason == "limit"
        except Exception as e:  # noqa: BLE001 - surfaced below
            errors.append(repr(e))

    ts = [threading.Thread(target=worker) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert errors == []
    assert backend.high_water[0] <= limit and len(held) == 3
    st = pool._core.stats(0)
    assert st["peak_bytes_reserved"] <= limit and st["bytes_pending"] == 0
    assert st["bytes_reserved"] == backend.used(0) == 3 * MiB


def test_blocks_being_given_back_still_count_against_the_limit():
    backend = FaultyBackend(free_delay=0.05)     # the device holds a block until its free returns
    pool = Pool(backend, limit=2 * MiB)
    blocks = [pool.allocate(MiB) for _ in range(2)]
    del blocks                                   # 2 MiB cached
    releaser = threading.Thread(target=pool.empty_cache)
    releaser.start()
    wait_for(lambda: backend.free_calls >= 1)    # empty_cache is inside the first (slow) free
    try:
        pool.allocate(2 * MiB)
    except xpool.OutOfMemoryError as e:          # refusing is right; overshooting is not
        assert e.reason == "limit"
    releaser.join()
    assert backend.high_water[0] <= 2 * MiB
    assert pool._core.stats(0)["bytes_reserved"] == backend.used(0)


# 4. a free that raises loses no block
def test_a_failed_free_loses_no_block():
    backend = FaultyBackend()
    pool = Pool(backend)
    blocks = [pool.allocate(4 * KiB) for _ in range(100)]
    del blocks
    backend.fail_frees = 1                       # the first free raises and frees nothing
    with pytest.raises(InjectedFault):
        pool.empty_cache()
    st = pool.stats()
    assert (st.blocks_cached, st.device_frees) == (1, 99)        # every other block was tried
    assert st.bytes_reserved == backend.used(0) == 4 * KiB
    assert pool.empty_cache() == 4 * KiB                          # the next call reaches it
    assert backend.used(0) == 0 and backend.live() == {}


def test_frees_failing_at_random_leak_nothing():
    backend = FaultyBackend(free_error=0.1, seed=11)
    pool = Pool(backend, classes_per_doubling=2)
    rng = np.random.default_rng(5)
    for _ in range(30):
        blocks = [pool.allocate(int(n)) for n in rng.integers(1, 3 * MiB, 20)]
        del blocks
        try:
            pool.trim(int(rng.integers(0, 4 * MiB)))
        except InjectedFault:
            pass
        assert pool.stats().bytes_reserved == backend.used(0)
    assert backend.injected["free_error"] > 0
    backend.free_error = 0
    pool.empty_cache()
    assert backend.used(0) == 0 and backend.live() == {}


# 5. check() reports nothing while other threads allocate and free (debug mode)
def test_check_reports_nothing_while_other_threads_allocate():
    pool = Pool(HostBackend(), debug="raise")
    stop, errors = threading.Event(), []

    def churn():
        try:
            while not stop.is_set():
                blocks = [pool.allocate(n) for n in (100, 1000, 5000)]
                del blocks
        except Exception as e:  # noqa: BLE001 - surfaced below
            errors.append(repr(e))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)                  # switch threads inside the hooks as often as possible
    threads = [threading.Thread(target=churn) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        for _ in range(300):
            pool.check()
    finally:
        stop.set()
        for t in threads:
            t.join()
        sys.setswitchinterval(interval)
    assert errors == [] and pool._hook.found == []


def swap_debug_hook(pool, mode):
    """The core's hook swapped under a pool that holds blocks (debug mode is a setting of the pool; the core
    still takes a new hook at any time, and the blocks say what the hook they met prepared)."""
    pool._hook = DebugHook(pool._backend, mode) if mode else None
    pool._core.set_debug(pool._hook, DEFAULT_TAIL if mode else 0)


# 6. a debug hook set in a core that already holds blocks
def test_debug_mode_turned_on_late_reports_nothing_for_older_blocks():
    pool = Pool(HostBackend(), debug=False)
    live = pool.allocate(1000)                   # handed out without a canary
    cached = pool.allocate(3000)
    ctypes.memset(cached.ptr, 0x22, 3000)
    del cached                                   # cached without poison
    swap_debug_hook(pool, "raise")
    pool.check()
    again = pool.allocate(3000)                  # reuses the unpoisoned block
    del live                                     # freed without a canary check
    pool.allocate(8)
    pool.check()
    assert pool._hook.found == []
    ctypes.memset(again.ptr + 3000, 0, 1)        # blocks handed out in debug mode are checked
    with pytest.raises(xpool.CorruptionError, match=r"\+0 past its end"):
        pool.check()


# 7. HostBackend in a child forked while another thread held its lock
@needs_fork
def test_host_backend_works_in_a_child_forked_while_its_lock_was_held():
    backend = HostBackend()
    pool = Pool(backend)
    held, done = threading.Event(), threading.Event()

    def hold():
        with backend._lock:
            held.set()
            done.wait()

    t = threading.Thread(target=hold)
    t.start()
    held.wait()
    try:
        answer = in_child(lambda: "ok" if pool.allocate(4096).size == 4096 else "wrong size")
    finally:
        done.set()
        t.join()
    assert answer == "ok"


# 8. the live table does not grow with addresses that came and went
def test_live_table_stays_small_under_address_churn():
    backend = AddressBackend()
    pool = Pool(backend)
    keep = [pool.allocate(512) for _ in range(100)]    # alive throughout
    for _ in range(20_000):                             # a new address each time, none left alive
        pool.allocate(512).release()
        pool.empty_cache(device=0)
    live_slots, live_blocks, _ = pool._core.table_sizes(0)
    assert live_blocks == 100 and live_slots <= 1024
    for a in keep:                                      # every survivor is still found
        a.release()
    st = pool._core.stats(0)
    assert st["blocks_in_use"] == 0 and st["blocks_cached"] == 100


# code read: an exception in flight survives a block dying
def test_an_exception_in_flight_survives_a_block_dying_in_debug_mode():
    pool = Pool(HostBackend(), debug="raise")
    with pytest.raises(TypeError):
        int(pool.allocate(1000))
    with pytest.raises(TypeError):
        int(pool.allocate(1000))                 # and the pool is fine afterwards
    assert pool.stats().blocks_in_use == 0


# code read: in a fork()ed child an unknown pointer drops no reference to the allocator
@needs_fork
def test_in_a_forked_child_an_unknown_pointer_drops_no_reference():
    pool = xpool.MemoryPool(backend=HostBackend())
    core = pool._core
    param, _, free_fn = core.cfunctions()
    c_free = ctypes.PYFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)(free_fn)

    def child():
        seen = []
        sys.unraisablehook = seen.append
        before = sys.getrefcount(core)
        c_free(param, 0xDEAD000, 0)              # not a block of the parent, nor of the child
        after = sys.getrefcount(core)
        return "ok" if after == before and len(seen) == 1 else f"refs {before} -> {after}, {seen}"

    assert in_child(child) == "ok"


# code read: one allocation uses one debug hook, even if the core's set_debug swaps it meanwhile
def test_an_allocation_uses_the_debug_hook_it_started_with():
    class SwitchingBackend(HostBackend):
        def malloc(self, device, nbytes):
            swap_debug_hook(pool, None)          # another thread takes the hook away meanwhile
            return super().malloc(device, nbytes)

    pool = Pool(SwitchingBackend(), debug="raise")
    hook = pool._hook
    a = pool.allocate(100)
    assert a.size - 100 >= 64 and (0, a.ptr) in hook.where
    assert ctypes.string_at(a.ptr + 100, a.size - 100) == bytes([CANARY]) * (a.size - 100)


# code read: numbers the core takes are not wrapped to 2**64 - n
@pytest.mark.parametrize("call, name", [
    (lambda c: c.set_limit(0, -1), "limit"),
    (lambda c: c.release(0, keep=-1), "keep"),
    (lambda c: c.free_ptr(0, -4096), "ptr"),
    (lambda c: c.allocate(-1), "nbytes"),
])
def test_core_refuses_negative_numbers_by_name(call, name):
    pool = Pool(HostBackend())
    pool.allocate(10).release()
    with pytest.raises(ValueError, match=f"{name} must be"):
        call(pool._core)
    assert pool.get_limit() == 0 and pool.stats().blocks_cached == 1


# code read: the GIL.  The core declares Py_MOD_GIL_USED; this guards against declaring otherwise
# without making it safe.
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


# smaller findings
def test_limit_argument_takes_the_environment_forms_and_names_itself():
    assert Pool(HostBackend(), limit="8GiB").get_limit() == 8 << 30
    assert Pool(HostBackend(capacity=8 * MiB), limit="50%").get_limit(device=5) == 4 * MiB
    for bad in ("lots", -1, 1.5, "200%"):
        with pytest.raises(ValueError, match="limit"):
            Pool(HostBackend(), limit=bad)


@pytest.mark.parametrize("var, value", [("XPOOL_CLASSES_PER_DOUBLING", "four"),
                                        ("XPOOL_CLASSES_PER_DOUBLING", "0"),
                                        ("XPOOL_TIMELINE", "lots"), ("XPOOL_TIMELINE", "-3")])
def test_bad_environment_settings_name_the_variable(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=var):
        Pool(HostBackend())


@pytest.mark.parametrize("bad", [1.5, "1", True, 2**64])
def test_a_bad_stream_is_refused_not_truncated(bad):
    pool = Pool(HostBackend())
    with pytest.raises(ValueError, match="stream"):
        pool.allocate(10, stream=bad)
    assert pool.allocate(10, stream=np.int64(3)).stream == 3


def test_a_tiny_fraction_is_a_tiny_limit_not_none():
    pool = Pool(HostBackend(capacity=8 * MiB))
    pool.set_limit(fraction=1e-15)
    assert pool.get_limit() == 1
    with pytest.raises(xpool.OutOfMemoryError, match="limit"):
        pool.allocate(1)
    pool.set_limit(fraction=np.float64(0.5))
    assert pool.get_limit() == 4 * MiB


def test_a_request_larger_than_the_limit_leaves_the_cache_alone():
    pool, backend = Pool(FaultyBackend(), limit=2 * MiB), None
    cached = pool.allocate(MiB)
    del cached
    with pytest.raises(xpool.OutOfMemoryError) as info:
        pool.allocate(3 * MiB)
    assert info.value.reason == "limit_too_small"
    st = pool.stats()
    assert (st.blocks_cached, st.device_frees) == (1, 0)


@pytest.mark.parametrize("address", [0, -512, "0x1000", None])
def test_a_backend_returning_no_address_leaves_nothing_counted(address):
    class NoAddress(HostBackend):
        def malloc(self, device, nbytes):
            return address

    pool = Pool(NoAddress())
    with pytest.raises((ValueError, TypeError), match="backend.malloc"):
        pool.allocate(100)
    st = pool._core.stats(0)
    assert st["blocks_in_use"] == st["bytes_reserved"] == st["bytes_pending"] == 0
    assert st["device_mallocs"] == 0


def test_a_failed_poison_fill_caches_no_unpoisoned_block():
    class FillFails(HostBackend):
        fail = False

        def fill(self, device, ptr, nbytes, byte):
            if self.fail and byte == POISON:
                raise InjectedFault("injected: fill failed")
            super().fill(device, ptr, nbytes, byte)

    backend = FillFails()
    pool = Pool(backend, debug="raise")
    a = pool.allocate(256)
    ctypes.memset(a.ptr, 0x11, 256)
    backend.fail = True
    with pytest.raises(InjectedFault):
        a.release()
    backend.fail = False
    b = pool.allocate(256)                       # no false "written after it was freed"
    st = pool.stats()
    assert (st.device_frees, st.blocks_in_use, st.bytes_reserved) == (1, 1, backend.used(0))
    assert pool._hook.found == []
    del b


def test_classes_per_doubling_takes_numpy_integers():
    pool = Pool(HostBackend(), classes_per_doubling=np.int64(4))
    assert pool.settings.classes_per_doubling == 4 and type(pool.settings.classes_per_doubling) is int
    assert pool.allocate(4 * MiB + 1).size == 5 * MiB
    assert xpool.sizeclass.size_class(4 * MiB + 1, np.int32(4)) == 5 * MiB


def test_a_failed_free_on_one_device_does_not_stop_the_others():
    backend = FaultyBackend(n_devices=3)
    pool = Pool(backend)
    for d in range(3):
        pool.allocate(4 * KiB, device=d).release()
    backend.fail_frees = 1                       # device 0's free fails
    with pytest.raises(InjectedFault):
        pool.empty_cache()
    assert [backend.used(d) for d in range(3)] == [4 * KiB, 0, 0]
    assert [pool._core.stats(d)["bytes_cached"] for d in range(3)] == [4 * KiB, 0, 0]


# code read: the debug free path used the block after unlocking; a double free racing the first one then
# checked and poisoned the block after it had been cached and handed to its next owner
def test_a_racing_double_free_never_touches_the_blocks_next_owner():
    pool = Pool(HostBackend(), debug="raise")
    hook, real_on_free = pool._hook, pool._hook.on_free
    inside, go = [threading.Event(), threading.Event()], [threading.Event(), threading.Event()]
    calls = []

    def on_free(info):                          # the n-th free waits inside the hook until told to go
        n = len(calls)
        calls.append(n)
        if n < 2:
            inside[n].set()
            go[n].wait(10)
        real_on_free(info)

    hook.on_free = on_free
    a = pool._core.allocate(256)
    results = {}

    def free(name):
        try:
            pool._core.free_ptr(0, a.ptr)
            results[name] = "freed"
        except ValueError as e:
            results[name] = str(e)

    first = threading.Thread(target=free, args=("first",))
    first.start()
    inside[0].wait(10)
    second = threading.Thread(target=free, args=("second",))     # the double free, while the first runs
    second.start()
    wait_for(lambda: inside[1].is_set() or "second" in results)
    go[0].set()
    first.join()
    hook.on_free = real_on_free
    b = pool._core.allocate(256)                                  # the block's next owner
    assert b.ptr == a.ptr
    ctypes.memset(b.ptr, 0x11, 256)
    go[1].set()
    second.join()
    assert results["first"] == "freed" and "not handed out" in results["second"]
    assert ctypes.string_at(b.ptr, 256) == b"\x11" * 256
    b.release()
    with pytest.raises(ValueError, match="not handed out"):
        a.release()
