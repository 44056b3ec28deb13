"""Matrix products on CuPy by direct cuBLAS calls: CuPy's matmul result at a fraction of its host cost.

`cupy.matmul` resolves broadcasting, dtypes and layouts through several Python-visible layers before its one
cuBLAS call, and a training step makes 220 of them (issue 13: the host's dispatch time per step).
`mm(a, b)` makes the cuBLAS call CuPy's matmul ends in (gemmEx with CuPy's algorithm and compute type, or a
strided-batched GEMM for stacked matrices) on the current stream, plus the output's allocation from CuPy's
allocator, like every other op. The math is the same (fp32 accumulation, no TF32, no atomics: deterministic on
one GPU), and so are the kernels: the results are CuPy's bit for bit (a GPU test checks it).

Row-major to column-major: cuBLAS sees a C-contiguous (r, c) matrix as its column-major transpose (c, r), so
C = A @ B is computed as C^T = B^T A^T with the operands swapped; a transposed operand (F-contiguous, such as
`w.T`) is passed with op T and no copy. Anything else (NumPy arrays, other dtypes, broadcast batch axes,
non-contiguous layouts) falls back to `a @ b`.

The call itself goes through tapegpt.launch (the GIL held, like the fused kernels' launches) unless that is
switched off (TAPEGPT_LAUNCH=cupy); then through CuPy's cuBLAS wrappers. `enabled` (environment TAPEGPT_BLAS=0
turns it off) selects this path at all; the lab records both switches with each row.
"""

import numpy as np

from . import launch
from .switches import env_choice

BLAS_ENV = "TAPEGPT_BLAS"


def _enabled_from_env():
    return env_choice(BLAS_ENV, {"0": "cupy.matmul", "1": "direct cuBLAS calls"}, "1") == "1"


enabled = _enabled_from_env()

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
# alpha = 1 and beta = 0 as host scalars (cuBLAS reads them during the call: host pointer mode)
_ONE = {dt: np.ones(1, dt) for dt in _FLOATS}
_ZERO = {dt: np.zeros(1, dt) for dt in _FLOATS}
_lib = None            # (cupy, cublas module, {dtype: (cuda type, compute type)}, algo), loaded on first use
_host_mode = set()     # cuBLAS handles already switched to host pointer mode (one per thread and device)
_ONE_PTR = {dt: a.ctypes.data for dt, a in _ONE.items()}
_ZERO_PTR = {dt: a.ctypes.data for dt, a in _ZERO.items()}


def _load():
    global _lib
    if _lib is None:
        import cupy
        from cupy_backends.cuda.api import runtime
        from cupy_backends.cuda.libs import cublas
        types = {_FLOATS[0]: (runtime.CUDA_R_32F, cublas.CUBLAS_COMPUTE_32F),
                 _FLOATS[1]: (runtime.CUDA_R_64F, cublas.CUBLAS_COMPUTE_64F)}
        # CuPy's matmul choice (cupy/_core/_routines_linalg.pyx, tensordot_core_v11): tensor-op algorithms from
        # compute capability 8.0, plain fp32 (or fp64) accumulation: the same kernels, so the same bits.
        major = int(cupy.cuda.Device().compute_capability[:-1])
        algo = cublas.CUBLAS_GEMM_DEFAULT_TENSOR_OP if major >= 8 else cublas.CUBLAS_GEMM_DEFAULT
        _lib = (cupy, cublas, types, algo)
    return _lib


def _handle(cupy, cublas):
    """This thread's cuBLAS handle for the current device (CuPy's: it sets the current stream on each call)."""
    h = cupy.cuda.device.get_cublas_handle()
    if h not in _host_mode:
        cublas.setPointerMode(h, cublas.CUBLAS_POINTER_MODE_HOST)
        _host_mode.add(h)
    return h


def _operand(x, rows, cols, ops):
    """(op, leading dimension) of matrix x (rows, cols) as cuBLAS's column-major operand x^T, or None."""
    if x.flags.c_contiguous:
        return ops[0], max(1, cols)
    if x.flags.f_contiguous:
        return ops[1], max(1, rows)
    return None


def mm(a, b):
    """a @ b for 2-D a (M, K) and b (K, N), or stacked (..., M, K) @ (..., K, N) with equal batch axes.

    Args:
        a, b: arrays of one module and dtype.

    Returns:
        A new C-contiguous array; on CuPy made by one cuBLAS call when the layout allows, else by `a @ b`.
    """
    if not enabled or isinstance(a, np.ndarray) or a.dtype != b.dtype or a.dtype not in _FLOATS:
        return a @ b
    if a.ndim == 2 and b.ndim == 2:
        return _gemm(a, b)
    if a.ndim > 2 and a.shape[:-2] == b.shape[:-2] and a.flags.c_contiguous and b.flags.c_contiguous:
        return _gemm_batched(a, b)
    return a @ b


def _gemm(a, b):
    (M, K), (K2, N) = a.shape, b.shape
    if K != K2:
        raise ValueError(f"matmul: shapes {a.shape} and {b.shape} do not align")
    cupy, cublas, types, algo = _load()
    ops = (cublas.CUBLAS_OP_N, cublas.CUBLAS_OP_T)
    pb, pa = _operand(b, K, N, ops), _operand(a, M, K, ops)
    if pb is None or pa is None or 0 in (M, N, K):
        return a @ b
    dt = a.dtype
    out = cupy.empty((M, N), dt)
    t, compute = types[dt]
    h = _handle(cupy, cublas)
    direct = launch.cublas()
    if direct:
        launch.gemm_ex(direct, h, pb[0], pa[0], N, M, K, _ONE_PTR[dt], b.data.ptr, pb[1], a.data.ptr, pa[1],
                       _ZERO_PTR[dt], out.data.ptr, N, t, compute, algo)
    else:
        cublas.gemmEx(h, pb[0], pa[0], N, M, K, _ONE_PTR[dt], b.data.ptr, t, pb[1],
                      a.data.ptr, t, pa[1], _ZERO_PTR[dt], out.data.ptr, t, N, compute, algo)
    return out


def _gemm_batched(a, b):
    M, K = a.shape[-2:]
    K2, N = b.shape[-2:]
    if K != K2:
        raise ValueError(f"matmul: shapes {a.shape} and {b.shape} do not align")
    batch = int(np.prod(a.shape[:-2]))
    if 0 in (M, N, K, batch):
        return a @ b
    cupy, cublas, types, algo = _load()
    dt, op_n = a.dtype, cublas.CUBLAS_OP_N
    out = cupy.empty(a.shape[:-2] + (M, N), dt)
    # CuPy's matmul makes this same call (sgemmStridedBatched/dgemmStridedBatched) for contiguous stacks
    args = (_handle(cupy, cublas), op_n, op_n, N, M, K, _ONE_PTR[dt], b.data.ptr, N, K * N,
            a.data.ptr, K, M * K, _ZERO_PTR[dt], out.data.ptr, N, M * N, batch)
    direct = launch.cublas()
    if direct:
        launch.gemm_strided_batched(direct, dt, *args)
    else:
        (cublas.sgemmStridedBatched if dt == _FLOATS[0] else cublas.dgemmStridedBatched)(*args)
    return out

