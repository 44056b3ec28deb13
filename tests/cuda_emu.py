"""Runs tapegpt's CUDA kernels on the CPU: the kernel source compiled by g++ against a small shim.

Each launch runs every block's warps one after another; a warp is 32 OS threads in lockstep at each shuffle
(write a slot, barrier, read a slot, barrier), which is what the kernels assume of a converged warp. A lane
that shuffles a different number of times than its warp-mates (divergent shuffles: undefined on a GPU) makes
the launch raise. Slow, but it lets the CPU tests check the kernels' indexing, masking and reductions
against the NumPy formulas before a GPU ever runs them.
"""
import ctypes
import hashlib
import os
import re
import subprocess
import tempfile

import numpy as np

from tapegpt import kernels

SHIM = r"""
#include <math.h>
#include <string.h>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>
#include <chrono>

#define __global__
#define __device__
#define __forceinline__ inline

struct emu_dim3 { unsigned x, y, z; };
static thread_local emu_dim3 threadIdx, blockIdx;
static emu_dim3 blockDim, gridDim;
static thread_local int emu_lane;
static thread_local long emu_shuffles;

struct EmuBarrier {
    std::mutex m; std::condition_variable cv; int count = 0, gen = 0; bool failed = false;
    void wait() {
        std::unique_lock<std::mutex> lk(m);
        int g = gen;
        if (++count == 32) { count = 0; ++gen; cv.notify_all(); return; }
        if (!cv.wait_for(lk, std::chrono::seconds(20), [&] { return gen != g || failed; })) failed = true;
        if (failed) { cv.notify_all(); throw 1; }
    }
};
static EmuBarrier emu_bar;
static unsigned char emu_slots[32][8];

template <class V> static V emu_exchange(V v, int src, bool keep) {
    ++emu_shuffles;
    memcpy(emu_slots[emu_lane], &v, sizeof(V));
    emu_bar.wait();
    V r = v;
    if (!keep) memcpy(&r, emu_slots[src], sizeof(V));
    emu_bar.wait();
    return r;
}
template <class V> static V __shfl_down_sync(unsigned, V v, int d) {
    return emu_exchange(v, emu_lane + d, emu_lane + d >= 32);
}
template <class V> static V __shfl_sync(unsigned, V v, int src) { return emu_exchange(v, src, false); }
static double __longlong_as_double(long long x) { double d; memcpy(&d, &x, 8); return d; }

// Runs fn for every thread of the grid, one warp at a time; returns 0, or 1 when the lanes of a warp
// shuffled different numbers of times (or deadlocked doing so).
static int emu_run(unsigned gx, unsigned gy, unsigned bx, std::function<void()> fn) {
    gridDim = {gx, gy, 1}; blockDim = {bx, 1, 1};
    emu_bar.failed = false; emu_bar.count = 0;
    std::vector<long> counts(32);
    int bad = 0;
    for (unsigned by_ = 0; by_ < gy; ++by_)
        for (unsigned bx_ = 0; bx_ < gx; ++bx_)
            for (unsigned w = 0; w < bx / 32; ++w) {
                std::vector<std::thread> lanes;
                for (int l = 0; l < 32; ++l)
                    lanes.emplace_back([&, l] {
                        blockIdx = {bx_, by_, 0}; threadIdx = {w * 32 + l, 0, 0};
                        emu_lane = l; emu_shuffles = 0;
                        try { fn(); } catch (int) { emu_shuffles = -1; }
                        counts[l] = emu_shuffles;
                    });
                for (auto& t : lanes) t.join();
                for (int l = 0; l < 32; ++l) if (counts[l] != counts[0] || counts[l] < 0) bad = 1;
                if (bad) return 1;
            }
    return 0;
}
"""

_SIG = re.compile(r'extern "C" __global__ void (\w+)\(([^)]*)\)', re.S)


def _params(text):
    """[(type, name)] of a kernel's parameter list."""
    out = []
    for p in text.replace("\n", " ").split(","):
        p = " ".join(p.split())
        name = re.findall(r"\w+$", p)[0]
        out.append((p[: -len(name)].strip(), name))
    return out


def _launchers(src):
    lines = []
    for name, params in _SIG.findall(src):
        ps = _params(params)
        decl = ", ".join(f"{t} {n}" for t, n in ps)
        call = ", ".join(n for _, n in ps)
        lines.append(f'extern "C" int launch_{name}(unsigned gx, unsigned gy, unsigned bx, {decl}) '
                     f'{{ return emu_run(gx, gy, bx, [=] {{ {name}({call}); }}); }}')
    return "\n".join(lines)


_libs = {}


def _library(dtype):
    dtype = np.dtype(dtype)
    if dtype.char in _libs:
        return _libs[dtype.char]
    src = kernels.source(dtype)
    full = SHIM + src + "\n" + _launchers(src)
    tag = hashlib.sha256(full.encode()).hexdigest()[:16]
    d = os.path.join(tempfile.gettempdir(), f"tapegpt_cuda_emu_{os.getuid()}")
    os.makedirs(d, exist_ok=True)
    so = os.path.join(d, f"k_{tag}.so")
    if not os.path.exists(so):
        cpp = os.path.join(d, f"k_{tag}.cpp")
        with open(cpp, "w") as f:
            f.write(full)
        tmp = so + f".{os.getpid()}"
        subprocess.run(["g++", "-O1", "-std=c++17", "-shared", "-fPIC", "-pthread", "-o", tmp, cpp], check=True)
        os.replace(tmp, so)
    lib = ctypes.CDLL(so)
    sigs = {name: _params(params) for name, params in _SIG.findall(src)}
    _libs[dtype.char] = (lib, sigs)
    return lib, sigs


_CT = {"i64": ctypes.c_longlong, "int": ctypes.c_int}


class Kernel:
    """Callable like a CuPy RawKernel: kernel(grid, block, args), args NumPy arrays and NumPy scalars."""

    def __init__(self, name, dtype):
        lib, sigs = _library(dtype)
        self.name, self.params = name, sigs[name]
        self.fn = getattr(lib, f"launch_{name}")
        real = ctypes.c_float if np.dtype(dtype) == np.float32 else ctypes.c_double
        self.fn.argtypes = [ctypes.c_uint] * 3 + [
            ctypes.c_void_p if "*" in t else _CT.get(t, real) for t, _ in self.params]
        self.fn.restype = ctypes.c_int
        self.launches = 0

    def __call__(self, grid, block, args):
        assert len(args) == len(self.params), (self.name, len(args), self.params)
        conv = []
        for a, (t, n) in zip(args, self.params):
            if "*" in t:
                assert isinstance(a, np.ndarray) and a.flags.c_contiguous, (self.name, n)
                conv.append(a.ctypes.data)
            else:
                assert isinstance(a, np.generic), (self.name, n, type(a))  # CuPy needs typed scalars too
                conv.append(a.item())
        gy = grid[1] if len(grid) > 1 else 1
        assert block[0] % 32 == 0
        if self.fn(grid[0], gy, block[0], *conv):
            raise RuntimeError(f"{self.name}: the lanes of a warp shuffled different numbers of times")
        self.launches += 1


_kernels = {}


def kernel(name, dtype):
    """Drop-in for tapegpt.kernels.kernel (same name and dtype arguments)."""
    key = (name, np.dtype(dtype).char)
    if key not in _kernels:
        _kernels[key] = Kernel(name, dtype)
    return _kernels[key]
