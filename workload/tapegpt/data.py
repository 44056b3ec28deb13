"""The shipped byte-level corpus and a deterministic, rank-splittable batch sampler."""
import importlib.resources
import pathlib

import numpy as np

CORPUS_RESOURCE = "corpus.txt"   # package data of tapegpt: it installs with the workload


def load_corpus(path=None):
    """The corpus bytes as a NumPy uint8 array (default: the corpus shipped inside tapegpt)."""
    if path is None:
        resource = importlib.resources.files("tapegpt") / CORPUS_RESOURCE
        return np.frombuffer(resource.read_bytes(), dtype=np.uint8)
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"corpus not found at {path}; one ships inside tapegpt (regenerate with "
            f"`python scripts/make_corpus.py`)")
    return np.frombuffer(path.read_bytes(), dtype=np.uint8)


def batch_starts(n_tokens, batch_size, block_size, step, seed=0, rank=0, world=1):
    """Window start offsets for this rank: its slice of the global batch drawn from (seed, step)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} outside world of size {world}")
    if n_tokens < block_size + 2:
        raise ValueError(f"corpus of {n_tokens} tokens is too short for block_size {block_size}")
    # The global batch depends only on (seed, step, batch_size * world): any split sees the same rows.
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, n_tokens - block_size, size=batch_size * world)
    return starts[rank * batch_size:(rank + 1) * batch_size]


def get_batch(data, batch_size, block_size, step, seed=0, xp=np, rank=0, world=1):
    """(x, y) int64 xp arrays of shape (batch_size, block_size); y is x shifted by one token."""
    starts = batch_starts(len(data), batch_size, block_size, step, seed, rank, world)
    rows = np.asarray(data)[starts[:, None] + np.arange(block_size + 1)].astype(np.int64)
    rows = xp.asarray(rows)  # one host-to-device copy per batch, then two device-side slices
    return xp.ascontiguousarray(rows[:, :-1]), xp.ascontiguousarray(rows[:, 1:])
