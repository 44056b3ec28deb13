"""Size classes: properties (hypothesis), the documented examples, and bad input."""
import pytest
from hypothesis import given, settings, strategies as st

import xpool
from xpool import _core
from xpool.sizeclass import MAX_REQUEST

MiB = 1 << 20
sizes = st.one_of(st.integers(0, 4 * MiB), st.integers(0, 1 << 40))
ks = st.integers(1, 64)


@given(sizes, ks)
@settings(max_examples=2000)
def test_class_covers_request_and_is_aligned(n, k):
    c = xpool.sizeclass.size_class(n, k)
    assert c >= max(n, 1) and c % 512 == 0


def reference(n: int, k: int) -> int:
    """The classes as the design states them, in Python: up to 1 MiB the next multiple of 512 B; above, the least of
    p + ceil(j p / k) (j = 1..k, p < n <= 2p a power of two), rounded up to 512 B, that holds n."""
    if n <= MiB:
        return max(512, -(-n // 512) * 512)
    p = 1 << ((n - 1).bit_length() - 1)
    return min(c for c in (-(-(p + -(-j * p // k)) // 512) * 512 for j in range(1, k + 1)) if c >= n)


@given(sizes, ks)
@settings(max_examples=2000)
def test_c_core_agrees_with_the_design(n, k):
    assert _core.size_class(n, k) == xpool.sizeclass.size_class(n, k) == reference(n, k)


@given(sizes, ks)
def test_idempotent_and_monotone(n, k):
    c = xpool.sizeclass.size_class(n, k)
    assert xpool.sizeclass.size_class(c, k) == c
    assert xpool.sizeclass.size_class(n + 1, k) >= c


@given(st.integers(MiB + 1, 1 << 40), ks)
def test_large_waste_is_bounded_by_one_class_step(n, k):
    # the gap between neighbouring classes above p is p/k (+512 rounding): waste < n/k + 512
    assert xpool.sizeclass.size_class(n, k) - n < n / k + 512


@given(st.integers(MiB + 1, 1 << 40))
def test_seed_design_is_next_power_of_two(n):
    c = xpool.sizeclass.size_class(n)
    assert c & (c - 1) == 0 and c // 2 < n <= c


def test_documented_examples():
    assert xpool.sizeclass.size_class(0) == 512
    assert xpool.sizeclass.size_class(1) == 512
    assert xpool.sizeclass.size_class(513) == 1024
    assert xpool.sizeclass.size_class(MiB) == MiB
    assert xpool.sizeclass.size_class(MiB + 1) == 2 * MiB
    # k=4 between 4 and 8 MiB: 5, 6, 7, 8 MiB
    assert [xpool.sizeclass.size_class(4 * MiB + j * MiB + 1, 4) for j in range(4)] == [5 * MiB, 6 * MiB, 7 * MiB, 8 * MiB]
    assert xpool.sizeclass.size_class(4 * MiB + 1, 4) == 5 * MiB
    assert xpool.sizeclass.size_class(5 * MiB, 4) == 5 * MiB
    # k=3 classes round to 512 B: p + p/3 for p = 2 MiB
    assert xpool.sizeclass.size_class(2 * MiB + 1, 3) == -(-(2 * MiB + -(-2 * MiB // 3)) // 512) * 512


@pytest.mark.parametrize("bad", [-1, 1.5, "10", None, True, MAX_REQUEST + 1, float("nan")])
def test_bad_sizes_raise_value_error_naming_the_argument(bad):
    with pytest.raises(ValueError, match="nbytes"):
        xpool.sizeclass.size_class(bad)


@pytest.mark.parametrize("k", [0, -1, 65, 1.0, "4", True])
def test_bad_classes_per_doubling(k):
    with pytest.raises(ValueError, match="classes_per_doubling"):
        xpool.sizeclass.size_class(1000, k)
