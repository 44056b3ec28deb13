"""CUDA's virtual-memory ops for the expandable scheme (in the C core: _vmm_cuda.c; the ops table: _vmm.h)."""
from ._core import ABI, CAPSULE, ERROR, INVALID, OK, OOM, UNAVAILABLE, VmmError, VmmOutOfMemory, cuda_vmm  # noqa: F401
