"""Build xpool's C core (xpool._core, CUDA's virtual-memory ops among it); the rest is Python."""
from setuptools import Extension, setup

CFLAGS = ["-O2", "-std=c11", "-Wall", "-Wno-unused-function",
          # only PyInit__core and the xpool_torch_* entry points are exported: calls between the core's
          # files are direct calls, not through the PLT
          "-fvisibility=hidden"]

setup(
    ext_modules=[
        Extension(
            "xpool._core",
            sources=["xpool/_segments.c", "xpool/_expandable.c", "xpool/_pool.c", "xpool/_ladder.c",
                     "xpool/_blocks.c", "xpool/_pages.c", "xpool/_alloc.c", "xpool/_torch.c", "xpool/_module.c",
                     "xpool/_vmm_cuda.c"],
            depends=["xpool/_core.h", "xpool/_hot.h", "xpool/_segments.h", "xpool/_expandable.h", "xpool/_vmm.h",
                     "xpool/_vmm_cuda.h"],
            extra_compile_args=CFLAGS,
        ),
    ]
)
