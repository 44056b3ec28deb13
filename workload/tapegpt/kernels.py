"""The CUDA kernels behind tapegpt.fused: one source, compiled once per (device, dtype, kernel) and cached.

Every kernel is deterministic: a reduction runs in a fixed order (a loop, a warp's shuffle tree to lane 0
that is then broadcast, so every lane uses the same bits, or a fixed tree in shared memory) and nothing uses
atomics, so a step's result does not depend on the allocator or on timing. Row kernels give each row one warp
(`ROW_BLOCK / 32` rows per block); the guard `row >= n_rows` is the same for all 32 lanes of a warp, so every
shuffle sees its whole warp.
Elementwise kernels give each element one thread; column kernels (column sums over rows) give a block a few
adjacent columns over all rows (see col_grid). Sizes are `long long` so no index can overflow.
"""
import functools
import threading

import numpy as np

from . import launch

ROW_BLOCK = 256   # threads per block of a row kernel: 8 rows (warps) per block
ELEM_BLOCK = 256  # threads per block of an elementwise kernel
COL_ROWS = 16     # rows per thread that a column kernel aims for (fewer row groups for short arrays)
COL_MAX_RY = 128  # row groups per block of a column kernel, at most (so at most 1024 threads, COL_MAX_THREADS)

SOURCE = r"""
typedef long long i64;

__device__ __forceinline__ T warp_sum(T v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_down_sync(0xffffffffu, v, o);
    return __shfl_sync(0xffffffffu, v, 0);
}

__device__ __forceinline__ T warp_max(T v) {
    for (int o = 16; o > 0; o >>= 1) { T u = __shfl_down_sync(0xffffffffu, v, o); v = u > v ? u : v; }
    return __shfl_sync(0xffffffffu, v, 0);
}

__device__ __forceinline__ T neg_inf() { return (T)(-__longlong_as_double(0x7ff0000000000000LL)); }

#define ROW_PROLOGUE \
    const i64 row = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; \
    const int lane = threadIdx.x & 31; \
    if (row >= n_rows) return;

#define ELEM_LOOP for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x)

// ---- layer norm over rows of length C: y = (x - mean) * rstd * w + b (biased variance, as torch)
extern "C" __global__ void ln_fwd(const T* x, const T* w, const T* b, T* y, T* mean, T* rstd,
                                  i64 n_rows, i64 C, T eps) {
    ROW_PROLOGUE
    const T* xr = x + row * C;
    T s = 0;
    for (i64 j = lane; j < C; j += 32) s += xr[j];
    const T mu = warp_sum(s) / (T)C;
    T v = 0;
    for (i64 j = lane; j < C; j += 32) { T d = xr[j] - mu; v += d * d; }
    const T rs = (T)1 / sqrt(warp_sum(v) / (T)C + eps);
    for (i64 j = lane; j < C; j += 32) y[row * C + j] = ((xr[j] - mu) * rs) * w[j] + b[j];
    if (lane == 0) { mean[row] = mu; rstd[row] = rs; }
}

// ---- the residual stream's next value and the layer norm that reads it, one pass over each row:
// r = x + (a + bias) (as bias_residual), then y, mean and rstd of r (as ln_fwd).
extern "C" __global__ void residual_ln_fwd(const T* x, const T* a, const T* bias, const T* w, const T* b, T* r,
                                           T* y, T* mean, T* rstd, i64 n_rows, i64 C, T eps) {
    ROW_PROLOGUE
    const i64 o = row * C;
    T s = 0;
    for (i64 j = lane; j < C; j += 32) { const T v = x[o + j] + (a[o + j] + bias[j]); r[o + j] = v; s += v; }
    const T mu = warp_sum(s) / (T)C;
    T v = 0;
    for (i64 j = lane; j < C; j += 32) { T d = r[o + j] - mu; v += d * d; }   // this lane's own writes
    const T rs = (T)1 / sqrt(warp_sum(v) / (T)C + eps);
    for (i64 j = lane; j < C; j += 32) y[o + j] = ((r[o + j] - mu) * rs) * w[j] + b[j];
    if (lane == 0) { mean[row] = mu; rstd[row] = rs; }
}

// dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)) with dxhat = g * w, plus acc when given.
extern "C" __global__ void ln_bwd(const T* g, const T* x, const T* w, const T* mean, const T* rstd,
                                  const T* acc, T* dx, i64 n_rows, i64 C, int has_acc) {
    ROW_PROLOGUE
    const i64 o = row * C;
    const T mu = mean[row], rs = rstd[row];
    T s1 = 0, s2 = 0;
    for (i64 j = lane; j < C; j += 32) {
        T xh = (x[o + j] - mu) * rs, dxh = g[o + j] * w[j];
        s1 += dxh; s2 += dxh * xh;
    }
    const T m1 = warp_sum(s1) / (T)C, m2 = warp_sum(s2) / (T)C;
    for (i64 j = lane; j < C; j += 32) {
        T xh = (x[o + j] - mu) * rs, dxh = g[o + j] * w[j];
        T d = rs * ((dxh - m1) - xh * m2);
        dx[o + j] = has_acc ? acc[o + j] + d : d;
    }
}

// ---- column kernels: a block of (CX, RY) threads owns CX adjacent columns of a (n_rows, C) array over all
// its rows, so a column's sum is finished in one launch without atomics. Thread (x, y) walks rows y, y + RY,
// y + 2 RY, ... in order (loading COL_BATCH rows ahead); rows_tree_sum then adds the RY partial sums in a fixed
// tree. CX >= 8 keeps each row segment a whole 32-byte sector; RY is a power of two (tapegpt.kernels.col_grid
// picks both).

// The sum over threadIdx.y of v for column threadIdx.x, returned to every thread of the block. sh has room for
// blockDim.x * blockDim.y values; every thread of the block must call it (it synchronises the block).
__device__ __forceinline__ T rows_tree_sum(T* sh, T v) {
    const int X = blockDim.x, x = threadIdx.x, y = threadIdx.y;
    sh[y * X + x] = v;
    __syncthreads();
    for (int h = blockDim.y >> 1; h > 0; h >>= 1) {
        if (y < h) sh[y * X + x] += sh[(y + h) * X + x];
        __syncthreads();
    }
    return sh[x];
}

#define COL_MAX_THREADS 1024
// Rows a thread loads before it adds them (in row order): a plain loop issues one load, then waits for it at its
// add, so a thread would have one load in flight; a batch keeps COL_BATCH in flight.
#define COL_BATCH 8

// Declared first to bound their blocks: at COL_MAX_THREADS threads a thread may use at most 64 registers, which
// the compiler then keeps to (unbounded, the float64 GELU backward took 70 and could not launch at 1024 threads).
extern "C" __global__ void __launch_bounds__(COL_MAX_THREADS) colsum(const T* a, T* out, i64 n_rows, i64 C);
extern "C" __global__ void __launch_bounds__(COL_MAX_THREADS) ln_param(
    const T* g, const T* x, const T* mean, const T* rstd, const T* dx, T* dw, T* db, T* ds, i64 n_rows, i64 C,
    int has_dx);
extern "C" __global__ void __launch_bounds__(COL_MAX_THREADS) bias_gelu_bwd(
    const T* g, const T* a, const T* b, T* du, T* db, i64 n_rows, i64 C);

// out[c] = sum over rows of a[r, c]: a bias's gradient.
extern "C" __global__ void colsum(const T* a, T* out, i64 n_rows, i64 C) {
    __shared__ T sh[COL_MAX_THREADS];
    const i64 col = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    T s = 0;
    if (col < C) {
        const i64 step = blockDim.y;
        i64 r = threadIdx.y;
        for (; r + (COL_BATCH - 1) * step < n_rows; r += COL_BATCH * step) {
            T v[COL_BATCH];
            #pragma unroll
            for (int k = 0; k < COL_BATCH; ++k) v[k] = a[(r + k * step) * C + col];
            #pragma unroll
            for (int k = 0; k < COL_BATCH; ++k) s += v[k];
        }
        for (; r < n_rows; r += step) s += a[r * C + col];
    }
    s = rows_tree_sum(sh, s);
    if (threadIdx.y == 0 && col < C) out[col] = s;
}

// Layer norm's parameter gradients in one pass: dw[c] = sum_r g * xhat, db[c] = sum_r g; when has_dx, also
// ds[c] = sum_r dx (the column sums of the gradient ln_bwd wrote: the bias gradient of the op that made x).
extern "C" __global__ void ln_param(const T* g, const T* x, const T* mean, const T* rstd, const T* dx, T* dw,
                                    T* db, T* ds, i64 n_rows, i64 C, int has_dx) {
    __shared__ T sh_w[COL_MAX_THREADS], sh_b[COL_MAX_THREADS], sh_d[COL_MAX_THREADS];
    const i64 col = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    T sw = 0, sb = 0, sd = 0;
    if (col < C) {
        const i64 step = blockDim.y;
        i64 r = threadIdx.y;
        for (; r + (COL_BATCH - 1) * step < n_rows; r += COL_BATCH * step) {
            T gv[COL_BATCH], xh[COL_BATCH], dv[COL_BATCH];
            #pragma unroll
            for (int k = 0; k < COL_BATCH; ++k) {
                const i64 rk = r + k * step;
                gv[k] = g[rk * C + col];
                xh[k] = (x[rk * C + col] - mean[rk]) * rstd[rk];
                dv[k] = has_dx ? dx[rk * C + col] : (T)0;
            }
            #pragma unroll
            for (int k = 0; k < COL_BATCH; ++k) { sw += gv[k] * xh[k]; sb += gv[k]; sd += dv[k]; }
        }
        for (; r < n_rows; r += step) {
            const T gv = g[r * C + col];
            sw += gv * ((x[r * C + col] - mean[r]) * rstd[r]);
            sb += gv;
            if (has_dx) sd += dx[r * C + col];
        }
    }
    sw = rows_tree_sum(sh_w, sw);
    sb = rows_tree_sum(sh_b, sb);
    if (has_dx) sd = rows_tree_sum(sh_d, sd);   // has_dx is the same for the whole block
    if (threadIdx.y == 0 && col < C) {
        dw[col] = sw;
        db[col] = sb;
        if (has_dx) ds[col] = sd;
    }
}

// ---- GELU (tanh form) of a + b, with b a bias over the last axis (C)
extern "C" __global__ void bias_gelu_fwd(const T* a, const T* b, T* y, i64 n, i64 C) {
    ELEM_LOOP {
        T u = a[i] + b[i % C];
        T t = tanh((T)0.7978845608028654 * (u + (T)0.044715 * u * u * u));
        y[i] = (T)0.5 * u * ((T)1 + t);
    }
}

__device__ __forceinline__ T gelu_grad(T g, T u) {
    T t = tanh((T)0.7978845608028654 * (u + (T)0.044715 * u * u * u));
    T d = (T)0.7978845608028654 * ((T)1 + (T)(3 * 0.044715) * u * u);
    return g * ((T)0.5 * ((T)1 + t) + (T)0.5 * u * ((T)1 - t * t) * d);
}

// du = g * gelu'(a + b) over (n_rows, C), and db[c] = sum_r du[r, c] (the bias's gradient) in the same pass.
extern "C" __global__ void bias_gelu_bwd(const T* g, const T* a, const T* b, T* du, T* db,
                                         i64 n_rows, i64 C) {
    __shared__ T sh[COL_MAX_THREADS];
    const i64 col = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    T s = 0;
    if (col < C) {
        const T bc = b[col];
        const i64 step = blockDim.y;
        i64 r = threadIdx.y;
        for (; r + (COL_BATCH - 1) * step < n_rows; r += COL_BATCH * step) {
            T gv[COL_BATCH], av[COL_BATCH];
            #pragma unroll
            for (int k = 0; k < COL_BATCH; ++k) {
                gv[k] = g[(r + k * step) * C + col];
                av[k] = a[(r + k * step) * C + col];
            }
            #pragma unroll
            for (int k = 0; k < COL_BATCH; ++k) {
                const T d = gelu_grad(gv[k], av[k] + bc);
                du[(r + k * step) * C + col] = d;
                s += d;
            }
        }
        for (; r < n_rows; r += step) {
            const T d = gelu_grad(g[r * C + col], a[r * C + col] + bc);
            du[r * C + col] = d;
            s += d;
        }
    }
    s = rows_tree_sum(sh, s);
    if (threadIdx.y == 0 && col < C) db[col] = s;
}

// ---- residual + (a + bias)
extern "C" __global__ void bias_residual(const T* x, const T* a, const T* b, T* y, i64 n, i64 C) {
    ELEM_LOOP { y[i] = x[i] + (a[i] + b[i % C]); }
}

// ---- token + position embedding: y[r, c] = wte[idx[r], c] + wpe[r % T, c]
extern "C" __global__ void embed_fwd(const T* wte, const T* wpe, const i64* idx, T* y, i64 n, i64 T_, i64 C) {
    ELEM_LOOP {
        const i64 r = i / C, c = i % C;
        y[i] = wte[idx[r] * C + c] + wpe[(r % T_) * C + c];
    }
}

// onehot_t[v, r] = (idx[r] == v): the transposed one-hot matrix of the embedding's gradient GEMM.
extern "C" __global__ void onehot_t(const i64* idx, T* out, i64 n, i64 N) {
    ELEM_LOOP { out[i] = idx[i % N] == i / N ? (T)1 : (T)0; }
}

// ---- rows (B, T, S*H*D) (+ bias) -> for each part s its heads twice: out[2s] as (B, H, T, D) and out[2s+1]
// transposed, (B, H, D, T). CuPy's batched matmul copies a transposed operand to make it contiguous (for the
// (T, T) probabilities, 100 MB a layer at the reference size); writing both layouts here avoids every such copy.
extern "C" __global__ void rows_to_heads(const T* a, const T* bias, T* out, i64 n, i64 B, i64 T_, i64 H, i64 D,
                                         i64 S, int has_bias) {
    const i64 M = B * H * T_ * D;  // one part's size
    ELEM_LOOP {
        i64 r = i;
        const i64 d = r % D; r /= D;
        const i64 h = r % H; r /= H;
        const i64 s = r % S; r /= S;
        const i64 t = r % T_, bb = r / T_;
        const T v = has_bias ? a[i] + bias[i % (S * H * D)] : a[i];
        out[2 * s * M + ((bb * H + h) * T_ + t) * D + d] = v;
        out[(2 * s + 1) * M + ((bb * H + h) * D + d) * T_ + t] = v;
    }
}

// ---- S parts of heads -> rows (B, T, S*H*D), part s read from a_s laid out (B, H, T, D), or (B, H, D, T) when
// bit s of transposed is set: the inverse of rows_to_heads, and the merge of the heads' outputs (S = 1).
extern "C" __global__ void heads_to_rows(const T* a0, const T* a1, const T* a2, T* out, i64 n, i64 B, i64 T_,
                                         i64 H, i64 D, i64 S, int transposed) {
    ELEM_LOOP {
        i64 r = i;
        const i64 d = r % D; r /= D;
        const i64 h = r % H; r /= H;
        const i64 s = r % S; r /= S;
        const i64 t = r % T_, bb = r / T_;
        const T* a = s == 0 ? a0 : (s == 1 ? a1 : a2);
        out[i] = (transposed >> s) & 1 ? a[((bb * H + h) * D + d) * T_ + t] : a[((bb * H + h) * T_ + t) * D + d];
    }
}

// ---- causal softmax over the last axis of s (rows of Tk keys, Tq queries per head), in place:
// p = softmax(scale * s) over the keys j <= i + (Tk - Tq) that query i may see, 0 elsewhere.
extern "C" __global__ void causal_softmax_fwd(T* s, i64 n_rows, i64 Tq, i64 Tk, T scale) {
    ROW_PROLOGUE
    T* r = s + row * Tk;
    const i64 last = row % Tq + (Tk - Tq);  // the last visible key
    T m = neg_inf();
    for (i64 j = lane; j <= last && j < Tk; j += 32) { T v = r[j] * scale; m = v > m ? v : m; }
    m = warp_max(m);
    T z = 0;
    for (i64 j = lane; j <= last && j < Tk; j += 32) z += exp(r[j] * scale - m);
    z = warp_sum(z);
    for (i64 j = lane; j < Tk; j += 32) r[j] = j <= last ? exp(r[j] * scale - m) / z : (T)0;
}

// ds = scale * p * (dp - sum_j dp_j p_j), in place over dp; masked entries (p == 0) get exactly 0.
extern "C" __global__ void causal_softmax_bwd(const T* p, T* dp, i64 n_rows, i64 Tq, i64 Tk, T scale) {
    ROW_PROLOGUE
    const i64 o = row * Tk;
    const i64 last = row % Tq + (Tk - Tq);
    T s = 0;
    for (i64 j = lane; j <= last && j < Tk; j += 32) s += dp[o + j] * p[o + j];
    s = warp_sum(s);
    for (i64 j = lane; j < Tk; j += 32) dp[o + j] = j <= last ? scale * (p[o + j] * (dp[o + j] - s)) : (T)0;
}

// ---- cross-entropy rows: loss = log(sum exp(z - m)) + m - z[target]; keeps m and the sum for the backward
extern "C" __global__ void ce_fwd(const T* z, const i64* t, T* loss, T* m_out, T* s_out, i64 n_rows, i64 V) {
    ROW_PROLOGUE
    const T* zr = z + row * V;
    T m = neg_inf();
    for (i64 j = lane; j < V; j += 32) m = zr[j] > m ? zr[j] : m;
    m = warp_max(m);
    T s = 0;
    for (i64 j = lane; j < V; j += 32) s += exp(zr[j] - m);
    s = warp_sum(s);
    if (lane == 0) { m_out[row] = m; s_out[row] = s; loss[row] = log(s) + m - zr[t[row]]; }
}

// dz = (exp(z - m) / s - onehot(target)) * (g / N), with g the loss's 0-d gradient on the device.
extern "C" __global__ void ce_bwd(const T* z, const i64* t, const T* m, const T* s, const T* g, T* dz,
                                  i64 n, i64 V, i64 N) {
    const T gn = g[0] / (T)N;
    ELEM_LOOP {
        const i64 r = i / V;
        dz[i] = (exp(z[i] - m[r]) / s[r] - (i % V == t[r] ? (T)1 : (T)0)) * gn;
    }
}

// ---- AdamW over flat parameters p, moments m and v (in place), gradients g; p[0, n_decay) get weight decay.
// Every operation rounds on its own, in the order of tapegpt.optim's NumPy formulas (no FMA contraction, IEEE
// division and square root), so the update is bit-identical to them:
// m = b1 m + c1 g; v = b2 v + c2 (g g); p = p decay (decayed only); p = p - step (m / (sqrt(v) / bc2 + eps)).
__device__ __forceinline__ float rn_add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double rn_add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ float rn_sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ double rn_sub(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ float rn_mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double rn_mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float rn_div(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ double rn_div(double a, double b) { return __ddiv_rn(a, b); }
__device__ __forceinline__ float rn_sqrt(float a) { return __fsqrt_rn(a); }
__device__ __forceinline__ double rn_sqrt(double a) { return __dsqrt_rn(a); }

extern "C" __global__ void adamw(T* p, T* m, T* v, const T* g, i64 n, i64 n_decay, T b1, T c1, T b2, T c2,
                                 T decay, T bc2, T eps, T step) {
    ELEM_LOOP {
        const T gi = g[i];
        const T mi = rn_add(rn_mul(b1, m[i]), rn_mul(c1, gi));
        const T vi = rn_add(rn_mul(b2, v[i]), rn_mul(c2, rn_mul(gi, gi)));
        m[i] = mi;
        v[i] = vi;
        const T pi = i < n_decay ? rn_mul(p[i], decay) : p[i];
        p[i] = rn_sub(pi, rn_mul(step, rn_div(mi, rn_add(rn_div(rn_sqrt(vi), bc2), eps))));
    }
}
"""

KERNEL_NAMES = ("ln_fwd", "residual_ln_fwd", "ln_bwd", "ln_param", "colsum", "bias_gelu_fwd", "bias_gelu_bwd",
                "bias_residual", "embed_fwd", "onehot_t", "rows_to_heads", "heads_to_rows", "causal_softmax_fwd",
                "causal_softmax_bwd", "ce_fwd", "ce_bwd", "adamw")

_CTYPE = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}


def source(dtype):
    """The kernel source for one floating dtype (T is a typedef, so one text serves float and double)."""
    return f"typedef {_CTYPE[np.dtype(dtype)]} T;\n" + SOURCE


# (device id, dtype char) -> RawModule and (device id, dtype as given, name) -> kernel. _lock guards insertion
# only: lookups of a built entry are plain dict reads (atomic under the GIL), so a launch takes no lock.
_modules, _functions = {}, {}
_lock = threading.Lock()
_get_device = None   # cupy.cuda.runtime.getDevice, bound at the first build (importing tapegpt never needs CuPy)


def kernel(name, dtype):
    """The compiled kernel `name` for `dtype` on the current device (compiled on first use, then cached).

    Called at every launch, so a built kernel costs one device query and one dict lookup."""
    fn = _functions.get((_get_device(), dtype, name)) if _get_device is not None else None
    return fn if fn is not None else _build(name, dtype)


def _build(name, dtype):
    global _get_device
    import cupy  # already imported by the caller's arrays
    _get_device = cupy.cuda.runtime.getDevice
    device, char = _get_device(), np.dtype(dtype).char
    with _lock:
        mod = _modules.get((device, char))
        if mod is None:
            mod = _modules[(device, char)] = cupy.RawModule(code=source(dtype))
        # Launched by tapegpt.launch: with the GIL held (TAPEGPT_LAUNCH=cupy: through CuPy), parameters typed
        # from this source's signature.
        fn = _functions[(device, dtype, name)] = launch.Kernel(
            mod.get_function(name), launch.signature(SOURCE, name, _CTYPE[np.dtype(dtype)]))
    return fn


@functools.lru_cache(maxsize=4096)
def sizes(*values):
    """Sizes as the kernels' `long long` (typed NumPy scalars: CuPy passes them with exactly that width); cached,
    since a step asks for the same few shapes at every launch and the scalars are immutable."""
    return tuple(map(np.int64, values))


# The grids are pure functions of the sizes, asked for at every launch: cached for the same reason.
@functools.lru_cache(maxsize=4096)
def elem_grid(n):
    """Grid for an elementwise kernel over n elements (grid-stride loop past 2**20 blocks)."""
    return (max(1, min(-(-n // ELEM_BLOCK), 1 << 20)),), (ELEM_BLOCK,)


@functools.lru_cache(maxsize=4096)
def col_grid(n_rows, C):
    """Grid and block (CX, RY) for a column kernel over (n_rows, C): RY row groups, the power of two that gives
    each thread about COL_ROWS rows (at most COL_MAX_RY), and CX = 256 / RY columns but at least 8 per block.

    One launch and no atomics means a column never spans blocks, so the grid is C / CX blocks: 8 columns a
    block gives (8192, 1536) 192 blocks of 1024 threads, and a short array (the position embedding's gradient,
    (B, T*C)) 256 columns a block, one row group."""
    ry = min(COL_MAX_RY, 1 << (-(-n_rows // COL_ROWS) - 1).bit_length())
    cx = max(8, 256 // ry)
    return (max(1, -(-C // cx)),), (cx, ry)


@functools.lru_cache(maxsize=4096)
def row_grid(n_rows):
    """Grid for a warp-per-row kernel."""
    per_block = ROW_BLOCK // 32
    return (max(1, -(-n_rows // per_block)),), (ROW_BLOCK,)
