"""Size classes: the pure function that decides how many bytes a request really takes."""
from __future__ import annotations

import operator

ALIGN = 512                  # cudaMalloc's alignment, and the step of the small classes
SMALL_MAX = 1 << 20          # up to 1 MiB: round up to a multiple of ALIGN
MAX_REQUEST = 1 << 48        # 256 TiB: larger than any device
MAX_CLASSES_PER_DOUBLING = 64


def check_nbytes(nbytes, name: str = "nbytes") -> int:
    """Return nbytes as an int, or raise a ValueError that names the argument."""
    if isinstance(nbytes, bool):
        raise ValueError(f"{name} must be an integer number of bytes, got {nbytes!r}")
    try:
        n = operator.index(nbytes)
    except TypeError:
        raise ValueError(
            f"{name} must be an integer number of bytes, got {type(nbytes).__name__} {nbytes!r}"
        ) from None
    if n < 0:
        raise ValueError(f"{name} must be >= 0, got {n}")
    if n > MAX_REQUEST:
        raise ValueError(f"{name}={n} is larger than any device (max {MAX_REQUEST})")
    return n


def check_classes_per_doubling(k) -> int:
    """Return k as an int (NumPy integers too), or raise a ValueError that names the argument."""
    bad = ValueError(f"classes_per_doubling must be an int in [1, {MAX_CLASSES_PER_DOUBLING}], got {k!r}")
    if isinstance(k, bool):
        raise bad
    try:
        k = operator.index(k)
    except TypeError:
        raise bad from None
    if not 1 <= k <= MAX_CLASSES_PER_DOUBLING:
        raise bad
    return k


def size_class(nbytes: int, classes_per_doubling: int = 1) -> int:
    """Bytes actually reserved for an nbytes request.

    Up to 1 MiB: the next multiple of 512 B (at least 512).  Above: with k classes per doubling, the classes between p
    and 2p (p a power of two) are p + j*p/k for j = 1..k, each rounded up to 512 B; k=1 is the next power of two.  k=4
    bounds the waste at 25 % of p, about 20 % of the class.

    Args:
        nbytes (int): the request, 0 to 2**48.
        classes_per_doubling (int): k, 1 to 64.

    Returns:
        int: the class size in bytes, a multiple of 512 and >= nbytes.

    Raises:
        ValueError: bad ``nbytes`` or ``classes_per_doubling``, naming it.
    """
    n = check_nbytes(nbytes)
    k = check_classes_per_doubling(classes_per_doubling)
    if n <= SMALL_MAX:
        return max(ALIGN, -(-n // ALIGN) * ALIGN)
    p = 1 << ((n - 1).bit_length() - 1)      # p < n <= 2p
    j = -(-(n - p) * k // p)                 # least j with p + j*p/k >= n
    # rounding class j-1 up to 512 B may already cover n (p/k >= 16 KiB: one step at most)
    if j > 1 and _klass(p, j - 1, k) >= n:
        j -= 1
    return _klass(p, j, k)


def _klass(p: int, j: int, k: int) -> int:
    """The j-th of the k classes between p and 2p."""
    cls = p + -(-j * p // k)
    return -(-cls // ALIGN) * ALIGN
