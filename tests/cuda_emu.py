"""Runs tapegpt's CUDA kernels on the CPU: the kernel source compiled by g++ against a small shim.

Each launch runs every block's warps one after another; a warp is 32 OS threads in lockstep at each shuffle
(write a slot, barrier, read a slot, barrier), which is what the kernels assume of a converged warp. A lane
that shuffles a different number of times than its warp-mates (divergent shuffles: undefined on a GPU) makes
the launch raise. Every pointer is bounds-checked (the source's `T*` become a checked pointer type here), so
a read or write outside an array (which on a GPU would hit a neighbour, or xpool's debug canary) raises too.
Slow, but it lets the CPU tests check the kernels' indexing, masking and reductions against the NumPy formulas
before a GPU ever runs them.
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
#include <stdio.h>
#include <string.h>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <type_traits>
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

// A pointer that knows its array: out-of-bounds accesses are recorded (the launch then fails), not performed.
static std::mutex emu_oob_lock;
static char emu_oob_msg[256];
static int emu_oob_flag = 0;
template <class U> struct EmuPtr {
    U* base; long long size, off; const char* name;
    EmuPtr(U* b, long long n, const char* nm) : base(b), size(n), off(0), name(nm) {}
    EmuPtr operator+(long long k) const { EmuPtr r = *this; r.off += k; return r; }
    U& operator[](long long i) const {
        long long j = off + i;
        if (j < 0 || j >= size) {
            std::lock_guard<std::mutex> g(emu_oob_lock);
            if (!emu_oob_flag) snprintf(emu_oob_msg, sizeof emu_oob_msg, "%s[%lld] outside 0..%lld", name, j, size);
            emu_oob_flag = 1;
            static thread_local std::remove_const_t<U> dummy;
            return dummy;
        }
        return base[j];
    }
};
extern "C" const char* emu_oob_message() { return emu_oob_msg; }

// Runs fn for every thread of the grid, one warp at a time; returns 0, or 1 when the lanes of a warp
// shuffled different numbers of times (or deadlocked doing so).
static int emu_run(unsigned gx, unsigned gy, unsigned bx, std::function<void()> fn) {
    gridDim = {gx, gy, 1}; blockDim = {bx, 1, 1};
    emu_bar.failed = false; emu_bar.count = 0; emu_oob_flag = 0;
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
                if (emu_oob_flag) return 2;
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


def _checked(src):
    """The kernel source with every pointer (parameter or local) made an EmuPtr."""
    src = re.sub(r"\bconst (T|i64)\* ", r"EmuPtr<const \1> ", src)
    return re.sub(r"\bT\* ", "EmuPtr<T> ", src)


def _launchers(src):
    lines = []
    for name, params in _SIG.findall(src):
        ps = _params(params)
        decl = ", ".join(f"void* p_{n}, long long n_{n}" if "*" in t else f"{t} {n}" for t, n in ps)
        wrap = " ".join(f'EmuPtr<{t.rstrip("*").strip()}> {n}(({t})p_{n}, n_{n}, "{n}");' for t, n in ps if "*" in t)
        call = ", ".join(n for _, n in ps)
        lines.append(f'extern "C" int launch_{name}(unsigned gx, unsigned gy, unsigned bx, {decl}) '
                     f'{{ {wrap} return emu_run(gx, gy, bx, [=] {{ {name}({call}); }}); }}')
    return "\n".join(lines)


_libs = {}


def _library(dtype):
    dtype = np.dtype(dtype)
    if dtype.char in _libs:
        return _libs[dtype.char]
    src = kernels.source(dtype)
    full = SHIM + _checked(src) + "\n" + _launchers(src)
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
        self.name, self.params, self.dtype = name, sigs[name], np.dtype(dtype)
        self.fn = getattr(lib, f"launch_{name}")
        real = ctypes.c_float if np.dtype(dtype) == np.float32 else ctypes.c_double
        types = [ctypes.c_uint] * 3
        for t, _ in self.params:
            types += [ctypes.c_void_p, ctypes.c_longlong] if "*" in t else [_CT.get(t, real)]
        self.fn.argtypes = types
        self.fn.restype = ctypes.c_int
        self.message = lib.emu_oob_message
        self.message.restype = ctypes.c_char_p
        self.launches = 0

    def __call__(self, grid, block, args):
        assert len(args) == len(self.params), (self.name, len(args), self.params)
        conv = []
        for a, (t, n) in zip(args, self.params):
            if "*" in t:
                assert isinstance(a, np.ndarray) and a.flags.c_contiguous, (self.name, n)
                elem = {"T": self.dtype, "i64": np.dtype(np.int64)}[t.replace("const", "").strip(" *")]
                assert a.dtype == elem, (self.name, n, a.dtype, t)
                conv += [a.ctypes.data, a.size]
            else:
                # CuPy passes a NumPy scalar with its own width: it must be the parameter's type exactly.
                want = {"i64": np.int64, "int": np.int32, "T": self.dtype.type}[t]
                assert type(a) is want, (self.name, n, type(a), t)
                conv.append(a.item())
        gy = grid[1] if len(grid) > 1 else 1
        assert block[0] % 32 == 0
        status = self.fn(grid[0], gy, block[0], *conv)
        if status == 1:
            raise RuntimeError(f"{self.name}: the lanes of a warp shuffled different numbers of times")
        if status == 2:
            raise IndexError(f"{self.name}: {self.message().decode()}")
        self.launches += 1


_kernels = {}


def kernel(name, dtype):
    """Drop-in for tapegpt.kernels.kernel (same name and dtype arguments)."""
    key = (name, np.dtype(dtype).char)
    if key not in _kernels:
        _kernels[key] = Kernel(name, dtype)
    return _kernels[key]
