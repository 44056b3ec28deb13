"""Which driver calls are legal while a stream captures a CUDA graph: the driver's own answer, with the calls made raw
through libcuda (ctypes), each with and without the thread's capture mode exchanged to relaxed
(cuThreadExchangeStreamCaptureMode, what xpool's ops do around a map and a reserve).

For each capture mode (global, thread-local, relaxed) and capturing stream (non_blocking: a non-blocking CuPy stream,
as the graph recipe uses; per_thread: the capturing thread's per-thread default stream, as a thread per request has)
the capture runs in one thread; the probed call runs in that thread (same_thread) or in another (other_thread) while
the capture is open:
  reserve        cuMemAddressReserve of one page (freed after the capture)
  map            cuMemCreate + cuMemMap + cuMemSetAccess + cuMemRelease of one page in a range reserved before
  unmap          cuCtxSynchronize + cuMemUnmap of one page mapped before (what an unmap of xpool's ops does)
  unmap_only     cuMemUnmap alone of a page mapped before: whether the unmap or the synchronisation ends a capture
  free           cuMemFree of a cuMemAlloc'd page (what segments gives back)
  stream_sync    cuStreamSynchronize of a non-blocking stream that does not capture, with a kernel queued on it
  event_query    cuEventQuery of an event recorded before the capture on that stream
  legacy_event   cuEventRecord on the legacy stream, then cuEventQuery: the legacy stream waits for every blocking
                 stream, the ended threads' per-thread streams among them (issue #50: whether that is a safe way to
                 know their work is done while another stream captures)
Then the capturing thread launches a kernel into the capture and ends it: `capture_ok` says whether the capture
survived (ended without error and its graph, launched, wrote what it should). A query that answers
CUDA_ERROR_NOT_READY counts as a legal call.

    python -m xlab.bench.vmm_capture --out $OUT      (~15 s on one H100: vmm_capture_probe.csv, a table)

What its answer decided: docs/decisions/0006-nothing-goes-back-while-a-stream-captures.md (the unmap rows, on the
non-blocking stream); the other ops are issue #50's question, not yet run.
"""
from __future__ import annotations

import argparse
import ctypes
import pathlib
import sys
import threading

import pandas as pd

from xlab.provenance import provenance

c_int, c_size_t, c_ull, c_void_p = ctypes.c_int, ctypes.c_size_t, ctypes.c_ulonglong, ctypes.c_void_p


class Loc(ctypes.Structure):
    _fields_ = [("type", c_int), ("id", c_int)]


class Flags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class Prop(ctypes.Structure):          # CUmemAllocationProp (xpool/_vmm_cuda.h checks the layout against cuda.h)
    _fields_ = [("type", c_int), ("requestedHandleTypes", c_int), ("location", Loc),
                ("win32HandleMetaData", c_void_p), ("allocFlags", Flags)]


class Access(ctypes.Structure):        # CUmemAccessDesc
    _fields_ = [("location", Loc), ("flags", c_int)]


RELAXED, MODES = 2, {"global": 0, "thread_local": 1, "relaxed": 2}
OPS = ("reserve", "map", "unmap", "unmap_only", "free", "stream_sync", "event_query", "legacy_event")
STREAMS = ("non_blocking", "per_thread")
NOT_READY = 600   # CUDA_ERROR_NOT_READY: a query's legal answer
VP = c_void_p


class Driver:
    def __init__(self, device: int):
        self.cu = ctypes.CDLL("libcuda.so.1")
        self.device = device
        self.prop = Prop(type=1, requestedHandleTypes=0, location=Loc(1, device))
        gran = c_size_t()
        self.check(self.cu.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(self.prop), 0), "granularity")
        self.page = gran.value

    def name(self, r: int) -> str:
        s = ctypes.c_char_p()
        self.cu.cuGetErrorName(r, ctypes.byref(s))
        return s.value.decode() if s.value else str(r)

    def check(self, r: int, what: str) -> None:
        if r:
            raise RuntimeError(f"{what}: {self.name(r)}")

    def reserve(self) -> int:
        p = c_ull()
        self.check(self.cu.cuMemAddressReserve(ctypes.byref(p), c_size_t(self.page), c_size_t(0), c_ull(0), c_ull(0)),
                   "reserve")
        return p.value

    def map_page(self, addr: int) -> list[int]:
        """cuMemCreate, cuMemMap, cuMemSetAccess, cuMemRelease of one page: each call's CUresult (stops at a
        failure, undoing what it did)."""
        h, out = c_ull(), []
        out.append(self.cu.cuMemCreate(ctypes.byref(h), c_size_t(self.page), ctypes.byref(self.prop), c_ull(0)))
        if out[-1]:
            return out
        out.append(self.cu.cuMemMap(c_ull(addr), c_size_t(self.page), c_size_t(0), h, c_ull(0)))
        if out[-1]:
            self.cu.cuMemRelease(h)
            return out
        desc = Access(Loc(1, self.device), 3)
        out.append(self.cu.cuMemSetAccess(c_ull(addr), c_size_t(self.page), ctypes.byref(desc), c_size_t(1)))
        out.append(self.cu.cuMemRelease(h))
        return out

    def unmap_page(self, addr: int) -> list[int]:
        return [self.cu.cuCtxSynchronize(), self.cu.cuMemUnmap(c_ull(addr), c_size_t(self.page))]

    def exchange(self, mode: int) -> int:
        m = c_int(mode)
        self.cu.cuThreadExchangeStreamCaptureMode(ctypes.byref(m))
        return m.value

    def alloc(self) -> int:
        p = c_ull()
        self.check(self.cu.cuMemAlloc_v2(ctypes.byref(p), c_size_t(self.page)), "alloc")
        return p.value

    def side_stream(self) -> tuple[int, int]:
        """A non-blocking stream with a kernel-free wait queued on it, and an event recorded on it after."""
        s, e = VP(), VP()
        self.check(self.cu.cuStreamCreate(ctypes.byref(s), 1), "stream")
        self.check(self.cu.cuEventCreate(ctypes.byref(e), 2), "event")   # CU_EVENT_DISABLE_TIMING
        self.check(self.cu.cuEventRecord(e, s), "record")
        return s.value, e.value


def probe(cp, drv: Driver, mode: str, where: str, op: str, exchange: bool, stream: str = "non_blocking") -> dict:
    base = drv.reserve()                               # the op's page: reserved (and mapped for unmap) beforehand
    if op in ("unmap", "unmap_only"):
        drv.check(max(drv.map_page(base)), "premap")
    mem = drv.alloc() if op == "free" else 0
    side_s, side_e = drv.side_stream() if op in ("stream_sync", "event_query") else (0, 0)
    x = cp.zeros(1 << 20, dtype=cp.float32)
    cp.cuda.Device().synchronize()
    side = cp.cuda.Stream(non_blocking=True) if stream == "non_blocking" else cp.cuda.Stream.ptds
    opened, done, got = threading.Event(), threading.Event(), {}

    def call():
        old = drv.exchange(RELAXED) if exchange else None
        try:
            if op == "reserve":
                p = c_ull()
                r = drv.cu.cuMemAddressReserve(ctypes.byref(p), c_size_t(drv.page), c_size_t(0), c_ull(0), c_ull(0))
                got["extra"] = p.value if r == 0 else 0
                got["results"] = [r]
            elif op == "map":
                got["results"] = drv.map_page(base)
            elif op == "unmap":
                got["results"] = drv.unmap_page(base)
            elif op == "unmap_only":
                got["results"] = [drv.cu.cuMemUnmap(c_ull(base), c_size_t(drv.page))]
            elif op == "free":
                got["results"] = [drv.cu.cuMemFree_v2(c_ull(mem))]
            elif op == "stream_sync":
                got["results"] = [drv.cu.cuStreamSynchronize(VP(side_s))]
            elif op == "event_query":
                got["results"] = [drv.cu.cuEventQuery(VP(side_e))]
            else:   # legacy_event
                e = VP()
                drv.check(drv.cu.cuEventCreate(ctypes.byref(e), 2), "event")
                got["legacy"] = e.value
                got["results"] = [drv.cu.cuEventRecord(e, VP(0)), drv.cu.cuEventQuery(e)]
        finally:
            if exchange:
                drv.exchange(old)

    def capture():
        try:
            with side:
                side.begin_capture(MODES[mode])
                opened.set()
                try:
                    if where == "same_thread":
                        call()
                    else:
                        done.wait(30)
                    x.fill(3)
                finally:
                    graph = side.end_capture()   # ends it even when the call or the launch raised
            graph.launch(side)
            side.synchronize()
            got["capture_ok"] = float(x[-1]) == 3.0
        except Exception as e:  # noqa: BLE001 - the probe's answer
            got["capture_ok"], got["capture_error"] = False, f"{type(e).__name__}: {e}"
            opened.set()

    t = threading.Thread(target=capture)
    t.start()
    opened.wait(30)
    if where == "other_thread":
        try:
            call()
        finally:
            done.set()
    t.join()
    cp.cuda.Device().synchronize()
    results = got.get("results", [])
    # clean up whatever stayed: a mapped page, the extra range, a buffer, a stream, events
    if op == "map" and results and all(r == 0 for r in results):
        drv.cu.cuMemUnmap(c_ull(base), c_size_t(drv.page))
    if (op == "unmap" and (len(results) < 2 or results[1] != 0)) or (op == "unmap_only" and results != [0]):
        drv.cu.cuMemUnmap(c_ull(base), c_size_t(drv.page))
    if op == "free" and results != [0]:
        drv.cu.cuMemFree_v2(c_ull(mem))
    if side_s:
        drv.cu.cuEventDestroy_v2(VP(side_e))
        drv.cu.cuStreamDestroy_v2(VP(side_s))
    if got.get("legacy"):
        drv.cu.cuEventDestroy_v2(VP(got["legacy"]))
    drv.cu.cuMemAddressFree(c_ull(base), c_size_t(drv.page))
    if got.get("extra"):
        drv.cu.cuMemAddressFree(c_ull(got["extra"]), c_size_t(drv.page))
    return dict(mode=mode, where=where, op=op, exchange_to_relaxed=exchange, stream=stream,
                calls_ok=bool(results) and all(r in (0, NOT_READY) for r in results),
                results=" ".join(drv.name(r) for r in results), capture_ok=got.get("capture_ok", False),
                capture_error=got.get("capture_error", ""))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="build/vmm_capture_probe", help="folder for vmm_capture_probe.csv")
    a = p.parse_args(argv)
    import cupy as cp
    drv = Driver(cp.cuda.Device().id)
    rows = [probe(cp, drv, mode, where, op, exchange, stream)
            for stream in STREAMS for mode in MODES for where in ("same_thread", "other_thread") for op in OPS
            for exchange in (False, True)]
    df = pd.DataFrame(rows).assign(page_bytes=drv.page, **provenance())
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    df.to_csv(out / "vmm_capture_probe.csv", index=False)
    with pd.option_context("display.width", 200, "display.max_colwidth", 80):
        print(df[["stream", "mode", "where", "op", "exchange_to_relaxed", "calls_ok", "capture_ok", "results",
                  "capture_error"]].to_string(index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
