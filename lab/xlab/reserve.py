"""A reserve up front: make the device hold a program's peak as one free block before its first step.

A study of the lab, not a rule for every program (so not a method of xpool's Pool): on the ResNets at varying image
sizes (data/reserve_replay.csv), 1.03 times the peak under scheme expandable made no device call in steady state on
any seed where the pool made 1-4 without.

    from xlab.reserve import reserve
    reserve(pool, int(1.03 * dry_run_peak))     # before the first step
"""
from __future__ import annotations

import numbers


def reserve(pool, nbytes: int, device: int = 0, stream: int = 0) -> int:
    """Make the device hold ``nbytes`` for the program in all: the bytes in use now and one free block of the rest.

    The block, ``nbytes`` less the device's bytes in use, is allocated and given back (under scheme expandable its
    pages stay mapped as one free run; under segments it is one cached segment), then the peak gauges are reset, so
    nothing counts the reservation as a request. Like any cached memory, ``empty_cache``/``trim`` and the
    out-of-memory ladder may give it back.

    Args:
        pool: an ``xpool.Pool`` (or ``MemoryPool``).
        nbytes (int): bytes the device should hold for the program, those in use included.
        device (int): the device.
        stream (int): the stream handle the program allocates on (a block is reused only on its stream).

    Returns:
        int: the bytes of the block taken (rounded up as a request of that size is), 0 when none was.

    Raises:
        ValueError: bad ``nbytes``, ``device`` or ``stream``.
        xpool.OutOfMemoryError: the device or the limit refused the block; nothing is kept or reset.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Integral) or nbytes <= 0:
        raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
    rest = int(nbytes) - pool.stats(device)["bytes_in_use"]       # stats() checks the device
    if rest <= 0:
        return 0
    block = pool.allocate(rest, device, stream)
    size = block.size
    block.release()
    pool.reset_peak_stats(device)
    return size
