"""Record the GPT's requests on the CPU, through NumPy's own allocation hook, for `xlab.memory_study` to replay.

`NumpyRecorder` routes NumPy's array data through libc and notes each malloc and free; `record_numpy_timeline`
trains the GPT on NumPy under it (setup, then one step per sequence length), optionally with the fused ops taking
their CuPy branch over NumPy arrays (the GPU's requests). The traces of NUMPY_TRACES are the committed files
`data/memory_trace_numpy_*.csv.gz` and `data/memory_trace_cupy_path_*.csv.gz` (xlab.memory_study.TRACES), each
row carrying its settings and provenance.

    python -m xlab.numpy_traces                     # CPU, ~5 min: every trace of NUMPY_TRACES into data/
    python -m xlab.numpy_traces --names gpt_b4_numpy --out-dir build/traces

The keep-previous-step traces (`data/memory_trace_cupy_path_b32{,_perparam}_keep.csv.gz`, at 449409c) are
`record_numpy_timeline(batch=32, block_sizes=(256,) * 10, cupy_path=True, keep_previous=True)` (and
`foreach=False`), written with their settings but outside NUMPY_TRACES: the scheme study does not replay them.
"""
from __future__ import annotations

import argparse
import ctypes
import pathlib

import numpy as np
import pandas as pd

from tapegpt import fused, kernels, load_corpus
from xlab.memory_study import TIMELINE_COLUMNS, TRACES, VARLEN, _config, _train
from xlab.paths import write_csv
from xlab.provenance import provenance

NUMPY_TRACES = {   # name -> record_numpy_timeline arguments
    "gpt_b4_numpy": dict(batch=4, block_sizes=(256,) * 10),
    "gpt_b32_numpy": dict(batch=32, block_sizes=(256,) * 10),
    "gpt_varlen_numpy": dict(batch=8, block_sizes=VARLEN),
    # per-parameter AdamW remakes every moment array each step (m, v: fresh arrays, the old ones freed after):
    # the arrays walk through memory: the late device mallocs no release rule removes
    "gpt_b32_perparam_numpy": dict(batch=32, block_sizes=(256,) * 10, foreach=False),
    # the fused ops' CuPy branch over NumPy, kernels not run (record_numpy_timeline(cupy_path=True)): the GPU's
    # requests, which the traces above (NumPy formulas, their temporaries) do not show
    "gpt_b4_cupy_path_numpy": dict(batch=4, block_sizes=(256,) * 10, cupy_path=True),
    "gpt_b32_cupy_path_numpy": dict(batch=32, block_sizes=(256,) * 10, cupy_path=True),
    "gpt_b32_perparam_cupy_path_numpy": dict(batch=32, block_sizes=(256,) * 10, foreach=False, cupy_path=True),
    "gpt_varlen_cupy_path_numpy": dict(batch=8, block_sizes=VARLEN, cupy_path=True),
}


class _NumpyHandler(ctypes.Structure):
    """NumPy's PyDataMem_Handler (numpy/ndarraytypes.h, version 1)."""

    MALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    CALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t)
    REALLOC = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    _fields_ = [("name", ctypes.c_char * 127), ("version", ctypes.c_uint8), ("ctx", ctypes.c_void_p),
                ("malloc", MALLOC), ("calloc", CALLOC), ("realloc", REALLOC), ("free", FREE)]


_SET_HANDLER = 304              # PyDataMem_SetHandler's slot in NumPy's C API table (NumPy >= 1.22)
_recorders: list = []           # kept for the life of the process: arrays made under one call it when they die


class NumpyRecorder:
    """Records every NumPy data allocation and free made inside `with` as (is_alloc, ptr, nbytes) events.

    NumPy's own allocation policy hook (PyDataMem_SetHandler) routes array data through libc's malloc/free
    here; each call appends one event.  A NumPy program's requests stand in for a device's: the same
    arrays, in the same order (NumPy, unlike CuPy, reuses some temporaries in place)."""

    def __init__(self):
        libc = ctypes.CDLL(None)
        libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
        libc.calloc.restype, libc.calloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t, ctypes.c_size_t]
        libc.realloc.restype, libc.realloc.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        self.events: list[tuple[int, int, int]] = []
        self.on = False
        ev = self.events

        def malloc(ctx, n):
            p = libc.malloc(n or 1)
            if self.on and p:
                ev.append((1, p, n))
            return p

        def calloc(ctx, count, size):
            p = libc.calloc(count or 1, size or 1)
            if self.on and p:
                ev.append((1, p, count * size))
            return p

        def realloc(ctx, p, n):
            q = libc.realloc(p, n or 1)
            if self.on and q:
                if p:
                    ev.append((0, p, 0))
                ev.append((1, q, n))
            return q

        def free(ctx, p, n):
            if p:
                if self.on:
                    ev.append((0, p, n))
                libc.free(p)

        H = _NumpyHandler
        self._handler = H(b"xpool_recorder", 1, None, H.MALLOC(malloc), H.CALLOC(calloc), H.REALLOC(realloc),
                          H.FREE(free))
        get_ptr = ctypes.pythonapi.PyCapsule_GetPointer
        get_ptr.restype, get_ptr.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
        table = ctypes.cast(get_ptr(np._core._multiarray_umath._ARRAY_API, None), ctypes.POINTER(ctypes.c_void_p))
        self._set = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.py_object)(table[_SET_HANDLER])
        new = ctypes.pythonapi.PyCapsule_New
        new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
        self._capsule = new(ctypes.addressof(self._handler), b"mem_handler", None)
        _recorders.append(self)

    def __enter__(self):
        self.on = True
        self._previous = self._set(self._capsule)
        return self

    def __exit__(self, *exc):
        self._set(self._previous)
        self.on = False


def record_numpy_timeline(batch: int = 4, block_sizes=(256, 256), seed: int = 0, foreach: bool = True,
                          config=None, cupy_path: bool = False, keep_previous: bool = False) -> pd.DataFrame:
    """CPU: the request timeline of the GPT trained on NumPy (setup: step -1, then a step per entry of `block_sizes`),
    NumPy's data allocations on device 0, stream 0. cupy_path: the fused ops take their CuPy branch over NumPy arrays,
    every kernel launch a no-op, so the outputs they allocate are the GPU's and the NumPy formulas' temporaries are
    gone: the GPU step's requests (up to CuPy's own temporaries), which the plain NumPy path missed at batch 4 (#14).
    keep_previous: a step's x, y, loss and grads live on while the next step runs (rebound, not deleted, as
    ordinary training loops do)."""
    cfg = _config(config, batch, block_sizes)
    if cupy_path:
        saved = fused._on_host, kernels.kernel
        fused._on_host, kernels.kernel = (lambda a: False), (lambda name, dtype: lambda *args: None)
        try:
            with np.errstate(all="ignore"):
                return record_numpy_timeline(batch, block_sizes, seed, foreach, cfg, keep_previous=keep_previous)
        finally:
            fused._on_host, kernels.kernel = saved
    data = load_corpus()
    rec = NumpyRecorder()
    marks = []
    with rec:
        model, opt = _train(cfg, data, block_sizes, np, seed, foreach, lambda: marks.append(len(rec.events)),
                            keep_previous)
        del model, opt            # nothing made under the recorder outlives it
    ev = np.array(rec.events[:marks[-1]], dtype=np.int64).reshape(-1, 3)
    step = np.searchsorted(np.asarray(marks), np.arange(len(ev)), side="right") - 1
    out = pd.DataFrame({"step": step, "t_s": 0.0, "device": 0,
                        "event": np.where(ev[:, 0] == 1, "alloc_miss", "free"), "stream": 0, "ptr": ev[:, 1],
                        "requested": np.where(ev[:, 0] == 1, ev[:, 2], 0), "size": ev[:, 2],
                        "bytes_in_use": 0, "bytes_cached": 0, "bytes_reserved": 0})
    return out[TIMELINE_COLUMNS]


def record_numpy_traces(data_dir="data", names=None) -> dict:
    """CPU: records the NumPy traces of NUMPY_TRACES into data_dir (gzipped CSV, provenance per row)."""
    return {name: write_numpy_trace(record_numpy_timeline(**NUMPY_TRACES[name]), name, data_dir)
            for name in names or NUMPY_TRACES}


def write_numpy_trace(tl: pd.DataFrame, name: str, data_dir="data") -> pd.DataFrame:
    """Write a NUMPY_TRACES timeline to its file under data_dir, with provenance on every row."""
    kw = NUMPY_TRACES[name]
    cfg = _config(None, kw["batch"])
    prov = provenance(batch=cfg.batch_size, n_layer=cfg.n_layer, n_embd=cfg.n_embd, block_size=cfg.block_size,
                      block_sizes=" ".join(map(str, kw["block_sizes"])),
                      adamw="foreach" if kw.get("foreach", True) else "per_param",
                      fused_ops="cupy_path" if kw.get("cupy_path") else "numpy_formulas")
    tl = tl[["step", "event", "device", "stream", "ptr", "requested"]].assign(**prov)
    if prov["gpu"] == "none":
        tl["gpu"] = "none (NumPy on the CPU)"
    write_csv(tl, pathlib.Path(data_dir) / TRACES[name])
    return tl


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default="data", help="folder the traces go to (default: data)")
    p.add_argument("--names", nargs="+", choices=list(NUMPY_TRACES), default=None, metavar="NAME",
                   help="the traces to record (default: all of NUMPY_TRACES)")
    a = p.parse_args(argv)
    for name, tl in record_numpy_traces(a.out_dir, a.names).items():
        print(f"{name}: {len(tl)} events -> {pathlib.Path(a.out_dir) / TRACES[name]}")


if __name__ == "__main__":
    main()
