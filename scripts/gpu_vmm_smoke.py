"""The expandable scheme's CUDA ops and range manager on a GPU, before they are wired into the pool
(Note [Expandable segments]): every check it can make, and what a miss costs.

Through xpool._vmm's CUDA ops and the range manager under the test harness (tests/xpool/fixtures/expandable.py) it
reserves a range on device 0, maps pages, writes and reads them back through CuPy, runs a CuPy kernel, a matmul
and an NCCL all-reduce (one rank) on such memory, unmaps and releases, checks the error paths (out of range,
misaligned, double map, out of memory with nothing left mapped, capture; a double unmap is observed, not required
(the driver accepts one)), and times map and unmap
per page and per 64 MiB beside cudaMalloc/cudaFree, trials interleaved across arms.

    python3 scripts/gpu_vmm_smoke.py --out $OUT        (scripts/gpu_vmm_smoke.sh builds what it needs first)
    python3 scripts/gpu_vmm_smoke.py --backend host    (a dry run on a CPU: the host twin, no CuPy or NCCL)

Writes vmm_smoke.log, vmm_smoke.csv (one row per trial and arm, provenance columns) and vmm_smoke_checks.csv
under --out; prints a table.  Exit status 1 when a check fails.
"""
from __future__ import annotations

import argparse
import ctypes
import pathlib
import sys
import time
import traceback

import numpy as np
import pandas as pd

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from fixtures import expandable as E  # noqa: E402
from xlab.intervals import median_ci  # noqa: E402
from xlab.provenance import provenance  # noqa: E402
from xpool import _vmm  # noqa: E402
import xpool_twin  # noqa: E402

MiB = 1 << 20


class Smoke:
    def __init__(self, backend: str, out: pathlib.Path, trials: int):
        self.backend, self.out, self.trials = backend, out, trials
        self.log_lines: list[str] = []
        self.checks: list[dict] = []
        self.rows: list[dict] = []
        if backend == "cuda":
            import cupy
            self.cp = cupy
            self.capsule = _vmm.cuda_vmm()
            self.total = cupy.cuda.runtime.memGetInfo()[1]
        else:
            self.cp = None
            self.twin = xpool_twin.HostTwin(1, capacity=1 << 30, granularity=2 * MiB)
            self.capsule = self.twin.vmm()
            self.total = 1 << 30
        self.ops = xpool_twin.Ops(self.capsule)
        self.G = self.ops.granularity(0)
        self.lib = E.build()   # in a temporary directory: nothing built lands in --out

    def log(self, msg: str) -> None:
        print(msg, flush=True)
        self.log_lines.append(msg)

    def check(self, name: str, fn, must: bool = True) -> None:
        """Runs one check: fn() returns a detail string (or raises AssertionError); must=False only observes."""
        t0 = time.perf_counter()
        try:
            detail, ok = fn() or "", True
        except AssertionError as e:
            detail, ok = f"FAILED: {e}", False
        except Exception as e:   # noqa: BLE001 -- a check that raises is a failed check, with its traceback
            detail, ok = f"FAILED: {type(e).__name__}: {e}", False
            self.log_lines.append(traceback.format_exc())
        ok = ok or not must
        self.checks.append(dict(check=name, ok=ok, must=must, detail=detail,
                                seconds=round(time.perf_counter() - t0, 3)))
        self.log(f"[{'ok ' if ok else 'BAD'}] {name}: {detail}")

    def free_bytes(self) -> int:
        if self.cp is None:
            return self.total - self.twin.mapped_bytes(0)
        self.cp.get_default_memory_pool().free_all_blocks()
        self.cp.cuda.Device(0).synchronize()
        return self.cp.cuda.runtime.memGetInfo()[0]

    def pool(self) -> E.Pool:
        return E.Pool(self.lib, self.capsule, 0, range_bytes=self.total + self.total // 8)

    def view(self, ptr: int, nbytes: int, dtype, owner):
        """A CuPy array over [ptr, ptr + nbytes) (or a NumPy one over host memory)."""
        n = nbytes // np.dtype(dtype).itemsize
        if self.cp is None:
            return np.ctypeslib.as_array((ctypes.c_char * nbytes).from_address(ptr)).view(dtype)[:n]
        cp = self.cp
        mem = cp.cuda.UnownedMemory(ptr, nbytes, owner, 0)
        return cp.ndarray((n,), dtype, cp.cuda.MemoryPointer(mem, 0))

    # ------------------------------------------------------------ checks

    def run_checks(self) -> None:
        G, ops = self.G, self.ops
        self.check("granularity", lambda: f"{G} B on device 0 ({self.backend})")

        def round_trip():
            pool = self.pool()
            sizes = [512, G - 512, G, 3 * G + 100, 64 * MiB + 12345]
            blocks = [(pool.alloc(n), n) for n in sizes]
            for i, (p, n) in enumerate(blocks):
                a = self.view(p, n, np.uint8, pool)
                want = (np.arange(n) * (i + 7) % 251).astype(np.uint8)
                a[...] = want if self.cp is None else self.cp.asarray(want)
            for i, (p, n) in enumerate(blocks):
                got = self.view(p, n, np.uint8, pool)
                got = got if self.cp is None else self.cp.asnumpy(got)
                assert np.array_equal(got, (np.arange(n) * (i + 7) % 251).astype(np.uint8)), f"block {i} differs"
            pool.check()
            s = pool.stats()
            pool.destroy()
            return f"{len(sizes)} blocks written and read back; {s['maps']} maps, {s['map_pages']} pages"
        self.check("write and read back", round_trip)

        def kernels():
            if self.cp is None:
                return "skipped (no CuPy)"
            cp, pool = self.cp, self.pool()
            n = 1 << 20
            x, y, z = (self.view(pool.alloc(4 * n), 4 * n, np.float32, pool) for _ in range(3))
            x[...] = cp.arange(n, dtype=cp.float32)
            y[...] = 1.5
            cp.ElementwiseKernel("float32 x, float32 y", "float32 z", "z = 2 * x + y", "xpool_axpy")(x, y, z)
            assert np.array_equal(cp.asnumpy(z), 2 * np.arange(n, dtype=np.float32) + 1.5), "axpy differs"
            k = 512
            a, b, c = (self.view(pool.alloc(4 * k * k), 4 * k * k, np.float32, pool).reshape(k, k) for _ in range(3))
            rng = np.random.default_rng(0)
            ha, hb = rng.standard_normal((k, k), np.float32), rng.standard_normal((k, k), np.float32)
            a[...], b[...] = cp.asarray(ha), cp.asarray(hb)
            cp.matmul(a, b, out=c)
            err = float(np.max(np.abs(cp.asnumpy(c) - ha @ hb)))
            assert err < 1e-2, f"matmul differs by {err}"
            pool.destroy()
            return f"axpy exact, matmul {k}x{k} max error {err:.1e}"
        self.check("a kernel and a matmul on mapped memory", kernels)

        def allreduce():
            if self.cp is None:
                return "skipped (no CuPy)"
            cp = self.cp
            from cupy.cuda import nccl
            pool = self.pool()
            n = 1 << 20
            send = self.view(pool.alloc(4 * n), 4 * n, np.float32, pool)
            recv = self.view(pool.alloc(4 * n), 4 * n, np.float32, pool)
            send[...] = cp.arange(n, dtype=cp.float32)
            recv[...] = -1
            comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
            stream = cp.cuda.get_current_stream()
            comm.allReduce(send.data.ptr, recv.data.ptr, n, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)
            stream.synchronize()
            assert np.array_equal(cp.asnumpy(recv), np.arange(n, dtype=np.float32)), "all-reduce differs"
            comm.destroy()
            pool.destroy()
            return f"{4 * n >> 20} MiB all-reduced (1 rank), exact"
        self.check("NCCL all-reduce from mapped memory", allreduce)

        def physical_memory_comes_back():
            before = self.free_bytes()
            pool = self.pool()
            want = min(1 << 30, self.total // 4)
            ptr = pool.alloc(want)
            during = self.free_bytes()
            pool.free(ptr)
            unmapped = pool.release()
            after = self.free_bytes()
            pool.check()
            pool.destroy()
            assert before - during >= want, f"mapping {want} B took only {before - during} B"
            assert unmapped >= want, f"release unmapped {unmapped} B"
            assert abs(after - before) <= 16 * MiB, f"free memory {before} B before, {after} B after"
            return f"{want >> 20} MiB mapped took {(before - during) >> 20} MiB; all back after release"
        self.check("unmapping gives physical memory back", physical_memory_comes_back)

        def must_fail(fn, what):
            try:
                fn()
            except _vmm.VmmError as e:
                return f"{what}: {type(e).__name__} status {e.status}: {e}"
            raise AssertionError(f"{what}: no error")

        def error_paths():
            a = ops.reserve(0, 16 * G)
            out = [must_fail(lambda: ops.map(0, a + 512, G), "misaligned")]
            ops.map(0, a, G)
            out.append(must_fail(lambda: ops.map(0, a, G), "double map"))
            assert ops.unmap(0, a, G) == G
            ops.release(0, a, 16 * G)
            out.append(must_fail(lambda: ops.map(0, a, G), "map in a released range"))
            out.append(must_fail(lambda: ops.granularity(99), "device 99"))
            return "; ".join(out)
        self.check("error paths", error_paths)

        def observe_double_unmap():
            # the H200's driver (580.159.04) returned CUDA_SUCCESS here in both of #22's sixth-session runs: the
            # driver does not guard against it, so the range manager must (it never plans an unmapped page, and the
            # host twin refuses a double unmap, so the CPU tests catch one)
            a = ops.reserve(0, 4 * G)
            ops.map(0, a, G)
            assert ops.unmap(0, a, G) == G
            try:
                done = ops.unmap(0, a, G)
                outcome = f"the driver accepted a second unmap of the same page ({done} B reported)"
            except _vmm.VmmError as e:
                outcome = f"refused ({e})"
            ops.release(0, a, 4 * G)
            return outcome
        self.check("a second unmap of an unmapped page", observe_double_unmap, must=False)

        def observe_release_with_pages():
            a = ops.reserve(0, 4 * G)
            ops.map(0, a, G)
            try:
                ops.release(0, a, 4 * G)
                outcome = "the driver released a range with a page mapped"
                return outcome
            except _vmm.VmmError as e:
                ops.unmap(0, a, G)
                ops.release(0, a, 4 * G)
                return f"refused ({e})"
        self.check("release of a range with a page mapped", observe_release_with_pages, must=False)

        def observe_unmap_across_mappings():
            a = ops.reserve(0, 8 * G, align=4 * G)
            ops.map(0, a, 4 * G)                 # four page mappings
            try:
                done = ops.unmap(0, a, 4 * G, page=4 * G)   # one cuMemUnmap over all four
                ops.release(0, a, 8 * G)
                return f"one cuMemUnmap over 4 page mappings worked ({done} B)"
            except _vmm.VmmError as e:
                ops.unmap(0, a, 4 * G)
                ops.release(0, a, 8 * G)
                return f"refused ({e}): unmaps stay one call per page"
        self.check("one unmap over several page mappings", observe_unmap_across_mappings, must=False)

        def out_of_memory():
            big = 1 << 30 if self.G <= 1 << 30 else self.G
            span = (self.total + 4 * big) // big * big
            a = ops.reserve(0, span, align=big)
            before = self.free_bytes()
            t0 = time.perf_counter()
            try:
                ops.map(0, a, span, page=big)
                ops.unmap(0, a, span, page=big)
                raise AssertionError(f"mapping {span} B on a {self.total} B device did not fail")
            except MemoryError as e:
                took = time.perf_counter() - t0
                msg = str(e)
            after = self.free_bytes()
            ops.release(0, a, span)
            assert abs(after - before) <= 16 * MiB, f"free memory {before} B before, {after} B after the failure"
            return f"VmmOutOfMemory in {took:.2f} s, nothing left mapped ({msg})"
        self.check("out of memory leaves nothing mapped", out_of_memory)

        def oom_through_the_pool():
            # the device filled with cudaMalloc first but 64 MiB, so the miss fails after a few dozen pages (a miss
            # larger than the device would make and undo ~70k pages three times over: seconds)
            want = 256 * MiB
            hog = None
            if self.cp is None:
                self.twin.set_capacity(0, 64 * MiB)
            else:
                rt = self.cp.cuda.runtime
                left = self.free_bytes() - 64 * MiB
                while hog is None and left > 0:
                    try:
                        hog = rt.malloc(left)
                    except rt.CUDARuntimeError:
                        left -= 64 * MiB
            pool = self.pool()
            try:
                pool.alloc(want)
                raise AssertionError(f"a {want >> 20} MiB miss succeeded on a full device")
            except E.HarnessError as e:
                assert e.status == _vmm.OOM, e
                msg = str(e)
            finally:
                if hog is not None:
                    self.cp.cuda.runtime.free(hog)
                if self.cp is None:
                    self.twin.set_capacity(0, self.total)
            s = pool.stats()
            pool.check()
            pool.destroy()
            assert s["mapped"] == 0, s
            return f"status OOM, 0 B mapped after it ({msg})"
        self.check("a pool miss out of memory", oom_through_the_pool)

        def capture():
            if self.cp is None:
                self.twin.set_capturing(0, True)
                yes = ops.capturing(0, 0)
                self.twin.set_capturing(0, False)
                assert yes and not ops.capturing(0, 0)
                return "the twin's capture flag"
            cp = self.cp
            s = cp.cuda.Stream(non_blocking=True)
            assert not ops.capturing(0, s.ptr)
            a = ops.reserve(0, 4 * G)
            x = cp.zeros(16, cp.float32)
            with s:
                s.begin_capture()
                during = ops.capturing(0, s.ptr)
                ops.map(0, a, G)                 # a miss while capturing: relaxed mode makes it legal
                x += 1
                graph = s.end_capture()
            graph.launch(s)
            s.synchronize()
            after = ops.capturing(0, s.ptr)
            ops.unmap(0, a, G)
            ops.release(0, a, 4 * G)
            assert during and not after and float(x[0]) == 1.0, (during, after, float(x[0]))
            return "capturing() true while capturing; a map during capture kept the graph valid"
        self.check("capture", capture)

    # ------------------------------------------------------------ timings

    def time_arms(self) -> None:
        G, ops = self.G, self.ops
        chunk = 64 * MiB
        per_page_reps, chunk_reps = 50, 5

        def vmm(nbytes, page, reps):
            a = ops.reserve(0, reps * nbytes, align=max(page, G))
            t0 = time.perf_counter()
            for i in range(reps):
                ops.map(0, a + i * nbytes, nbytes, page=page)
            t1 = time.perf_counter()
            for i in range(reps):
                ops.unmap(0, a + i * nbytes, nbytes, page=page)
            t2 = time.perf_counter()
            ops.release(0, a, reps * nbytes)
            return (t1 - t0) / reps, (t2 - t1) / reps

        def malloc(nbytes, reps):
            if self.cp is None:
                return None
            rt = self.cp.cuda.runtime
            t0 = time.perf_counter()
            ptrs = [rt.malloc(nbytes) for _ in range(reps)]
            t1 = time.perf_counter()
            for p in ptrs:
                rt.free(p)
            t2 = time.perf_counter()
            return (t1 - t0) / reps, (t2 - t1) / reps

        def pool_miss(nbytes, reps):
            pool = self.pool()
            pool.alloc(G)                                   # the first miss reserves the range: not timed
            t0 = time.perf_counter()
            ptrs = [pool.alloc(nbytes) for _ in range(reps)]   # each a miss: plan, map, finish
            t1 = time.perf_counter()
            for p in ptrs:
                pool.free(p)
            pool.release()                                  # one unmap of all of it
            t2 = time.perf_counter()
            pool.destroy()
            return (t1 - t0) / reps, (t2 - t1) / reps

        arms = {
            "vmm_page": (G, 1, lambda: vmm(G, G, per_page_reps)),
            "vmm_64MiB_in_pages": (chunk, chunk // G, lambda: vmm(chunk, G, chunk_reps)),
            "vmm_64MiB_one_allocation": (chunk, 1, lambda: vmm(chunk, chunk, chunk_reps)),
            "pool_miss_64MiB": (chunk, chunk // G, lambda: pool_miss(chunk, chunk_reps)),
            "cudaMalloc_page": (G, 1, lambda: malloc(G, per_page_reps)),
            "cudaMalloc_64MiB": (chunk, 1, lambda: malloc(chunk, chunk_reps)),
        }
        for name, (_, _, fn) in arms.items():   # warm-up: first calls load and initialise
            fn()
        for trial in range(self.trials):        # interleaved: every arm once per trial
            for name, (nbytes, pages, fn) in arms.items():
                r = fn()
                if r is None:
                    continue
                for op, seconds in zip(("map", "unmap"), r):
                    self.rows.append(dict(trial=trial, case=name, op=op, bytes=nbytes, pages=pages,
                                          us_per_call=1e6 * seconds))
        prov = provenance(experiment="vmm_smoke", backend=self.backend, granularity=G, trials=self.trials,
                          device_total_bytes=self.total)
        self.rows = [row | prov for row in self.rows]

    def table(self) -> pd.DataFrame:
        df = pd.DataFrame(self.rows)
        out = []
        for (arm, op), g in df.groupby(["case", "op"], sort=False):
            med, lo, hi, n = median_ci(g.us_per_call)
            out.append(dict(case=arm, op=op, bytes=int(g.bytes.iloc[0]), pages=int(g.pages.iloc[0]),
                            median_us=round(med, 1), ci95=f"[{lo:.1f}, {hi:.1f}]", trials=n,
                            us_per_MiB=round(med / (g.bytes.iloc[0] / MiB), 2)))
        return pd.DataFrame(out)

    def write(self) -> int:
        self.out.mkdir(parents=True, exist_ok=True)
        if self.rows:
            pd.DataFrame(self.rows).to_csv(self.out / "vmm_smoke.csv", index=False)
            t = self.table()
            self.log("\n" + t.to_string(index=False))
        checks = pd.DataFrame(self.checks)
        checks.to_csv(self.out / "vmm_smoke_checks.csv", index=False)
        bad = checks[~checks.ok]
        self.log(f"\n{len(checks) - len(bad)} of {len(checks)} checks passed" +
                 ("" if bad.empty else ": FAILED " + ", ".join(bad.check)))
        (self.out / "vmm_smoke.log").write_text("\n".join(self.log_lines) + "\n")
        return 1 if len(bad) else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="build/vmm_smoke", help="directory for the log and the CSVs")
    ap.add_argument("--backend", choices=["cuda", "host"], default="cuda", help="host: a dry run on a CPU")
    ap.add_argument("--trials", type=int, default=7, help="trials per timed arm, interleaved")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    s = Smoke(args.backend, pathlib.Path(args.out), args.trials)
    s.log(f"xpool vmm smoke: backend {args.backend}, granularity {s.G} B, device {s.total} B")
    s.run_checks()
    try:
        s.time_arms()
    except Exception as e:   # noqa: BLE001 -- the checks' results are still written
        s.checks.append(dict(check="timings", ok=False, must=True, detail=f"{type(e).__name__}: {e}", seconds=0))
        s.log_lines.append(traceback.format_exc())
    s.log(f"total {time.perf_counter() - t0:.1f} s")
    return s.write()


if __name__ == "__main__":
    sys.exit(main())
