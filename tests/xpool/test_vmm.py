"""The virtual-memory ops of the expandable scheme (xpool/_vmm.c): the host twin's pages, bookkeeping and
faults; the CUDA ops over a fake driver (tests/xpool/fixtures/fake_libcuda.c) and against the real cuda.h.
Note [Expandable segments] in xpool/_expandable.h."""
import ctypes
import ctypes.util
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

from xpool import _core
import xpool_twin

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures"
XPOOL = FIXTURES.parents[2] / "xpool"
K64 = 1 << 16


@pytest.fixture
def twin():
    return xpool_twin.HostTwin(n_devices=2, capacity=[16 * K64, None], granularity=[K64, 4 * K64])


@pytest.fixture
def ops(twin):
    return xpool_twin.Ops(twin.vmm())


def test_ranges_are_aligned_to_each_devices_granularity(twin, ops):
    assert (ops.name, ops.granularity(0), ops.granularity(1)) == ("host", K64, 4 * K64)
    a, b = ops.reserve(0, 8 * K64), ops.reserve(1, 8 * K64)
    assert a % K64 == 0 and b % (4 * K64) == 0
    assert twin.ranges() == sorted([(0, a, 8 * K64), (1, b, 8 * K64)], key=lambda r: r[1])
    with pytest.raises(_core.VmmError, match="not whole") as e:
        ops.reserve(1, 6 * K64)                  # not whole pages of device 1
    assert e.value.status == _core.INVALID
    ops.release(0, a, 8 * K64)
    ops.release(1, b, 8 * K64)
    assert twin.ranges() == [] and twin.counters()["releases"] == 2


def test_a_map_gives_fresh_pages_and_an_unmap_takes_them_back(twin, ops):
    a = ops.reserve(0, 8 * K64)
    ops.map(0, a + K64, 2 * K64)
    assert [p[1:3] for p in twin.pages()] == [(a + K64, K64), (a + 2 * K64, K64)]
    assert not twin.is_mapped(a) and twin.is_mapped(a + K64) and twin.is_mapped(a + 3 * K64 - 1)
    assert not twin.is_mapped(a + 3 * K64)
    ctypes.memset(a + K64, 0xAB, 2 * K64)
    assert ctypes.string_at(a + 3 * K64 - 4, 4) == b"\xab" * 4
    assert ops.unmap(0, a + K64, 2 * K64) == 2 * K64
    assert twin.pages() == [] and twin.mapped_bytes(0) == 0
    ops.map(0, a + K64, K64)                     # the same address again: new, zeroed memory
    assert ctypes.string_at(a + K64, 16) == bytes(16)
    assert twin.counters() == dict(reserves=1, releases=0, maps=2, unmaps=1, map_pages=3, unmap_pages=2,
                                   map_failures=0, unmap_failures=0, reserve_failures=0, unmaps_while_capturing=0)


def test_a_touch_of_an_unmapped_page_faults_as_on_a_gpu():
    code = textwrap.dedent("""
        import ctypes
        import xpool_twin
        twin = xpool_twin.HostTwin(1)
        ops = xpool_twin.Ops(twin.vmm())
        a = ops.reserve(0, 4 << 16)
        ops.map(0, a, 1 << 16)
        ctypes.memset(a, 1, 1 << 16)             # mapped: fine
        ops.unmap(0, a, 1 << 16)
        print("unmapped", flush=True)
        ctypes.memset(a, 1, 1)                   # faults
        print("survived")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.stdout == "unmapped\n" and r.returncode == -signal.SIGSEGV, (r.stdout, r.stderr)


@pytest.mark.parametrize("what, call", [
    ("outside a range", lambda o, a: o.map(0, a + 64 * K64, K64)),
    ("misaligned", lambda o, a: o.map(0, a + 512, K64)),
    ("not whole pages", lambda o, a: o.map(0, a, K64 + 512)),
    ("a page that is not whole granules", lambda o, a: o.map(0, a, 2 * K64, page=K64 + 4096)),
    ("over a mapped page", lambda o, a: o.map(0, a + K64, 2 * K64)),
    ("a peer that does not exist", lambda o, a: o.map(0, a + 4 * K64, K64, peers=1 << 5)),
    ("no device", lambda o, a: o.map(7, a + 4 * K64, K64)),
    ("an unmap of unmapped pages", lambda o, a: o.unmap(0, a + 4 * K64, K64)),
    ("a double unmap", lambda o, a: (o.unmap(0, a + K64, K64), o.unmap(0, a + K64, K64))),
    ("an unmap with another page size", lambda o, a: o.unmap(0, a + 2 * K64, 2 * K64, page=2 * K64)),
    ("an unmap on another device", lambda o, a: o.unmap(1, a + K64, K64)),
    ("a release with pages mapped", lambda o, a: o.release(0, a, 16 * K64)),
    ("a release of part of a range", lambda o, a: o.release(0, a, 8 * K64)),
])
def test_bad_calls_fail_and_change_nothing(twin, ops, what, call):
    a = ops.reserve(0, 16 * K64)
    ops.map(0, a + K64, 2 * K64)
    before = (twin.pages(), twin.ranges(), twin.mapped_bytes(0))
    maps = twin.counters()["maps"]
    with pytest.raises(_core.VmmError) as e:
        call(ops, a)
    assert e.value.status == _core.INVALID, (what, str(e.value))
    if what != "a double unmap":   # the first unmap of that one is legitimate
        assert (twin.pages(), twin.ranges(), twin.mapped_bytes(0)) == before, what
        assert twin.counters()["maps"] == maps


def test_out_of_memory_on_the_nth_page_leaves_nothing_mapped(twin, ops):
    a = ops.reserve(0, 64 * K64)
    ops.map(0, a, 10 * K64)                      # capacity 16 pages
    with pytest.raises(MemoryError, match="page 6 of 8") as e:
        ops.map(0, a + 10 * K64, 8 * K64)
    assert isinstance(e.value, _core.VmmOutOfMemory) and e.value.status == _core.OOM
    assert twin.mapped_bytes(0) == 10 * K64 and len(twin.pages()) == 10
    assert not twin.is_mapped(a + 10 * K64)
    ops.map(0, a + 10 * K64, 6 * K64)            # what fits still fits
    twin.set_capacity(0, None)
    ops.map(0, a + 16 * K64, 32 * K64)
    assert twin.capacity(0) is None and twin.counters()["map_failures"] == 1


@pytest.mark.parametrize("kind, status", [("oom", _core.OOM), ("error", _core.ERROR)])
def test_injected_map_faults_undo_what_they_made(twin, ops, kind, status):
    a = ops.reserve(1, 64 * K64)
    twin.fail_maps(count=2, kind=kind, after_pages=3, skip=1)
    ops.map(1, a, 4 * K64)                       # skipped
    for _ in range(2):
        with pytest.raises(_core.VmmError, match="page 3 of 5") as e:
            ops.map(1, a + 4 * K64, 5 * 4 * K64)
        assert e.value.status == status
        assert twin.mapped_bytes(1) == 4 * K64 and not twin.is_mapped(a + 4 * K64)
    ops.map(1, a + 4 * K64, 5 * 4 * K64)         # the faults are spent
    assert twin.counters()["map_failures"] == 2


def test_an_injected_unmap_fault_unmaps_a_prefix(twin, ops):
    a = ops.reserve(0, 8 * K64)
    ops.map(0, a, 4 * K64)
    twin.fail_unmaps(count=1, after_pages=1)
    with pytest.raises(_core.VmmError, match="page 1 of 4") as e:
        ops.unmap(0, a, 4 * K64)
    assert e.value.done == K64 and e.value.status == _core.ERROR
    assert [p[1] for p in twin.pages()] == [a + K64, a + 2 * K64, a + 3 * K64]
    assert ops.unmap(0, a + K64, 3 * K64) == 3 * K64
    c = twin.counters()
    assert (c["unmaps"], c["unmap_failures"], c["unmap_pages"]) == (1, 1, 4)


def test_an_injected_reserve_fault(twin, ops):
    twin.fail_reserves(1)
    with pytest.raises(MemoryError, match="injected"):
        ops.reserve(0, 4 * K64)
    assert twin.ranges() == [] and ops.reserve(0, 4 * K64)


def test_capture_flag_answers_for_every_stream_and_counts_unmaps(twin, ops):
    a = ops.reserve(0, 8 * K64)
    ops.map(0, a, 2 * K64)
    assert not ops.capturing(0, 0)
    twin.set_capturing(0, True)
    assert ops.capturing(0, 0) and ops.capturing(0, 12345) and not ops.capturing(1, 0)
    ops.map(0, a + 2 * K64, K64)                 # maps stay legal while capturing
    ops.unmap(0, a, K64)
    assert twin.counters()["unmaps_while_capturing"] == 1


def test_peers_are_recorded_without_the_device_itself(twin, ops):
    a = ops.reserve(0, 8 * K64)
    ops.map(0, a, K64, peers=0b11)
    assert twin.pages() == [(0, a, K64, 0b10)]


def test_the_twins_peers_are_every_other_device_unless_set(twin, ops):
    """ops.peers(device) on the twin: every other device (an NVLink host), or what set_peers says; a map naming a
    device that cannot access the device is refused, as cuMemSetAccess refuses it, and leaves nothing mapped."""
    assert (ops.peers(0), ops.peers(1)) == (0b10, 0b01)
    twin.set_peers(0, 0)                         # GPUs without P2P between them
    assert ops.peers(0) == 0 and ops.peers(1) == 0b01
    a = ops.reserve(0, 8 * K64)
    with pytest.raises(_core.VmmError, match="cannot access device 0"):
        ops.map(0, a, K64, peers=0b10)
    assert twin.pages() == []
    twin.set_peers(0, 0b10)
    ops.map(0, a, K64, peers=0b10)
    assert twin.pages() == [(0, a, K64, 0b10)]
    for bad in (0b01, 1 << 7):                   # itself; no such device
        with pytest.raises(ValueError, match="set_peers"):
            twin.set_peers(0, bad)
    assert ops.peers(0) == 0b10


@pytest.mark.parametrize("gran", [3000, 4096 * 3, 0, 1 << 11])
def test_a_granularity_must_be_a_power_of_two_of_host_pages(gran):
    with pytest.raises(ValueError, match="granularity"):
        xpool_twin.HostTwin(1, granularity=gran)


def test_bad_twin_arguments_name_themselves():
    with pytest.raises(ValueError, match="n_devices"):
        xpool_twin.HostTwin(0)
    with pytest.raises(ValueError, match="capacity: 1 values for 2 devices"):
        xpool_twin.HostTwin(2, capacity=[1])
    with pytest.raises(ValueError, match="kind"):
        xpool_twin.HostTwin(1).fail_maps(kind="sometimes")
    with pytest.raises(ValueError, match="device must be in"):
        xpool_twin.HostTwin(1).mapped_bytes(1)


def test_a_capsule_keeps_its_twin_alive():
    twin = xpool_twin.HostTwin(1)
    ops = xpool_twin.Ops(twin.vmm())
    del twin
    a = ops.reserve(0, 4 * K64)
    ops.map(0, a, K64)
    assert ops.unmap(0, a, K64) == K64


def test_ops_take_only_an_xpool_vmm_capsule():
    other = ctypes.pythonapi.PyCapsule_New
    other.restype, other.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    with pytest.raises(TypeError, match="expected an 'xpool.vmm' capsule"):
        xpool_twin.Ops(other(ctypes.c_void_p(8), b"not.vmm", None))
    with pytest.raises(TypeError, match="xpool.vmm"):
        xpool_twin.address(42)


# --- CUDA: the loader, and the ops over a fake driver

def _run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=60)


def _cuda_vmm_error(libcuda: str) -> str:
    """What cuda_vmm() raises, in a process whose driver is `libcuda` (status and message)."""
    return _run("""
        from xpool import _core
        try:
            _core.cuda_vmm()
        except _core.VmmError as e:
            print(e.status, e)
    """, XPOOL_LIBCUDA=libcuda).stdout


def test_without_a_driver_cuda_vmm_says_why():
    out = _cuda_vmm_error("/nonexistent/libcuda.so.1")
    assert out.startswith(f"{_core.UNAVAILABLE} cannot load the CUDA driver (/nonexistent/libcuda.so.1)"), out


def test_a_library_that_is_no_driver_is_refused():
    libm = ctypes.util.find_library("m")
    if not libm:
        pytest.skip("no libm to stand for a library that is no driver")
    out = _cuda_vmm_error(libm)
    assert out.startswith(f"{_core.UNAVAILABLE} {libm} is no CUDA driver"), out


@pytest.fixture(scope="module")
def fake_driver(tmp_path_factory):
    cc = shutil.which(os.environ.get("CC", "gcc")) or shutil.which("cc")
    if not cc:
        pytest.skip("no C compiler to build the fake driver")
    out = tmp_path_factory.mktemp("fakecuda") / "libcuda_fake.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-Wall", str(FIXTURES / "fake_libcuda.c"), "-o",
                    str(out), "-ldl"], check=True)
    return str(out)


FAKE_PRELUDE = """
    import ctypes, os
    import xpool_twin
    from xpool import _core
    fake = ctypes.CDLL(os.environ["XPOOL_LIBCUDA"])
    def get(name, kind=ctypes.c_long):
        return kind.in_dll(fake, name).value
    def put(name, value, kind=ctypes.c_long):
        kind.in_dll(fake, name).value = value
    ops = xpool_twin.Ops(_core.cuda_vmm())
    G = ops.granularity(0)
"""


def _fake(fake_driver, body: str) -> None:
    r = _run(textwrap.dedent(FAKE_PRELUDE) + textwrap.dedent(body) + "\nprint('ok')\n", XPOOL_LIBCUDA=fake_driver)
    assert r.returncode == 0 and r.stdout.endswith("ok\n"), r.stdout + r.stderr


def test_cuda_ops_map_one_allocation_per_page_and_free_it_on_unmap(fake_driver):
    _fake(fake_driver, """
        assert ops.name == "cuda" and G == 1 << 16 and get("fake_getproc_calls") > 0
        a = ops.reserve(0, 64 * G)
        assert a % G == 0
        ops.map(0, a, 8 * G, peers=0b10)
        assert get("fake_creates") == 8 and get("fake_pages_mapped") == 8
        assert get("fake_live_allocations") == 8          # alive: each held by its handle until its unmap
        assert get("fake_maps_not_relaxed") == 0          # mapped in relaxed capture mode
        assert get("fake_last_access_count", ctypes.c_int) == 2
        ids = (ctypes.c_int * 8).in_dll(fake, "fake_last_access_ids")
        assert (ids[0], ids[1]) == (0, 1)
        ctypes.memset(a, 7, 8 * G)
        assert ops.unmap(0, a, 8 * G) == 8 * G
        assert get("fake_live_allocations") == 0 and get("fake_pages_mapped") == 0
        assert get("fake_syncs") == 1                     # the device finished its work first
        assert get("fake_pushes") == get("fake_pops") > 0 # the primary context made current, then not
        ops.release(0, a, 64 * G)
    """)


def test_cuda_peers_are_the_devices_that_can_access_the_device(fake_driver):
    """ops.peers(device): every other device cuDeviceCanAccessPeer says can reach it (the fake's two devices)."""
    _fake(fake_driver, """
        assert (ops.peers(0), ops.peers(1)) == (0b10, 0b01)
        put("fake_peers_ok", 0)                           # GPUs without P2P between them
        assert ops.peers(0) == 0
        try:
            ops.peers(2)
            raise SystemExit("no error")
        except _core.VmmError as e:
            assert "cuDeviceGet" in str(e), e
    """)


def test_cuda_map_failing_at_the_nth_page_leaves_nothing(fake_driver):
    _fake(fake_driver, """
        a = ops.reserve(0, 64 * G)
        put("fake_fail_map_at", 5)
        try:
            ops.map(0, a, 8 * G)
            raise SystemExit("no error")
        except MemoryError as e:
            assert e.status == _core.OOM and "cuMemMap failed: CUDA_ERROR_OUT_OF_MEMORY" in str(e), e
            assert "handle 5 of 8" in str(e), e
        assert get("fake_live_allocations") == 0 and get("fake_pages_mapped") == 0
        put("fake_capacity_pages", 3)
        try:
            ops.map(0, a, 4 * G)
            raise SystemExit("no error")
        except MemoryError as e:
            assert "cuMemCreate failed" in str(e) and "handle 3 of 4" in str(e), e
        assert get("fake_live_allocations") == 0 and get("fake_pages_mapped") == 0
        put("fake_capacity_pages", 1 << 20)
        put("fake_fail_access", 1)
        try:
            ops.map(0, a, 4 * G)
            raise SystemExit("no error")
        except _core.VmmError as e:
            assert e.status == _core.INVALID and "cuMemSetAccess failed" in str(e), e
        assert get("fake_live_allocations") == 0 and get("fake_pages_mapped") == 0
        ops.map(0, a, 4 * G)
        assert get("fake_pages_mapped") == 4
    """)


def test_cuda_unmap_of_what_is_not_mapped_fails_and_unmaps_nothing(fake_driver):
    _fake(fake_driver, """
        a = ops.reserve(0, 64 * G)
        ops.map(0, a, 2 * G)
        try:
            ops.unmap(0, a, 4 * G)                # pages 2 and 3 are not mapped: checked before anything is unmapped
            raise SystemExit("no error")
        except _core.VmmError as e:
            assert e.done == 0 and e.status == _core.INVALID and "0x%x is not a whole mapping" % (a + 2 * G) in str(e), e
        assert get("fake_pages_mapped") == 2 and get("fake_syncs") == 0
        ops.map(0, a + 2 * G, 4 * G, page=2 * G)  # two handles of 2 pages
        try:
            ops.unmap(0, a + 2 * G, 3 * G, page=0)  # half a handle: CUDA unmaps whole mappings only
            raise SystemExit("no error")
        except _core.VmmError as e:
            assert e.done == 0 and e.status == _core.INVALID, e
        assert ops.unmap(0, a, 6 * G, page=0) == 6 * G   # every handle as it was mapped, whatever its size
        assert get("fake_pages_mapped") == 0 and get("fake_live_allocations") == 0
        try:
            ops.release(0, a + G, 8 * G)
            raise SystemExit("no error")
        except _core.VmmError:
            pass
        ops.release(0, a, 64 * G)
    """)


def test_cuda_capture_queries(fake_driver):
    _fake(fake_driver, """
        assert ops.capturing(0, 0) is False
        put("fake_capture_status", 1, ctypes.c_int)
        assert ops.capturing(0, 77) is True
        put("fake_capture_status", 906, ctypes.c_int)   # the legacy stream beside a global capture
        assert ops.capturing(0, 0) is True and ops.capturing(0, 77) is False
    """)


def _cuda_h() -> pathlib.Path | None:
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and (pathlib.Path(root) / "include" / "cuda.h").exists():
            return pathlib.Path(root) / "include"
    return None


def test_cuda_declarations_match_cuda_h(tmp_path):
    inc = _cuda_h()
    cc = shutil.which(os.environ.get("CC", "gcc"))
    if not inc or not cc:
        pytest.skip("no cuda.h ($CUDA_HOME, /usr/local/cuda) or no C compiler")
    check = [cc, "-std=c11", "-fsyntax-only", f"-I{inc}"]
    src = str(FIXTURES / "vmm_cuda_layout.c")
    r = subprocess.run(check + [f"-I{XPOOL}", src], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    # the check can fail: a declaration off by one value or one field width is caught
    bad = (XPOOL / "_vmm_cuda.h").read_text()
    for wrong in (bad.replace("XVCUDA_ERROR_OUT_OF_MEMORY = 2", "XVCUDA_ERROR_OUT_OF_MEMORY = 3"),
                  bad.replace("unsigned short usage;", "unsigned char usage;"),
                  bad.replace('X(cuMemUnmap, XVCUresult (*)(XVCUdeviceptr, size_t)',
                              'X(cuMemUnmap, XVCUresult (*)(XVCUdeviceptr, unsigned)')):
        assert wrong != bad
        (tmp_path / "_vmm_cuda.h").write_text(wrong)
        r = subprocess.run(check + [f"-I{tmp_path}", src], capture_output=True, text=True)
        assert r.returncode != 0 and "static assertion failed" in r.stderr


# --- the backends' optional vmm()

def test_host_backend_offers_a_twin_of_its_devices():
    from xpool_twin import TwinBackend
    b = TwinBackend(capacity=8 * K64, n_devices=3, granularity=[K64, 2 * K64, K64])
    ops = xpool_twin.Ops(b.vmm())
    assert b.twin is b.twin and b.twin.n_devices == 3
    assert (ops.name, ops.granularity(1), b.twin.capacity(2)) == ("host", 2 * K64, 8 * K64)
    b.capacity = 2 * K64                         # as tests set it: the twin follows
    a = ops.reserve(0, 8 * K64)
    with pytest.raises(MemoryError):
        ops.map(0, a, 3 * K64)
    b.capacity = None
    ops.map(0, a, 3 * K64)
    assert b.twin.capacity(0) is None and b.used(0) == 0   # the twin's pages are not malloc's blocks


def test_cupy_backend_offers_cuda_or_says_why_not():
    pytest.importorskip("cupy")
    from xpool.backends import CupyBackend
    try:
        capsule = CupyBackend().vmm()
    except _core.VmmError as e:
        assert e.status == _core.UNAVAILABLE and ("CUDA driver" in str(e) or "cuInit" in str(e)
                                                 or "virtual memory" in str(e)), e
    else:
        assert xpool_twin.Ops(capsule).name == "cuda"


# --- driver calls per map and unmap (Note [Handles] in xpool/_expandable.c), counted by the fake driver

CALLS = ("fake_create_calls", "fake_map_calls", "fake_access_calls", "fake_release_calls", "fake_unmap_calls",
         "fake_syncs")


def test_cuda_map_makes_two_calls_a_handle_and_one_access_call_a_run(fake_driver):
    _fake(fake_driver, f"""
        calls = lambda: [get(n) for n in {CALLS!r}]
        a = ops.reserve(0, 64 * G)
        ops.map(0, a, 40 * G, page=8 * G, peers=0b10)     # 5 handles of 8 pages: not 40 of one
        assert calls() == [5, 5, 1, 0, 0, 0] and get("fake_pages_mapped") == 5   # one access call, both devices
        assert get("fake_last_access_count", ctypes.c_int) == 2
        ops.map(0, a + 40 * G, 10 * G, page=4 * G)        # 4 + 4 + 2 pages: the last handle the rest
        assert calls() == [8, 8, 2, 0, 0, 0] and get("fake_live_allocations") == 8
        assert ops.unmap(0, a, 50 * G) == 50 * G           # both runs, each handle as mapped: one synchronisation
        assert calls() == [8, 8, 2, 8, 8, 1] and get("fake_live_allocations") == 0
        ops.release(0, a, 64 * G)
    """)


def test_cuda_map_failing_midway_releases_every_handle_it_made(fake_driver):
    _fake(fake_driver, """
        a = ops.reserve(0, 64 * G)
        put("fake_fail_map_at", 2)                          # the third handle's cuMemMap
        try:
            ops.map(0, a, 40 * G, page=8 * G)
            raise SystemExit("no error")
        except MemoryError as e:
            assert "handle 2 of 5" in str(e), e
        assert get("fake_live_allocations") == 0 and get("fake_pages_mapped") == 0
        ops.map(0, a, 40 * G, page=8 * G)                   # the same addresses map again: nothing was left there
        assert ops.unmap(0, a, 40 * G, page=8 * G) == 40 * G and get("fake_live_allocations") == 0
        ops.release(0, a, 64 * G)
    """)


def test_growth_through_the_cuda_ops_counts_the_calls_the_rule_says(fake_driver, tmp_path):
    """The lab's growth sequence at a tenth (150 requests to 2.8 GB) through the range manager (the expandable
    harness) over the CUDA ops on the fake driver at an H100's 2 MiB granularity: the memory calls the driver sees
    are the lab's model of xpool's rule (xlab.bench.growth.xpool_driver_calls), no cuMemRelease until the unmap,
    then each handle unmapped and released once.  (The fake's default granularity is 64 KiB; an H100's is 2 MiB.)"""
    pytest.importorskip("xlab.bench.growth")
    sys.path.insert(0, str(FIXTURES.parent))
    from fixtures import expandable as E
    E.build(tmp_path)
    _fake(fake_driver, f"""
        import sys
        sys.path.insert(0, {str(FIXTURES.parent)!r})
        from fixtures import expandable as E
        from xlab.bench import growth
        put("fake_granularity", 2 << 20)
        lib = E.build({str(tmp_path)!r})
        pool = E.Pool(lib, _core.cuda_vmm(), 0, range_bytes=4 << 30)
        assert pool.page == 2 << 20
        sizes = growth.sequence(150, 2_800_000_000)
        before = {{n: get(n) for n in {CALLS!r}}}
        ptrs = [pool.alloc(n) for n in sizes]
        made = {{n: get(n) - before[n] for n in {CALLS!r}}}
        mine = sum(made[n] for n in {CALLS[:4]!r})
        model = growth.xpool_driver_calls(sizes)
        assert made["fake_release_calls"] == made["fake_unmap_calls"] == made["fake_syncs"] == 0, made
        assert (made["fake_create_calls"], made["fake_access_calls"], mine) == \\
               (model["handles"], model["maps"], model["calls"]), (made, model)
        for p in ptrs:
            pool.free(p)
        assert pool.release() > 0 and get("fake_live_allocations") == 0 and get("fake_pages_mapped") == 0
        assert get("fake_unmap_calls") - before["fake_unmap_calls"] == model["handles"]   # each handle, once
        assert get("fake_release_calls") - before["fake_release_calls"] == model["handles"]
        pool.destroy()
    """)


def test_cuda_unmap_lets_another_threads_map_finish_while_it_synchronises(fake_driver):
    """An unmap waits for its device (cuCtxSynchronize) without the ops' handle table locked: the device's work may
    wait on work another thread queues only once its own map returns (NCCL's kernels over two devices, a thread
    each), so a map that waited for the table behind that synchronisation would never return."""
    _fake(fake_driver, """
        import threading, time
        a, b = ops.reserve(0, 64 * G), ops.reserve(1, 64 * G)
        ops.map(0, a, 8 * G, page=4 * G)
        put("fake_sync_waits_for_op_ms", 3000)
        t = threading.Thread(target=lambda: ops.unmap(0, a, 8 * G))
        t.start()
        while get("fake_syncs") == 0:
            time.sleep(0.001)
        ops.map(1, b, 8 * G, page=4 * G)                   # device 1's map, while device 0 synchronises
        t.join()
        put("fake_sync_waits_for_op_ms", 0)
        assert get("fake_sync_timeouts") == 0, "the map waited for the unmap's synchronisation"
        assert get("fake_pages_mapped") == 2 and ops.unmap(1, b, 8 * G) == 8 * G
        assert get("fake_live_allocations") == 0
        ops.release(0, a, 64 * G)
        ops.release(1, b, 64 * G)
    """)


def test_cuda_map_out_of_device_memory_in_a_large_handle_is_a_memory_error_and_leaves_nothing(fake_driver):
    """cuMemCreate's CUDA_ERROR_OUT_OF_MEMORY for a handle of many pages (the device's bytes, not its handles,
    run out) is the ops' out of memory, which the pool's ladder answers by releasing and retrying."""
    _fake(fake_driver, """
        a = ops.reserve(0, 64 * G)
        put("fake_capacity_bytes", 20 * G)
        try:
            ops.map(0, a, 40 * G, page=8 * G)              # handles 0 and 1 fit, 2 does not
            raise SystemExit("no error")
        except MemoryError as e:
            assert "cuMemCreate" in str(e) and "handle 2 of 5" in str(e) and "OUT_OF_MEMORY" in str(e), e
        assert get("fake_live_allocations") == 0 and get("fake_pages_mapped") == 0
        ops.map(0, a, 20 * G, page=8 * G)                  # what fits maps: nothing was kept by the failure
        assert ops.unmap(0, a, 20 * G) == 20 * G and get("fake_live_allocations") == 0
        put("fake_capacity_bytes", 1 << 50)
        ops.release(0, a, 64 * G)
    """)


def test_cuda_unmap_failing_midway_unmaps_a_prefix_of_whole_handles_and_keeps_the_rest_unmappable(fake_driver):
    """A cuMemUnmap failing at the third of five handles: the two before it unmapped and released (done says so),
    the table keeps the other three, which unmap after, each as mapped; nothing leaks."""
    _fake(fake_driver, """
        a = ops.reserve(0, 64 * G)
        ops.map(0, a, 36 * G, page=8 * G)                 # 8 + 8 + 8 + 8 + 4 pages
        put("fake_fail_unmap_at", get("fake_unmap_calls") + 2)
        try:
            ops.unmap(0, a, 36 * G)
            raise SystemExit("no error")
        except _core.VmmError as e:
            assert e.done == 16 * G and "cuMemUnmap" in str(e) and "handle 2 of 5" in str(e), (e, e.done)
        assert get("fake_pages_mapped") == 3 and get("fake_live_allocations") == 3
        try:
            ops.unmap(0, a, 8 * G)                          # gone: the table says so before the driver is asked
            raise SystemExit("no error")
        except _core.VmmError as e:
            assert "not a whole mapping" in str(e), e
        assert ops.unmap(0, a + 16 * G, 20 * G) == 20 * G
        assert get("fake_pages_mapped") == 0 and get("fake_live_allocations") == 0
        ops.release(0, a, 64 * G)
    """)
