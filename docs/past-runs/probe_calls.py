"""Host cost of the calls a training step is made of, one at a time (a diagnostic for issue 13), and a cProfile of
the fused batch-4 step.  python docs/past-runs/probe_calls.py"""
import ctypes
import cProfile
import io
import pstats
import time

import cupy
import numpy as np
from cupy_backends.cuda.api import runtime
from cupy_backends.cuda.libs import cublas

from tapegpt import AdamW, GPT, GPTConfig, blas, get_batch, load_corpus


def per_call(fn, n=3000):
    for _ in range(200):
        fn()
    cupy.cuda.Device().synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = (time.perf_counter() - t0) / n
    cupy.cuda.Device().synchronize()
    return 1e6 * t


a = cupy.ones((64, 64), cupy.float32)
c = cupy.empty((64, 64), cupy.float32)
one, zero = np.ones(1, np.float32), np.zeros(1, np.float32)
h = cupy.cuda.device.get_cublas_handle()
s = cupy.cuda.get_current_stream().ptr
lib = ctypes.PyDLL("libcublas.so.13")
gemm_ex = lib.cublasGemmEx
gemm_ex.restype = ctypes.c_int
gemm_ex.argtypes = ([ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
                    + [ctypes.c_void_p, ctypes.c_int, ctypes.c_int] * 2 + [ctypes.c_void_p]
                    + [ctypes.c_void_p, ctypes.c_int, ctypes.c_int] + [ctypes.c_int, ctypes.c_int])
op, p1, p0 = cublas.CUBLAS_OP_N, one.ctypes.data, zero.ctypes.data
T, CT, ALGO = runtime.CUDA_R_32F, cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT_TENSOR_OP
k8 = cupy.RawKernel('extern "C" __global__ void k8(const float* a, const float* b, float* c, long long n, long long m, '
                    'long long o, int f, float g) {}', "k8")
i64 = np.int64(5)
rows = {
    "cupy.empty 64x64 f32": lambda: cupy.empty((64, 64), cupy.float32),
    "cublas.setStream (CuPy wrapper)": lambda: cublas.setStream(h, s),
    "cublas.gemmEx (CuPy wrapper: setStream + call, GIL released)": lambda: cublas.gemmEx(
        h, op, op, 64, 64, 64, p1, a.data.ptr, T, 64, a.data.ptr, T, 64, p0, c.data.ptr, T, 64, CT, ALGO),
    "cublasGemmEx by ctypes.PyDLL (no setStream, GIL held)": lambda: gemm_ex(
        h, op, op, 64, 64, 64, p1, a.data.ptr, T, 64, a.data.ptr, T, 64, p0, c.data.ptr, T, 64, CT, ALGO),
    "tapegpt.blas.mm 64x64": lambda: blas.mm(a, a),
    "cupy.matmul 64x64": lambda: cupy.matmul(a, a),
    "RawKernel, 8 args": lambda: k8((1,), (32,), (a, a, c, i64, i64, i64, np.int32(1), np.float32(2))),
    "a + a (alloc + elementwise)": lambda: a + a,
    "a.sum(axis=0)": lambda: a.sum(axis=0),
}
for name, fn in rows.items():
    print(f"{per_call(fn):8.2f} us  {name}")

for batch in (4,):
    cfg = GPTConfig(batch_size=batch)
    model = GPT(cfg, xp=cupy)
    opt = AdamW(model.params)
    data = load_corpus()
    bs = [get_batch(data, batch, cfg.block_size, i, xp=cupy) for i in range(8)]
    for x, y in bs[:3]:
        loss, g = model.loss_and_grads(x, y); opt.step(g)
    cupy.cuda.Device().synchronize()
    prof = cProfile.Profile()
    for x, y in bs[3:]:
        prof.enable()
        loss, g = model.loss_and_grads(x, y); opt.step(g)
        prof.disable()
        cupy.cuda.Device().synchronize()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(40)
    print(out.getvalue())
