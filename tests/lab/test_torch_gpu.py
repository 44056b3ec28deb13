"""PyTorch and CuPy sharing xpool on a GPU. Each arm runs in a fresh process (tests/lab/lab_fixtures/torch_mixed.py):
PyTorch's allocator must be chosen before its first CUDA allocation and stays for the life of the process."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gpu

SCRIPT = os.path.join(os.path.dirname(__file__), "lab_fixtures", "torch_mixed.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _torch_cuda():
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


def run_arm(arm, *args, timeout=300):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, SCRIPT, "--arm", arm, *args], capture_output=True, text=True,
                         timeout=timeout, env=env, cwd=ROOT)
    assert out.returncode == 0, f"{arm} arm failed:\n{out.stdout}\n{out.stderr}"
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def arms():
    if not _torch_cuda():
        pytest.skip("needs PyTorch with CUDA")
    # warm: after the experiments' 5 warm-up steps, as tests/lab/test_gpu_segments.py counts them
    return {arm: run_arm(arm, "--warmup", "5") for arm in ("native", "xpool")}


def test_mixed_training_is_bit_identical_with_and_without_xpool(arms):
    assert arms["xpool"]["losses"] == arms["native"]["losses"]
    assert arms["xpool"]["digest"] == arms["native"]["digest"]


def test_a_warm_mixed_loop_makes_no_device_malloc_and_each_framework_reuses_the_others_blocks(arms):
    x = arms["xpool"]
    assert x["scheme"] == "expandable" and x["params_in_virtual_memory"]   # the pool enable_torch() makes
    assert x["requests_warm"] > 0
    assert [x[f"device_{c}_warm"] for c in ("mallocs", "frees", "maps", "unmaps")] == [0, 0, 0, 0]
    assert x["torch_reused_cupy"] > 0 and x["cupy_reused_torch"] > 0
    assert x["bytes_in_use_torch"] > 0                     # the model's parameters and optimizer state


def test_one_pool_peaks_below_two_pools(arms):
    native = arms["native"]["peak_reserved_torch"] + arms["native"]["peak_reserved_cupy"]
    assert arms["xpool"]["peak_reserved"] < native


def test_pytorch_cannot_report_its_own_memory_stats_through_a_pluggable_allocator(arms):
    """What README says: torch.cuda.memory_allocated() and friends raise; xpool.stats() has the numbers."""
    assert "does not yet support getDeviceStats" in arms["xpool"]["torch_memory_stats"]


def test_a_torch_oom_surfaces_as_an_exception_and_the_process_goes_on():
    if not _torch_cuda():
        pytest.skip("needs PyTorch with CUDA")
    out = run_arm("oom")
    assert out["error_type"] == "RuntimeError" and "xpool: out of memory on device 0" in out["error"]
    assert "limit" in out["error"] and out["oom_errors"] == 1 and out["after"] == 2.0 * (1 << 20)


def test_enable_after_torch_used_cuda_names_the_problem_and_the_fix():
    if not _torch_cuda():
        pytest.skip("needs PyTorch with CUDA")
    out = run_arm("late")
    assert "already initialised" in out["error"] and "right after `import torch`" in out["error"]
    assert out["installed"] is False                       # nothing left half done
