"""tapegpt.launch: kernel parameter lists parsed from the source, the values a launch passes, the switch; on a GPU
the direct launches give CuPy's launches' bits."""
import ctypes
import types

import numpy as np
import pytest

from tapegpt import kernels, launch


@pytest.mark.parametrize("real,code", [("float", "f"), ("double", "d")])
def test_every_kernel_of_the_model_has_a_parsed_signature(real, code):
    for name in kernels.KERNEL_NAMES:
        fmt = launch.signature(kernels.SOURCE, name, real)
        assert fmt.startswith("@") and set(fmt[1:]) <= set("Pqifd"), (name, fmt)
    assert launch.signature(kernels.SOURCE, "ln_fwd", real) == "@PPPPPPqq" + code       # ..., i64 n_rows, i64 C, T eps
    assert launch.signature(kernels.SOURCE, "ln_bwd", real).endswith("qqi")              # ..., int has_acc


def test_signature_errors_name_the_kernel_and_parameter():
    src = 'extern "C" __global__ void k(const float* a, short n) {}'
    with pytest.raises(ValueError, match=r"kernel 'k': parameter 'short n'"):
        launch.signature(src, "k", "float")
    with pytest.raises(ValueError, match="kernel 'nope' not found"):
        launch.signature(src, "nope", "float")
    assert launch.signature('extern "C" __global__ void e() {}', "e", "float") == "@"


class _Array:
    def __init__(self, ptr):
        self.data = types.SimpleNamespace(ptr=ptr)


@pytest.fixture
def fake_driver(monkeypatch):
    calls = []

    def cu_launch(fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        calls.append(dict(fn=fn, grid=(gx, gy, gz), block=(bx, by, bz), shared=shared, stream=stream,
                          params=params, extra=extra))
        return 0

    cupy = types.SimpleNamespace(cuda=types.SimpleNamespace(get_current_stream=lambda: types.SimpleNamespace(ptr=77)))
    monkeypatch.setattr(launch, "_lib", (cupy, cu_launch, None))
    monkeypatch.setattr(launch, "direct", True)
    return calls


def _read_params(params, codes):
    """The values the launch's kernelParams point at, read back as C values of the kernel's types."""
    out = []
    for i, c in enumerate(codes):
        out.append(launch._SLOT[c].from_address(params[i]).value)
    return out


def test_a_direct_launch_passes_pointers_and_scalars_in_the_kernels_types(fake_driver):
    fn = types.SimpleNamespace(ptr=4242)
    k = launch.Kernel(fn, "@PPqqif")
    k((3,), (256,), (_Array(1000), _Array(2000), np.int64(7), 2 ** 40, np.int32(-1), np.float32(0.5)))
    c = fake_driver[-1]
    assert c["fn"] == 4242 and c["grid"] == (3, 1, 1) and c["block"] == (256, 1, 1) and c["stream"] == 77
    assert c["extra"] is None and c["shared"] == 0
    assert _read_params(c["params"], "PPqqif") == [1000, 2000, 7, 2 ** 40, -1, 0.5]
    k((2, 5), (32, 8), (_Array(1), _Array(2), 1, 2, 3, 4.0))
    assert fake_driver[-1]["grid"] == (2, 5, 1) and fake_driver[-1]["block"] == (32, 8, 1)
    assert _read_params(fake_driver[-1]["params"], "PPqqif") == [1, 2, 1, 2, 3, 4.0]


def test_a_raw_kernel_launches_by_its_loaded_functions_pointer(fake_driver):
    # CuPy's RawModule.get_function gives a RawKernel: the CUfunction is .kernel.ptr (a Function has .ptr)
    raw = types.SimpleNamespace(kernel=types.SimpleNamespace(ptr=99))
    launch.Kernel(raw, "@q")((1,), (1,), (5,))
    assert fake_driver[-1]["fn"] == 99


def test_a_direct_launch_checks_its_arguments_and_status(fake_driver, monkeypatch):
    k = launch.Kernel(types.SimpleNamespace(ptr=1), "@Pq")
    with pytest.raises(TypeError, match="takes 2 arguments, got 1"):
        k((1,), (1,), (_Array(5),))
    cupy = launch._lib[0]
    monkeypatch.setattr(launch, "_lib", (cupy, lambda *a: 700, None))
    with pytest.raises(RuntimeError, match="cuLaunchKernel failed: status 700"):
        k((1,), (1,), (_Array(5), 1))


def test_switched_off_launches_go_through_cupy(fake_driver, monkeypatch):
    got = []

    class Function:
        ptr = 1

        def __call__(self, grid, block, args, shared_mem=0):
            got.append((grid, block, args, shared_mem))

    monkeypatch.setattr(launch, "direct", False)
    launch.Kernel(Function(), "@Pq")((1,), (2,), ("a", 3))
    assert got == [((1,), (2,), ("a", 3), 0)] and fake_driver == []


def test_the_env_switch_is_checked(monkeypatch):
    monkeypatch.setenv(launch.LAUNCH_ENV, "fast")
    with pytest.raises(ValueError, match="TAPEGPT_LAUNCH"):
        launch._mode_from_env()
    monkeypatch.setenv(launch.LAUNCH_ENV, "cupy")
    assert launch._mode_from_env() == "cupy"


def test_slots_are_ctypes_of_the_declared_width():
    k = launch.Kernel(types.SimpleNamespace(ptr=1), "@Pqifd")
    assert [ctypes.sizeof(s) for s in k.slots] == [8, 8, 4, 4, 8]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gpu_direct_launches_give_cupys_bits(dtype):
    """Every fused op and the model's step, launched directly and through CuPy: the same kernels, the same bits."""
    cp = pytest.importorskip("cupy")
    from tapegpt import GPT, GPTConfig, blas, get_batch, load_corpus
    cfg = GPTConfig(n_layer=2, batch_size=4, dtype=dtype)
    x, y = get_batch(load_corpus(), cfg.batch_size, cfg.block_size, 0, xp=cp)
    results = {}
    for mode in (True, False):
        launch.direct = mode
        try:
            loss, grads = GPT(cfg, xp=cp, seed=0, fused=True).loss_and_grads(x, y)
            results[mode] = (float(loss), {k: v.get() for k, v in grads.items()})
        finally:
            launch.direct = launch._mode_from_env() == "direct"
    (l1, g1), (l0, g0) = results[True], results[False]
    assert l1 == l0
    for k in g0:
        assert np.array_equal(g1[k], g0[k]), k
    a = cp.ones((64, 32), dtype)
    assert launch.cublas() is not None and cp.array_equal(blas.mm(a, a.T), cp.matmul(a, a.T))
