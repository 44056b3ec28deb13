"""tapegpt.blas: the row-major <-> column-major mapping of every layout, checked against NumPy on the CPU by a
cuBLAS stand-in that reads and writes raw memory exactly as cuBLAS's column-major GEMM does; then on a GPU
against cupy.matmul."""
import ctypes
import types

import numpy as np
import pytest

from tapegpt import blas, launch

OP_N, OP_T = 0, 1


def _colmajor(ptr, rows, cols, ld, dtype):
    """The column-major (rows, cols) matrix with leading dimension ld at address ptr, as a writable view."""
    n = ld * (cols - 1) + rows
    buf = np.ctypeslib.as_array((ctypes.c_byte * (n * dtype.itemsize)).from_address(ptr)).view(dtype)
    return np.lib.stride_tricks.as_strided(buf, (rows, cols), (dtype.itemsize, ld * dtype.itemsize))


def _gemm_ex(handle, ta, tb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc, compute, algo):
    assert Atype == Btype == Ctype and compute == ("acc", Atype) and algo == "algo"
    _one(Atype, ta, tb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc)


def _scalar(ptr, dtype):
    return _colmajor(ptr, 1, 1, 1, dtype)[0, 0]


def _one(dtype, ta, tb, m, n, k, alpha, A, lda, B, ldb, beta, C, ldc):
    a = _colmajor(A, m, k, lda, dtype) if ta == OP_N else _colmajor(A, k, m, lda, dtype).T
    b = _colmajor(B, k, n, ldb, dtype) if tb == OP_N else _colmajor(B, n, k, ldb, dtype).T
    c = _colmajor(C, m, n, ldc, dtype)
    c[...] = _scalar(alpha, dtype) * (a @ b) + (_scalar(beta, dtype) * c if _scalar(beta, dtype) else 0)


def _batched(dtype):
    def gemm(handle, ta, tb, m, n, k, alpha, A, lda, sA, B, ldb, sB, beta, C, ldc, sC, batch):
        for i in range(batch):
            step = dtype.itemsize
            _one(dtype, ta, tb, m, n, k, alpha, A + i * sA * step, lda, B + i * sB * step, ldb, beta,
                 C + i * sC * step, ldc)
    return gemm


class FakeArray:
    """Just enough of a CuPy array for tapegpt.blas, over a NumPy array (which it keeps alive)."""

    def __init__(self, x):
        self.x = x
        self.shape, self.dtype, self.ndim, self.size, self.flags = x.shape, x.dtype, x.ndim, x.size, x.flags
        self.data = types.SimpleNamespace(ptr=x.ctypes.data)

    T = property(lambda self: FakeArray(self.x.T))

    def __matmul__(self, other):
        return FakeArray(self.x @ other.x)

    def __getitem__(self, index):
        return FakeArray(self.x[index])


@pytest.fixture
def fake_cublas(monkeypatch):
    calls = []

    def counted(fn, name):
        def call(*args):
            calls.append(name)
            return fn(*args)
        return call

    f32, f64 = np.dtype(np.float32), np.dtype(np.float64)
    cublas = types.SimpleNamespace(CUBLAS_OP_N=OP_N, CUBLAS_OP_T=OP_T, CUBLAS_POINTER_MODE_HOST=0,
                                   setPointerMode=lambda h, m: None, gemmEx=counted(_gemm_ex, "gemm"),
                                   sgemmStridedBatched=counted(_batched(f32), "batched"),
                                   dgemmStridedBatched=counted(_batched(f64), "batched"))
    cupy = types.SimpleNamespace(empty=lambda shape, dtype: FakeArray(np.full(shape, np.nan, dtype)),
                                 cuda=types.SimpleNamespace(device=types.SimpleNamespace(get_cublas_handle=lambda: 7)))
    dtypes = {dt: (dt, ("acc", dt)) for dt in (f32, f64)}
    monkeypatch.setattr(blas, "_lib", (cupy, cublas, dtypes, "algo"))
    monkeypatch.setattr(blas, "enabled", True)
    monkeypatch.setattr(launch, "direct", False)          # CuPy's wrappers; test_direct_path covers the other
    return calls


LAYOUTS = [(False, False), (True, False), (False, True), (True, True)]   # (a given transposed, b given transposed)


@pytest.mark.parametrize("ta,tb", LAYOUTS)
@pytest.mark.parametrize("M,K,N", [(5, 3, 7), (1, 4, 6), (6, 4, 1), (3, 1, 2), (16, 16, 16)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gemm_maps_every_layout_to_column_major(fake_cublas, ta, tb, M, K, N, dtype):
    rng = np.random.default_rng(M * 100 + K * 10 + N)
    a = rng.standard_normal((M, K)).astype(dtype)
    b = rng.standard_normal((K, N)).astype(dtype)
    A = FakeArray(np.ascontiguousarray(a.T)).T if ta else FakeArray(a)       # a transposed view: F-contiguous
    B = FakeArray(np.ascontiguousarray(b.T)).T if tb else FakeArray(b)
    out = blas.mm(A, B)
    assert fake_cublas == ["gemm"]
    assert out.shape == (M, N) and out.flags.c_contiguous
    want = a @ b                     # an entry that cancels to near 0 has no relative precision: atol by scale
    np.testing.assert_allclose(out.x, want, rtol=1e-5, atol=1e-5 * float(np.abs(a).max() * np.abs(b).max()) * K ** 0.5)


@pytest.mark.parametrize("shape_a,shape_b", [((2, 3, 5, 4), (2, 3, 4, 6)), ((4, 1, 3), (4, 3, 1)), ((3, 2, 2), (3, 2, 5))])
def test_batched_gemm_is_one_call(fake_cublas, shape_a, shape_b):
    rng = np.random.default_rng(1)
    a = rng.standard_normal(shape_a).astype(np.float32)
    b = rng.standard_normal(shape_b).astype(np.float32)
    out = blas.mm(FakeArray(a), FakeArray(b))
    assert fake_cublas == ["batched"]
    want = a @ b                     # an entry that cancels to near 0 has no relative precision: atol by scale
    np.testing.assert_allclose(out.x, want, rtol=1e-5, atol=1e-5 * float(np.abs(a).max() * np.abs(b).max()) * a.shape[-1] ** 0.5)


@pytest.mark.parametrize("ta,tb", LAYOUTS)
def test_direct_path_makes_the_same_calls_with_the_stream_set(fake_cublas, monkeypatch, ta, tb):
    streams = []

    def set_stream(handle, stream):
        streams.append((handle, stream))
        return 0

    f32, f64 = np.dtype(np.float32), np.dtype(np.float64)
    fake_cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(
        get_current_stream=lambda: types.SimpleNamespace(ptr=1234)))
    lib = (set_stream, lambda *a: (fake_cublas.append("direct gemm"), _gemm_ex(*a))[1] or 0,
           {f32: _batched(f32), f64: _batched(f64)})
    monkeypatch.setattr(launch, "_lib", (fake_cupy, None, lib))
    monkeypatch.setattr(launch, "direct", True)
    rng = np.random.default_rng(3)
    a, b = rng.standard_normal((5, 3)), rng.standard_normal((3, 4))
    A = FakeArray(np.ascontiguousarray(a.T)).T if ta else FakeArray(a)
    B = FakeArray(np.ascontiguousarray(b.T)).T if tb else FakeArray(b)
    np.testing.assert_allclose(blas.mm(A, B).x, a @ b)
    x, y = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 4, 2))
    np.testing.assert_allclose(blas.mm(FakeArray(x), FakeArray(y)).x, x @ y)
    assert fake_cublas == ["direct gemm"] and streams == [(7, 1234), (7, 1234)]
    monkeypatch.setattr(launch, "_lib", (fake_cupy, None, (lambda h, s: 0, lambda *a: 13, {})))
    with pytest.raises(RuntimeError, match="cublasGemmEx failed: status 13"):
        blas.mm(A, B)


def test_what_cublas_cannot_take_falls_back_to_matmul(fake_cublas):
    a = np.arange(24, dtype=np.float32).reshape(4, 6)
    b = np.ones((3, 5), np.float32)
    sliced = FakeArray(a)[:, ::2]                        # neither C- nor F-contiguous
    np.testing.assert_array_equal(blas.mm(sliced, FakeArray(b)).x, a[:, ::2] @ b)
    stacked = FakeArray(np.ones((2, 4, 3), np.float32))
    np.testing.assert_array_equal(blas.mm(stacked, FakeArray(np.ones((1, 3, 2), np.float32))).x,
                                  np.full((2, 4, 2), 3, np.float32))          # broadcast batch axes
    ints = FakeArray(np.ones((2, 2), np.int64))
    assert blas.mm(ints, ints).x.dtype == np.int64
    assert fake_cublas == []


def test_bad_shapes_name_them(fake_cublas):
    with pytest.raises(ValueError, match=r"\(2, 3\) and \(4, 5\)"):
        blas.mm(FakeArray(np.ones((2, 3), np.float32)), FakeArray(np.ones((4, 5), np.float32)))


def test_numpy_and_the_switch_use_matmul(fake_cublas, monkeypatch):
    a = np.ones((2, 3), np.float32)
    assert isinstance(blas.mm(a, a.T), np.ndarray)
    monkeypatch.setattr(blas, "enabled", False)
    blas.mm(FakeArray(a), FakeArray(a.T.copy()))
    assert fake_cublas == []


def test_env_switch_is_checked(monkeypatch):
    monkeypatch.setenv(blas.BLAS_ENV, "yes")
    with pytest.raises(ValueError, match="TAPEGPT_BLAS"):
        blas._enabled_from_env()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gpu_mm_matches_cupy_matmul(dtype):
    cp = pytest.importorskip("cupy")
    rng = np.random.default_rng(0)
    for (M, K, N) in [(8192, 384, 1152), (384, 8192, 1536), (7, 5, 3), (1, 33, 1)]:
        for ta, tb in LAYOUTS:
            a = cp.asarray(rng.standard_normal((K, M) if ta else (M, K)).astype(dtype))
            b = cp.asarray(rng.standard_normal((N, K) if tb else (K, N)).astype(dtype))
            a, b = (a.T if ta else a), (b.T if tb else b)
            tol = 1e-4 if dtype == "float32" else 1e-12
            cp.testing.assert_allclose(blas.mm(a, b), cp.matmul(a, b), rtol=tol, atol=tol * K ** 0.5)
    a = cp.asarray(rng.standard_normal((32, 12, 256, 32)).astype(dtype))
    b = cp.asarray(rng.standard_normal((32, 12, 32, 256)).astype(dtype))
    cp.testing.assert_allclose(blas.mm(a, b), cp.matmul(a, b), rtol=1e-4, atol=1e-4)
    with cp.cuda.Stream(non_blocking=True) as s:       # runs on the current stream
        c = blas.mm(a, b)
        s.synchronize()
    cp.testing.assert_allclose(c, cp.matmul(a, b), rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_gpu_mm_is_cupy_matmul_bit_for_bit():
    """The same cuBLAS call as CuPy's matmul, so the same bits: the fused model's loss curve does not move."""
    cp = pytest.importorskip("cupy")
    rng = np.random.default_rng(1)
    shapes = [(8192, 384, 1152), (8192, 1536, 384), (384, 8192, 1536), (1024, 384, 256)]
    for M, K, N in shapes:
        for ta, tb in LAYOUTS:
            a = cp.asarray(rng.standard_normal((K, M) if ta else (M, K)).astype(np.float32))
            b = cp.asarray(rng.standard_normal((N, K) if tb else (K, N)).astype(np.float32))
            a, b = (a.T if ta else a), (b.T if tb else b)
            assert cp.array_equal(blas.mm(a, b), cp.matmul(a, b)), (M, K, N, ta, tb)
    a = cp.asarray(rng.standard_normal((4, 12, 256, 32)).astype(np.float32))
    b = cp.asarray(rng.standard_normal((4, 12, 32, 256)).astype(np.float32))
    assert cp.array_equal(blas.mm(a, b), cp.matmul(a, b))
