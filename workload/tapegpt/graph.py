"""A training step's forward and backward pass replayed as one CUDA graph (issue 13).

Dispatching a step costs the host ~13 ms (413 kernel launches and cuBLAS calls, each through Python), which at
small batches is more than the GPU's work, and under one GIL two rank threads cannot overlap it. A CUDA graph
records those launches once and replays them with one `cudaGraphLaunch`: the host's work per step becomes the
batch's copy, one launch, and whatever runs outside the graph (the all-reduce, the optimizer).

What capture needs from the allocator is the reason this lives beside a pool. A graph bakes in every address its
kernels touch, so the blocks it used must stay its own for as long as it lives: the step is captured with a
*private pool* as this thread's allocator (`cupy.cuda.using_allocator`), a pool nothing else allocates from
(PyTorch's graph pools do the same). Capture itself must not call the device's allocator: cudaFree synchronises,
which a capturing stream forbids. So the step runs once on the capture stream with the private pool before it is
captured, which fills the pool (and compiles every kernel); the captured run then takes only cached blocks. An
allocator with no cache (raw cudaMalloc) cannot do this, which is why the experiments' graph arms are pools.

Inside the capture, a block the tape frees is reused by a later op of the same step: safe, because the captured
work is one stream's chain, replayed in order. The step's outputs (loss and gradients) are static arrays of the
private pool: each replay overwrites them, so a caller consumes them (all-reduce, optimizer) before the next
replay, on the same stream, as a training loop does.

Math and kernels are the eager step's, with the same arguments in the same order: the results are bit-identical
(a GPU test compares loss curves bit for bit).
"""
from __future__ import annotations

import gc

import numpy as np

from .tape import array_module


class CapturedStep:
    """`model.loss_and_grads(x, y)`, captured once as a CUDA graph and replayed.

    Args:
        model: a tapegpt GPT on CuPy; its parameters must stay where they are (AdamW updates them in place).
        malloc: the private pool's allocation function (e.g. `xpool.MemoryPool().malloc` or
            `cupy.cuda.MemoryPool().malloc`), used for the step's arrays only: nothing else may allocate from it
            while the graph lives.
        warmup: eager runs on the capture stream before capture (they fill the private pool); at least 1.

    Calling it with (x, y) returns (loss, grads) as `model.loss_and_grads` does; the arrays are the graph's own
    and are overwritten by the next call. The first call captures (one warm-up run, one captured); every call
    after it copies x and y into the graph's input arrays and replays the graph on the current stream.

    Raises:
        ValueError: `warmup` below 1; later, x or y not of the captured shape and dtype (naming which).
        TypeError: the model is not on CuPy (NumPy has no graphs).
    """

    def __init__(self, model, malloc, warmup: int = 1):
        if int(warmup) < 1:
            raise ValueError(f"warmup must be at least 1 (it fills the private pool before capture), got {warmup}")
        if getattr(model, "xp", np) is np:
            raise TypeError("CapturedStep needs a model on CuPy (GPT(xp=cupy)); NumPy has no CUDA graphs")
        self.model, self.malloc, self.warmup = model, malloc, int(warmup)
        self.graph = None
        self._x = self._y = self._loss = self._grads = None

    def __call__(self, x, y):
        if self.graph is None:
            self._capture(x, y)
        for name, given, static in (("x", x, self._x), ("y", y, self._y)):
            if given.shape != static.shape or given.dtype != static.dtype:
                raise ValueError(f"{name} has shape {given.shape} and dtype {given.dtype}; the step was captured "
                                 f"for {static.shape} {static.dtype} (capture another CapturedStep for it)")
        xp = array_module(x)
        xp.copyto(self._x, x)
        xp.copyto(self._y, y)
        self.graph.launch(stream=xp.cuda.get_current_stream())
        return self._loss, self._grads

    def _capture(self, x, y):
        cupy = array_module(x)
        main = cupy.cuda.get_current_stream()
        self._x, self._y = cupy.empty_like(x), cupy.empty_like(y)     # the graph's inputs, from the caller's pool
        side = cupy.cuda.Stream(non_blocking=True)                    # capture needs a stream other than the legacy one
        side.wait_event(main.record())                                # after the parameters' last update
        collecting = gc.isenabled()
        with cupy.cuda.using_allocator(self.malloc), side:
            cupy.copyto(self._x, x)
            cupy.copyto(self._y, y)
            for _ in range(self.warmup):
                out = self.model.loss_and_grads(self._x, self._y)
                del out
            # Free every block the warm-up left to the collector (tape cycles), then keep the collector out of the
            # capture: a block it freed mid-capture would be one the capture cannot count on having.
            gc.collect()
            gc.disable()
            try:
                side.begin_capture()
                try:
                    self._loss, self._grads = self.model.loss_and_grads(self._x, self._y)
                finally:
                    graph = side.end_capture()     # ends the capture even when the step raised
            finally:
                if collecting:
                    gc.enable()
        graph.upload(side)
        main.wait_event(side.record())
        self.graph = graph

    @property
    def captures(self) -> int:
        """Graphs captured so far: 1 after the first call (a CapturedStep captures once), else 0."""
        return int(self.graph is not None)
