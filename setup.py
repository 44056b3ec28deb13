"""Build the C core of the pool (xpool._core) and the virtual-memory ops (xpool._vmm); the rest is plain Python."""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "xpool._core",
            sources=["xpool/_core.c", "xpool/_segments.c"],
            depends=["xpool/_segments.h"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wno-unused-function"],
        ),
        Extension(
            "xpool._vmm",
            sources=["xpool/_vmm_module.c", "xpool/_vmm.c"],
            depends=["xpool/_vmm.h", "xpool/_vmm_cuda.h"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wno-unused-function"],
        ),
    ]
)
