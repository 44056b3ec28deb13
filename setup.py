"""Build the C core of the pool (xpool._core); everything else is plain Python."""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "xpool._core",
            sources=["xpool/_core.c", "xpool/_segments.c"],
            depends=["xpool/_segments.h"],
            extra_compile_args=["-O2", "-std=c11", "-Wall", "-Wno-unused-function"],
        )
    ]
)
