"""Build the lab's timing probes (xlab._probes); the rest of the lab is Python."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("xlab._probes", sources=["xlab/_probes.c"],
                             extra_compile_args=["-O2", "-std=c11", "-Wall", "-fvisibility=hidden"])])
