"""Kernel launches and cuBLAS calls that keep the GIL: the dispatch path of the fused model on CuPy (issue 13).

CuPy releases the GIL around every driver call (`with nogil: cuLaunchKernel(...)`). With one thread that costs
little; with one thread per GPU, a waiting thread is woken at every launch and the threads trade the lock
hundreds of times a step, and two threads together dispatch less than one alone (data/gil_probe.csv: an empty
launch through CuPy, 2 threads: 0.68x one thread's launches per second; through ctypes.PyDLL with the GIL
held: 1.07x). This module launches the model's kernels with cuLaunchKernel and calls cuBLAS through
`ctypes.PyDLL`, which keeps the GIL for the call: a few microseconds, after which the thread goes on
dispatching. The kernel's arguments go into C values typed from the kernel's parameter list, parsed once from
its source, and cuLaunchKernel takes their addresses (kernelParams).

The price: a call that blocks keeps the GIL while it blocks. cuLaunchKernel blocks when the device's launch
queue is full, so a thread that runs far ahead of its GPU would stall the other rank threads (and, behind a
collective that waits for a peer, deadlock them). The training loops keep at most two steps in flight
(xlab.experiments.train.AHEAD), far below the queue's depth.

`direct` (environment TAPEGPT_LAUNCH=cupy turns it off) selects this path; off, every launch and cuBLAS call
goes through CuPy as before. The kernels and cuBLAS routines are the same either way, so are the results.
"""
import ctypes
import re

import numpy as np

from .switches import env_choice

LAUNCH_ENV = "TAPEGPT_LAUNCH"
MODES = {"direct": "GIL kept", "cupy": "CuPy's launches"}


def _mode_from_env():
    return env_choice(LAUNCH_ENV, MODES, "direct")


direct = _mode_from_env() == "direct"

# --- kernel parameters: the C parameter list as type codes

_SCALARS = {"long long": "q", "i64": "q", "int": "i", "unsigned int": "I", "float": "f", "double": "d",
            "size_t": "Q"}


def signature(source: str, name: str, real: str) -> str:
    """The type codes of kernel `name`'s parameters in `source`.

    Args:
        source: CUDA source holding `extern "C" __global__ void name(...)`.
        name: the kernel.
        real: the C type of `T` in this build ("float" or "double").

    Returns:
        "@" and one code per parameter, in struct's letters (P pointer, q long long, i int, f float, d double).

    Raises:
        ValueError: no such kernel, or a parameter type this module does not know.
    """
    m = re.search(r'extern\s+"C"\s+__global__\s+void\s+' + re.escape(name) + r"\s*\(([^)]*)\)", source)
    if m is None:
        raise ValueError(f"kernel {name!r} not found in the source")
    codes = []
    for param in filter(None, (p.strip() for p in m.group(1).split(","))):
        if "*" in param:
            codes.append("P")
            continue
        ctype = " ".join(param.replace("const ", "").split()[:-1])
        ctype = real if ctype == "T" else ctype
        if ctype not in _SCALARS:
            raise ValueError(f"kernel {name!r}: parameter {param!r} has a type the launcher does not pack")
        codes.append(_SCALARS[ctype])
    return "@" + "".join(codes)


# --- the driver and cuBLAS, through ctypes.PyDLL (the GIL stays held during each call)

_lib = None     # (cupy, cuLaunchKernel, cublas functions or None), on first use


def _load():
    global _lib
    if _lib is None:
        import cupy
        from cupy_backends.cuda.api import runtime
        cuda = ctypes.PyDLL("libcuda.so.1")
        launch = cuda.cuLaunchKernel
        launch.restype = ctypes.c_int
        launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        _lib = (cupy, launch, _load_cublas(runtime.runtimeGetVersion() // 1000))
    return _lib


def _load_cublas(major):
    """cuBLAS's entry points by ctypes.PyDLL, or None where its library cannot be opened by name (CuPy's
    wrappers then serve). CuPy has loaded it already, so the name finds that same library."""
    from cupy_backends.cuda.libs import cublas as _cupy_cublas  # noqa: F401  (loads libcublas)
    try:
        lib = ctypes.PyDLL(f"libcublas.so.{major}")
    except OSError:
        return None
    p, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    set_stream = getattr(lib, "cublasSetStream_v2", None) or lib.cublasSetStream
    set_stream.argtypes, set_stream.restype = [p, p], i
    gemm_ex = lib.cublasGemmEx
    gemm_ex.argtypes = [p, i, i, i, i, i, p, p, i, i, p, i, i, p, p, i, i, i, i]
    gemm_ex.restype = i
    batched = {}
    for dt, fname in ((np.dtype(np.float32), "cublasSgemmStridedBatched"),
                      (np.dtype(np.float64), "cublasDgemmStridedBatched")):
        f = getattr(lib, fname)
        f.argtypes = [p, i, i, i, i, i, p, p, i, ll, p, i, ll, p, p, i, ll, i]
        f.restype = i
        batched[dt] = f
    return set_stream, gemm_ex, batched


def _check(status, what):
    if status:
        raise RuntimeError(f"{what} failed: status {status}")


_SLOT = {"P": ctypes.c_void_p, "q": ctypes.c_longlong, "i": ctypes.c_int, "I": ctypes.c_uint,
         "f": ctypes.c_float, "d": ctypes.c_double, "Q": ctypes.c_size_t}


class Kernel:
    """A compiled kernel (CuPy's Function), launched with the GIL held when `direct`, else by CuPy.

    Args:
        function: `cupy.RawModule(...).get_function(name)` (a RawKernel; its `.kernel` is the loaded CUDA
            function, `.kernel.ptr` the CUfunction) on the device it will run on, or a Function with `.ptr`.
        fmt: its parameters' struct format (`signature`): one code per parameter.
    """

    def __init__(self, function, fmt):
        self.function = function
        self._ptr = None                 # the CUfunction, looked up at the first direct launch (loads the module)
        self.codes = fmt.lstrip("@")
        self.is_pointer = tuple(c == "P" for c in self.codes)
        # One C value per parameter and the array of their addresses cuLaunchKernel takes (kernelParams): the
        # driver reads each at the size the kernel declares. One set per kernel is enough: filling and launching
        # happen under the GIL with no release between, and cuLaunchKernel has copied the values when it returns.
        self.slots = [_SLOT[c]() for c in self.codes]
        self.params = (ctypes.c_void_p * max(1, len(self.slots)))(*[ctypes.addressof(v) for v in self.slots])

    def __call__(self, grid, block, args, shared_mem=0):
        if not direct:
            return self.function(grid, block, args, shared_mem=shared_mem)
        cupy, launch, _ = _load()
        if len(args) != len(self.slots):
            raise TypeError(f"kernel takes {len(self.slots)} arguments, got {len(args)}")
        for slot, pointer, value in zip(self.slots, self.is_pointer, args):
            slot.value = value.data.ptr if pointer else value
        if self._ptr is None:
            f = self.function
            self._ptr = f.ptr if hasattr(f, "ptr") else f.kernel.ptr
        gx, gy, gz = (tuple(grid) + (1, 1))[:3]
        bx, by, bz = (tuple(block) + (1, 1))[:3]
        _check(launch(self._ptr, gx, gy, gz, bx, by, bz, shared_mem, cupy.cuda.get_current_stream().ptr,
                      self.params, None), "cuLaunchKernel")


def cublas():
    """(cupy, (setStream, gemmEx, {dtype: gemmStridedBatched})) to call with the GIL held; None when `direct` is
    off or cuBLAS could not be opened by name. What gemm_ex and gemm_strided_batched take as `lib`."""
    if not direct:
        return None
    cupy, _, lib = _load()
    return None if lib is None else (cupy, lib)


def gemm_ex(lib, handle, transa, transb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc, cuda_type, compute, algo):
    """cublasGemmEx on the current stream with the GIL held (the arguments as cuBLAS's, types shared)."""
    cupy, (set_stream, gemm, _) = lib
    _check(set_stream(handle, cupy.cuda.get_current_stream().ptr), "cublasSetStream")
    _check(gemm(handle, transa, transb, m, n, k, alpha, a, cuda_type, lda, b, cuda_type, ldb, beta, c, cuda_type,
                ldc, compute, algo), "cublasGemmEx")


def gemm_strided_batched(lib, dtype, handle, transa, transb, m, n, k, alpha, a, lda, sa, b, ldb, sb, beta, c, ldc,
                         sc, batch):
    """cublas[SD]gemmStridedBatched on the current stream with the GIL held."""
    cupy, (set_stream, _, batched) = lib
    _check(set_stream(handle, cupy.cuda.get_current_stream().ptr), "cublasSetStream")
    _check(batched[dtype](handle, transa, transb, m, n, k, alpha, a, lda, sa, b, ldb, sb, beta, c, ldc, sc, batch),
           "cublasGemmStridedBatched")
