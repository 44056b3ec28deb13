"""A backend that fails: a failed free loses no block, a failed malloc or an absent address counts nothing."""
import numpy as np
import pytest

from faults import FaultyBackend, InjectedFault
from xpool import Pool
from xpool_twin import HostBackend


KiB, MiB = 1 << 10, 1 << 20


# A free that raises loses no block
@pytest.mark.usefixtures("seed_scheme")
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


@pytest.mark.usefixtures("seed_scheme")
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


@pytest.mark.usefixtures("seed_scheme")
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


@pytest.mark.usefixtures("seed_scheme")
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
