"""Build the lab's timing probes (xlab._probes, against xpool's ops table in ../xpool/_vmm.h); the rest is Python."""
import os

from setuptools import Extension, setup

XPOOL = os.path.relpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "xpool"))

setup(ext_modules=[Extension("xlab._probes", sources=["xlab/_probes.c"], include_dirs=[XPOOL],
                             depends=[os.path.join(XPOOL, "_vmm.h")],
                             extra_compile_args=["-O2", "-std=c11", "-Wall", "-fvisibility=hidden"])])
