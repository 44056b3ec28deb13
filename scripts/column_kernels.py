"""GPU time of the one-launch column kernels against the two-launch forms they replaced (issue 13), on one GPU:
    python scripts/column_kernels.py [--trials 7] [--reps 50] [--out data/column_kernels.csv]

Arms per shape, interleaved in every trial: colsum (one pass) vs two passes (chunks of rows, then the chunks);
layer norm's dw and db (one pass) vs partial sums then their sum; GELU backward with the bias gradient (one
kernel) vs the elementwise backward then a two-pass column sum; AdamW's update, one kernel vs the array code
(reference model's parameter count). Each row: microseconds of GPU time per call (CUDA events around `reps`
calls queued behind a spinning kernel, so the host's dispatch is not timed), one row per trial and arm; the
table printed is the median with the range over trials.
"""
import argparse
import math

import cupy
import numpy as np
import pandas as pd

from tapegpt import fused, kernels
from tapegpt.model import GPTConfig, param_shapes

# The kernels these replaced (tapegpt/kernels.py before the one-pass column kernels), for the comparison only.
BASELINE = r"""
typedef long long i64;
#define ELEM_LOOP for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)

extern "C" __global__ void ln_param_partial(const T* g, const T* x, const T* mean, const T* rstd, T* out,
                                            i64 n_rows, i64 C, i64 rows_per_chunk) {
    const i64 col = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= C) return;
    const i64 r0 = (i64)blockIdx.y * rows_per_chunk;
    const i64 r1 = r0 + rows_per_chunk < n_rows ? r0 + rows_per_chunk : n_rows;
    T sw = 0, sb = 0;
    #pragma unroll 4
    for (i64 r = r0; r < r1; ++r) {
        T gv = g[r * C + col];
        sw += gv * ((x[r * C + col] - mean[r]) * rstd[r]);
        sb += gv;
    }
    out[(i64)blockIdx.y * 2 * C + col] = sw;
    out[(i64)blockIdx.y * 2 * C + C + col] = sb;
}

extern "C" __global__ void colsum_partial(const T* a, T* out, i64 n_rows, i64 C, i64 rows_per_chunk) {
    const i64 col = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= C) return;
    const i64 r0 = (i64)blockIdx.y * rows_per_chunk;
    const i64 r1 = r0 + rows_per_chunk < n_rows ? r0 + rows_per_chunk : n_rows;
    T s = 0;
    #pragma unroll 4
    for (i64 r = r0; r < r1; ++r) s += a[r * C + col];
    out[(i64)blockIdx.y * C + col] = s;
}

// Keeps the GPU busy for `cycles` clocks, so the launches queued behind it run back to back when it ends.
extern "C" __global__ void spin(i64 cycles) {
    const long long t0 = clock64();
    while (clock64() - t0 < cycles) { }
}

extern "C" __global__ void bias_gelu_bwd(const T* g, const T* a, const T* b, T* du, i64 n, i64 C) {
    ELEM_LOOP {
        T u = a[i] + b[i % C];
        T t = tanh((T)0.7978845608028654 * (u + (T)0.044715 * u * u * u));
        T d = (T)0.7978845608028654 * ((T)1 + (T)(3 * 0.044715) * u * u);
        du[i] = g[i] * ((T)0.5 * ((T)1 + t) + (T)0.5 * u * ((T)1 - t * t) * d);
    }
}
"""
COL_BLOCK = 128


def _baseline():
    mod = cupy.RawModule(code="typedef float T;\n" + BASELINE)
    return {k: mod.get_function(k) for k in ("ln_param_partial", "colsum_partial", "bias_gelu_bwd", "spin")}


def _i64(*v):
    return tuple(map(np.int64, v))


def _chunking(n):
    rows = max(16, math.isqrt(n - 1) + 1) if n > 1 else 1
    return rows, -(-n // rows)


def _two_pass_colsum(k, a):
    n, c = a.shape
    rows, chunks = _chunking(n)
    if chunks == 1:                            # as the old colsum did: few rows took one launch
        out = cupy.empty((c,), a.dtype)
        k["colsum_partial"]((-(-c // COL_BLOCK), 1), (COL_BLOCK,), (a, out, *_i64(n, c, n)))
        return out
    part = cupy.empty((chunks, c), a.dtype)
    k["colsum_partial"]((-(-c // COL_BLOCK), chunks), (COL_BLOCK,), (a, part, *_i64(n, c, rows)))
    out = cupy.empty((c,), a.dtype)
    k["colsum_partial"]((-(-c // COL_BLOCK), 1), (COL_BLOCK,), (part, out, *_i64(chunks, c, chunks)))
    return out


def _arms(k, rows, cols):
    rng = cupy.random.default_rng(0)
    g, x, a = (rng.standard_normal((rows, cols), dtype=cupy.float32) for _ in range(3))
    w, b = (rng.standard_normal(cols, dtype=cupy.float32) for _ in range(2))
    _, mean, rstd = fused.layer_norm_fwd(x, w, b, 1e-5)

    def ln_two_pass():
        rows_, chunks = _chunking(rows)
        part = cupy.empty((chunks, 2 * cols), cupy.float32)
        k["ln_param_partial"]((-(-cols // COL_BLOCK), chunks), (COL_BLOCK,), (g, x, mean, rstd, part,
                                                                             *_i64(rows, cols, rows_)))
        return _two_pass_colsum(k, part)

    def ln_one_pass():
        dwb = cupy.empty((2, cols), cupy.float32)
        # dx and ds unused (has_dx 0): the layer norm's dw and db alone, as the two-pass arm computes
        kernels.kernel("ln_param", cupy.float32)(*kernels.col_grid(rows, cols), (g, x, mean, rstd, x, dwb[0], dwb[1],
                                                                                 dwb[0], *_i64(rows, cols),
                                                                                 np.int32(0)))

    def gelu_two_kernels():
        du = cupy.empty_like(a)
        k["bias_gelu_bwd"](*kernels.elem_grid(a.size), (g, a, b, du, *_i64(a.size, cols)))
        return _two_pass_colsum(k, du)

    return {("colsum", "one pass"): lambda: fused.colsum(g), ("colsum", "two passes"): lambda: _two_pass_colsum(k, g),
            ("ln dw db", "one pass"): ln_one_pass, ("ln dw db", "two passes"): ln_two_pass,
            ("gelu bwd + db", "one kernel"): lambda: fused.bias_gelu_bwd(g, a, b),
            ("gelu bwd + db", "elementwise + two passes"): gelu_two_kernels}


def _adamw_arms():
    n = sum(int(np.prod(s)) for s in param_shapes(GPTConfig()).values())
    rng = cupy.random.default_rng(1)
    p, m, g = (rng.standard_normal(n, dtype=cupy.float32) for _ in range(3))
    v = rng.standard_normal(n, dtype=cupy.float32) ** 2
    hyper = (n // 2, 1 - 3e-5, 0.9, 0.95, 3e-4, 0.5, 1e-8)
    return n, {("adamw", "one kernel"): lambda: fused.adamw(p, m, v, g, *hyper),
               ("adamw", "array code"): lambda: fused.adamw_formulas(p, m, v, g, *hyper)}


def _gpu_us(k, fn, reps):
    """GPU microseconds per call of fn: the calls are queued behind a kernel that spins long enough (200 us of
    dispatch a call, at 2 GHz) for all of them to be queued, so the events time the GPU's work, not the host's."""
    stream = cupy.cuda.get_current_stream()
    e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
    k["spin"]((1,), (32,), (np.int64(reps * 400_000),))
    e0.record(stream)
    for _ in range(reps):
        fn()
    e1.record(stream)
    e1.synchronize()
    return 1e3 * cupy.cuda.get_elapsed_time(e0, e1) / reps


def measure(trials=7, reps=50, shapes=((8192, 384), (8192, 1152), (8192, 1536), (1024, 384), (1024, 1536),
                                        (32, 256 * 384), (4, 256 * 384))):
    """One row per (shape, op, form, trial): GPU microseconds per call."""
    k = _baseline()
    cases = [((r, c), _arms(k, r, c)) for r, c in shapes]
    n, adam = _adamw_arms()
    cases.append(((n, 1), adam))
    for _, arms in cases:                      # compile and warm every arm first
        for fn in arms.values():
            _gpu_us(k, fn, 2)
    rows = []
    for trial in range(trials):
        for (r, c), arms in cases:
            for (op, form), fn in arms.items():
                rows.append(dict(op=op, form=form, rows=r, cols=c, trial=trial, gpu_us=_gpu_us(k, fn, reps)))
    return pd.DataFrame(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=7)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out", default=None, help="CSV to write (one row per trial and arm)")
    args = ap.parse_args(argv)
    df = measure(args.trials, args.reps)
    dev = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.Device().id)["name"].decode()
    df["gpu"] = dev
    table = df.groupby(["op", "rows", "cols", "form"], sort=False).gpu_us.agg(["median", "min", "max"]).round(2)
    print(f"{dev}: GPU microseconds per call, median (min, max) of {args.trials} interleaved trials")
    print(table.to_string())
    if args.out:
        df.to_csv(args.out, index=False)
    return df


if __name__ == "__main__":
    main()
