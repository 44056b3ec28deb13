"""Size classes (scheme seed): how many bytes a request really takes; the checks of a byte count."""
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
    """Bytes scheme seed reserves for an ``nbytes`` request (the C core's function, its arguments checked here).

    Up to 1 MiB: the next multiple of 512 B (at least 512).  Above: with k classes per doubling, the classes between p
    and 2p (p a power of two) are p + j*p/k for j = 1..k, each rounded up to 512 B; k=1 is the next power of two.  k=4
    bounds the waste at 25 % of p, about 20 % of the class.

    Raises:
        ValueError: bad ``nbytes`` (0 to 2**48) or ``classes_per_doubling`` (1 to 64), naming it.
    """
    from . import _core
    return _core.size_class(check_nbytes(nbytes), check_classes_per_doubling(classes_per_doubling))
