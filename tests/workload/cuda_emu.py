"""Runs tapegpt's CUDA kernels on the CPU: the kernel source compiled by g++ against a small shim.

Each launch runs the blocks one after another, every thread of a block an OS thread; a warp's 32 threads are
in lockstep at each shuffle (write a slot, barrier, read a slot, barrier), which is what the kernels assume of
a converged warp, and __syncthreads is a barrier of the block. A lane that shuffles a different number of times
than its warp-mates (divergent shuffles), or a thread that passes __syncthreads a different number of times
than the rest of its block (both undefined on a GPU), makes the launch raise. Every pointer is bounds-checked
(the source's `T*` become a checked pointer type here, and a `__shared__` array passed as one is checked too),
so a read or write outside an array (which on a GPU would hit a neighbour, or xpool's debug canary) raises too.
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
#define __shared__ static
#define __launch_bounds__(...)

struct emu_dim3 { unsigned x, y, z; };
static thread_local emu_dim3 threadIdx, blockIdx;
static emu_dim3 blockDim, gridDim;
static thread_local int emu_lane, emu_warp;
static thread_local long emu_shuffles, emu_syncs;

// A barrier for `expected` threads; a thread that exits leaves it, so the others are not left waiting for it
// (the launch then fails on the per-thread counts instead of timing out).
struct EmuBarrier {
    std::mutex m; std::condition_variable cv; int count = 0, expected = 0, gen = 0; bool failed = false;
    void reset(int n) { count = 0; expected = n; failed = false; }
    void release() { count = 0; ++gen; cv.notify_all(); }
    void wait() {
        std::unique_lock<std::mutex> lk(m);
        if (failed) throw 1;
        int g = gen;
        if (++count >= expected) { release(); return; }
        if (!cv.wait_for(lk, std::chrono::seconds(20), [&] { return gen != g || failed; })) failed = true;
        if (failed) { cv.notify_all(); throw 1; }
    }
    void leave() {
        std::lock_guard<std::mutex> lk(m);
        --expected;
        if (count > 0 && count >= expected) release();
    }
};
static EmuBarrier emu_warp_bar[32], emu_block_bar;    // per warp (shuffles), per block (__syncthreads)
static unsigned char emu_slots[32][32][8];             // [warp][lane]: a shuffle's values

template <class V> static V emu_exchange(V v, int src, bool keep) {
    ++emu_shuffles;
    memcpy(emu_slots[emu_warp][emu_lane], &v, sizeof(V));
    emu_warp_bar[emu_warp].wait();
    V r = v;
    if (!keep) memcpy(&r, emu_slots[emu_warp][src], sizeof(V));
    emu_warp_bar[emu_warp].wait();
    return r;
}
template <class V> static V __shfl_down_sync(unsigned, V v, int d) {
    return emu_exchange(v, emu_lane + d, emu_lane + d >= 32);
}
template <class V> static V __shfl_sync(unsigned, V v, int src) { return emu_exchange(v, src, false); }
static void __syncthreads() { ++emu_syncs; emu_block_bar.wait(); }
static double __longlong_as_double(long long x) { double d; memcpy(&d, &x, 8); return d; }

// IEEE round-to-nearest operations (built with -ffp-contract=off, so no FMA here either).
static float __fadd_rn(float a, float b) { return a + b; }
static float __fsub_rn(float a, float b) { return a - b; }
static float __fmul_rn(float a, float b) { return a * b; }
static float __fdiv_rn(float a, float b) { return a / b; }
static float __fsqrt_rn(float a) { return sqrtf(a); }
static double __dadd_rn(double a, double b) { return a + b; }
static double __dsub_rn(double a, double b) { return a - b; }
static double __dmul_rn(double a, double b) { return a * b; }
static double __ddiv_rn(double a, double b) { return a / b; }
static double __dsqrt_rn(double a) { return sqrt(a); }

// A pointer that knows its array: out-of-bounds accesses are recorded (the launch then fails), not performed.
static std::mutex emu_oob_lock;
static char emu_oob_msg[256];
static int emu_oob_flag = 0;
template <class U> struct EmuPtr {
    U* base; long long size, off; const char* name;
    EmuPtr(U* b, long long n, const char* nm) : base(b), size(n), off(0), name(nm) {}
    template <size_t N> EmuPtr(U (&a)[N]) : base(a), size(N), off(0), name("__shared__") {}
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

// Runs fn for every thread of the grid, one block at a time, all of a block's threads at once (each an OS
// thread: __syncthreads is a barrier of the block, a shuffle one of the warp). `__shared__` is `static`, so
// the blocks, run one after another, each have it to themselves. Returns 0; 1 when the lanes of a warp
// shuffled different numbers of times (or deadlocked doing so); 2 on an out-of-bounds access; 3 when the
// threads of a block passed __syncthreads different numbers of times (undefined on a GPU).
static int emu_run(unsigned gx, unsigned gy, unsigned bx, unsigned by, std::function<void()> fn) {
    gridDim = {gx, gy, 1}; blockDim = {bx, by, 1};
    const int nt = (int)(bx * by);
    emu_oob_flag = 0;
    std::vector<long> shuffles(nt), syncs(nt);
    for (unsigned by_ = 0; by_ < gy; ++by_)
        for (unsigned bx_ = 0; bx_ < gx; ++bx_) {
            emu_block_bar.reset(nt);
            for (int w = 0; w < nt / 32; ++w) emu_warp_bar[w].reset(32);
            std::vector<std::thread> threads;
            for (int t = 0; t < nt; ++t)
                threads.emplace_back([&, t] {
                    blockIdx = {bx_, by_, 0}; threadIdx = {t % bx, t / bx, 0};
                    emu_lane = t % 32; emu_warp = t / 32; emu_shuffles = 0; emu_syncs = 0;
                    try { fn(); } catch (int) { emu_shuffles = -1; }
                    shuffles[t] = emu_shuffles; syncs[t] = emu_syncs;
                    emu_warp_bar[t / 32].leave();
                    emu_block_bar.leave();
                });
            for (auto& th : threads) th.join();
            for (int t = 0; t < nt; ++t) if (shuffles[t] != shuffles[t - t % 32] || shuffles[t] < 0) return 1;
            for (int t = 0; t < nt; ++t) if (syncs[t] != syncs[0]) return 3;
            if (emu_oob_flag) return 2;
        }
    return 0;
}
"""

_SIG = re.compile(r'extern "C" __global__ void (\w+)\(([^)]*)\)\s*\{', re.S)   # definitions only


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
        lines.append(f'extern "C" int launch_{name}(unsigned gx, unsigned gy, unsigned bx, unsigned by, {decl}) '
                     f'{{ {wrap} return emu_run(gx, gy, bx, by, [=] {{ {name}({call}); }}); }}')
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
        subprocess.run(["g++", "-O1", "-std=c++17", "-ffp-contract=off", "-shared", "-fPIC", "-pthread", "-o", tmp,
                        cpp], check=True)
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
        types = [ctypes.c_uint] * 4
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
        by = block[1] if len(block) > 1 else 1
        assert (block[0] * by) % 32 == 0 and block[0] * by <= 1024, block   # whole warps, as the kernels assume
        status = self.fn(grid[0], gy, block[0], by, *conv)
        if status == 1:
            raise RuntimeError(f"{self.name}: the lanes of a warp shuffled different numbers of times")
        if status == 2:
            raise IndexError(f"{self.name}: {self.message().decode()}")
        if status == 3:
            raise RuntimeError(f"{self.name}: the threads of a block passed __syncthreads different numbers of times")
        self.launches += 1


_kernels = {}


def kernel(name, dtype):
    """Drop-in for tapegpt.kernels.kernel (same name and dtype arguments)."""
    key = (name, np.dtype(dtype).char)
    if key not in _kernels:
        _kernels[key] = Kernel(name, dtype)
    return _kernels[key]
