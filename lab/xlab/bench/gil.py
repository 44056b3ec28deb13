"""What dispatching threads cost each other under one GIL: ops per second from 1, 2, 4 and 8 threads, per op kind
(the arms table's rows of framework "gil"); why and how: Note [GIL probe], below.

    python -m xlab.bench.gil [--trials 5] [--seconds 0.5] [--out data/gil_probe.csv]
"""
from __future__ import annotations

import argparse
import ctypes
import struct
import sys
import threading
import time

import pandas as pd

from xlab.paths import publish
from xlab.provenance import provenance

# Note [GIL probe]
# Thread-per-GPU training dispatches every op from Python, under one GIL. CuPy releases the GIL around each driver
# call (`with nogil: cuLaunchKernel(...)`), so a rank thread gives the GIL up at every launch; a peer thread waiting
# for it wakes, and the two trade the lock hundreds of times per step (the convoy effect). This probe measures that
# cost directly: each op runs in a loop for `seconds` on 1 thread, then on 2, 4 and 8 threads (thread t on GPU
# t mod #GPUs, each on its own stream), all threads sharing one timed window, and reports ops per second in all.
# Without contention N threads would do N times one thread's ops; pure Python work (`python`) can do at most 1x;
# below 1x, handing the GIL over costs more than it lets run in parallel.
# The ops (each one a training step dispatches hundreds of times), and what each holds of the GIL, are rows of the
# arms table (framework "gil"): pure Python; empty and 8-argument kernel launches through CuPy and through
# ctypes.PyDLL (GIL held; the 8 arguments packed by struct into cuLaunchKernel's CU_LAUNCH_PARAM_BUFFER_POINTER
# buffer); `x + x` on 1-element arrays; a 16x16 GEMM by tapegpt.blas, by ctypes.PyDLL on CuPy's cuBLAS handle, and
# by cupy.matmul. Trials interleave the arms; sys.getswitchinterval() is recorded and varied with
# --switch-intervals. Why tapegpt.launch keeps the GIL for its launches: its module docstring.
ARMS = ("python", "launch", "launch_gil", "launch8", "launch8_gil", "add", "gemm", "gemm_gil", "matmul")
TRIALS = 5
THREADS = (1, 2, 4, 8)
EMPTY = 'extern "C" __global__ void empty_kernel() {}'
EIGHT = ('extern "C" __global__ void eight(const float* a, const float* b, float* c, long long n, long long m, '
         'long long o, int f, float g) {}')
EIGHT_ARGS = struct.Struct("@PPPqqqif")     # the same parameters as a C struct: CUDA's kernel-parameter layout


def _python_op():
    x = 0
    for i in range(20):
        x += i
    return x


class _Rank:
    """One thread's device, stream and ops."""

    def __init__(self, cupy, device, n_devices):
        self.cupy = cupy
        self.device = device % n_devices
        with cupy.cuda.Device(self.device):
            self.stream = cupy.cuda.Stream(non_blocking=True)
            self.kernel = cupy.RawKernel(EMPTY, "empty_kernel")
            self.eight = cupy.RawKernel(EIGHT, "eight")
            with self.stream:
                self.x = cupy.ones(1, cupy.float32)
                self.a = cupy.ones((16, 16), cupy.float32)
                self.c = cupy.empty((16, 16), cupy.float32)
                self.kernel((1,), (1,), ())                 # compile and load on this device now
                self.eight((1,), (32,), self._eight_args())
            self.stream.synchronize()
            self.fn, self.fn8 = self.kernel.kernel.ptr, self.eight.kernel.ptr
        self.cu_launch = launch = ctypes.PyDLL("libcuda.so.1").cuLaunchKernel   # PyDLL: the GIL stays held
        launch.restype = ctypes.c_int
        launch.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
        # CU_LAUNCH_PARAM_BUFFER_POINTER, the buffer, CU_LAUNCH_PARAM_BUFFER_SIZE, its size, CU_LAUNCH_PARAM_END
        self.buf = ctypes.create_string_buffer(EIGHT_ARGS.size)
        self.size = ctypes.c_size_t(EIGHT_ARGS.size)
        self.extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(self.buf), 2, ctypes.addressof(self.size), 0)

    def _eight_args(self):
        import numpy as np
        return (self.a, self.a, self.c, np.int64(256), np.int64(16), np.int64(16), np.int32(1), np.float32(2.0))

    def _gemm_gil(self):
        from cupy_backends.cuda.api import runtime
        from cupy_backends.cuda.libs import cublas
        gemm = ctypes.PyDLL("libcublas.so." + str(runtime.runtimeGetVersion() // 1000)).cublasGemmEx
        gemm.restype = ctypes.c_int
        mat = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        gemm.argtypes = [ctypes.c_void_p] + [ctypes.c_int] * 5 + [ctypes.c_void_p] + mat * 2 + [ctypes.c_void_p] \
            + mat + [ctypes.c_int] * 2
        h = self.cupy.cuda.device.get_cublas_handle()
        cublas.setStream(h, self.stream.ptr)
        one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        p1, p0 = ctypes.addressof(one), ctypes.addressof(zero)
        t, ct, algo, op_n = runtime.CUDA_R_32F, cublas.CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT_TENSOR_OP, 0
        a, c = self.a.data.ptr, self.c.data.ptr

        def op():
            if gemm(h, op_n, op_n, 16, 16, 16, p1, a, t, 16, a, t, 16, p0, c, t, 16, ct, algo) != 0:
                raise RuntimeError("cublasGemmEx failed")
        op.keep = (one, zero)
        return op

    def op(self, arm):
        cupy, s = self.cupy, self.stream
        if arm == "python":
            return _python_op
        if arm == "launch":
            return lambda: self.kernel((1,), (1,), ())
        if arm == "launch_gil":
            fn, ptr, launch = self.fn, s.ptr, self.cu_launch

            def op():
                if launch(fn, 1, 1, 1, 1, 1, 1, 0, ptr, None, None) != 0:
                    raise RuntimeError("cuLaunchKernel failed")
            return op
        if arm == "launch8":
            return lambda: self.eight((1,), (32,), self._eight_args())
        if arm == "launch8_gil":
            fn, ptr, launch, pack, buf, extra = self.fn8, s.ptr, self.cu_launch, EIGHT_ARGS.pack_into, self.buf, self.extra
            a, c = self.a.data.ptr, self.c.data.ptr

            def op():
                pack(buf, 0, a, a, c, 256, 16, 16, 1, 2.0)
                if launch(fn, 1, 1, 1, 32, 1, 1, 0, ptr, None, extra) != 0:
                    raise RuntimeError("cuLaunchKernel failed")
            return op
        if arm == "gemm_gil":
            return self._gemm_gil()
        if arm == "add":
            return lambda: self.x + self.x
        if arm == "gemm":
            from tapegpt import blas
            return lambda: blas.mm(self.a, self.a)
        if arm == "matmul":
            return lambda: cupy.matmul(self.a, self.a)
        raise ValueError(f"unknown arm {arm!r}; known: {', '.join(ARMS)}")


def _run(ranks, arm, seconds):
    """Every rank's thread runs `arm` for `seconds`; returns (total ops, per-thread CPU seconds)."""
    counts, cpu, errors = [0] * len(ranks), [0.0] * len(ranks), []
    deadline = [0.0]     # one window for every thread, set as they meet: a thread that waits for the GIL
    # loses its time; it does not get a window of its own later (which would count more than `seconds` of work)
    start = threading.Barrier(len(ranks), action=lambda: deadline.__setitem__(0, time.perf_counter() + seconds),
                              timeout=60)

    def body(i):
        r = ranks[i]
        try:
            with r.cupy.cuda.Device(r.device), r.stream:
                op = r.op(arm)
                for _ in range(50):
                    op()
                r.stream.synchronize()
                start.wait()
                c0, n, t_end = time.thread_time(), 0, deadline[0]
                while time.perf_counter() < t_end:
                    for _ in range(32):
                        op()
                    n += 32
                r.stream.synchronize()
                counts[i], cpu[i] = n, time.thread_time() - c0
        except BaseException as e:          # a failing op must fail the probe, not count as zero ops
            errors.append(e)
            start.abort()

    threads = [threading.Thread(target=body, args=(i,)) for i in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return sum(counts), cpu


def run(arms=ARMS, trials=TRIALS, seconds=0.5, switch_intervals=(None,), threads=THREADS,
        out="data/gil_probe.csv") -> pd.DataFrame:
    """Per (trial, switch interval, arm, threads): ops per second, and the speedup over 1 thread (same trial)."""
    import cupy
    bad = [a for a in arms if a not in ARMS]
    if bad:
        raise ValueError(f"unknown arms {bad}; known: {', '.join(ARMS)}")
    counts = sorted({1, *threads})
    if counts[0] < 1:
        raise ValueError(f"threads must be positive, got {threads}")
    n_dev = cupy.cuda.runtime.getDeviceCount()
    ranks = [_Rank(cupy, d, n_dev) for d in range(counts[-1])]
    default = sys.getswitchinterval()
    rows = []
    try:
        for trial in range(trials):
            for si in switch_intervals:
                sys.setswitchinterval(default if si is None else si)
                for arm in arms:
                    one = None
                    for n in counts:
                        ops, cpu = _run(ranks[:n], arm, seconds)
                        rate = ops / seconds
                        one = rate if n == 1 else one
                        rows.append(dict(arm=arm, threads=n, trial=trial, switch_interval_s=sys.getswitchinterval(),
                                         ops_per_s=rate, speedup=rate / one, us_per_op=1e6 * seconds / ops * n,
                                         cpu_s_per_thread=sum(cpu) / n, devices=min(n, n_dev), seconds=seconds))
    finally:
        sys.setswitchinterval(default)
    return publish(pd.DataFrame(rows).assign(**provenance(bench="gil", trials=trials)), out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", nargs="+", default=list(ARMS))
    ap.add_argument("--trials", type=int, default=TRIALS)
    ap.add_argument("--seconds", type=float, default=0.5)
    ap.add_argument("--threads", nargs="+", type=int, default=list(THREADS))
    ap.add_argument("--switch-intervals", nargs="+", type=float, default=None,
                    help="values for sys.setswitchinterval, seconds (default: Python's)")
    ap.add_argument("--out", default="data/gil_probe.csv")
    args = ap.parse_args(argv)
    df = run(args.arms, args.trials, args.seconds, tuple(args.switch_intervals or (None,)), tuple(args.threads),
             args.out)
    summary = df.groupby(["switch_interval_s", "arm", "threads"])[["ops_per_s", "speedup", "us_per_op"]].median()
    print(summary.to_string())


if __name__ == "__main__":
    main()
