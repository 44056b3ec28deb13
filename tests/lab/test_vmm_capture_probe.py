"""The capture-legality probe (xlab.bench.vmm_capture) over a fake libcuda and a fake CuPy: every op, stream and
mode runs through the probe's own code on a CPU, so a renamed driver call or a lost cleanup fails here before a GPU
run would find it.  The driver's answers themselves come only from a GPU (gpu_suite.sh's expandable stage)."""
import ctypes
import threading

import pytest

from xlab.bench import vmm_capture as vc

CAPTURE_UNSUPPORTED = 900


class FakeCu:
    """libcuda's calls the probe makes: each answers `answers.get(name, 0)`, fills its out-pointers, and is counted;
    live buffers, mappings, streams and events are tracked so the test can see the probe clean up."""

    def __init__(self, answers=None):
        self.answers, self.calls, self.live, self._n = answers or {}, [], set(), 0
        self.lock = threading.Lock()

    def _new(self, kind, out=None):
        with self.lock:
            self._n += 1
            h = (kind, self._n)
            self.live.add(h)
        if out is not None:
            out._obj.value = self._n << 21       # page-aligned, nonzero
        return h

    def _gone(self, kind, value):
        with self.lock:
            self.live = {h for h in self.live if not (h[0] == kind and h[1] << 21 == value)}

    def __getattr__(self, name):
        def call(*args):
            with self.lock:
                self.calls.append(name)
            r = self.answers.get(name, 0)
            if r:
                return r
            if name == "cuMemGetAllocationGranularity":
                args[0]._obj.value = 2 << 20
            elif name in ("cuMemAddressReserve", "cuMemAlloc_v2", "cuStreamCreate", "cuEventCreate"):
                self._new({"cuMemAddressReserve": "range", "cuMemAlloc_v2": "buffer", "cuStreamCreate": "stream",
                           "cuEventCreate": "event"}[name], args[0])
            elif name == "cuMemMap":
                self._new("map_" + str(_value(args[0])))
            elif name == "cuMemUnmap":
                with self.lock:
                    self.live.discard(next((h for h in self.live if h[0] == "map_" + str(_value(args[0]))), None))
            elif name in ("cuMemAddressFree", "cuMemFree_v2", "cuStreamDestroy_v2", "cuEventDestroy_v2"):
                kind = {"cuMemAddressFree": "range", "cuMemFree_v2": "buffer", "cuStreamDestroy_v2": "stream",
                        "cuEventDestroy_v2": "event"}[name]
                self._gone(kind, _value(args[0]))
            elif name == "cuGetErrorName":
                args[1]._obj.value = b"CUDA_SUCCESS" if args[0] == 0 else b"CUDA_ERROR_%d" % args[0]
            return 0
        return call


def _value(x):
    return getattr(x, "value", x)


class FakeCupy:
    """The little of CuPy the probe uses: an array that fill() writes, streams that capture into a graph."""

    class _Array:
        def __init__(self, n):
            self.v = [0.0] * 2

        def fill(self, v):
            self.v = [float(v)] * 2

        def __getitem__(self, i):
            return self.v[i]

    float32 = "float32"

    def zeros(self, n, dtype=None):
        return self._Array(n)

    class cuda:
        class Device:
            id = 0

            def synchronize(self):
                pass

        class Stream:
            ptds = None

            def __init__(self, non_blocking=False):
                self.capturing = False

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

            def begin_capture(self, mode):
                assert mode in vc.MODES.values()
                self.capturing = True

            def end_capture(self):
                self.capturing = False
                return type("Graph", (), {"launch": lambda g, s: None})()

            def synchronize(self):
                pass


FakeCupy.cuda.Stream.ptds = FakeCupy.cuda.Stream()


def driver(cu):
    drv = vc.Driver.__new__(vc.Driver)
    drv.cu, drv.device, drv.page = cu, 0, 2 << 20
    drv.prop = vc.Prop(type=1, requestedHandleTypes=0, location=vc.Loc(1, 0))
    return drv


@pytest.mark.parametrize("stream", vc.STREAMS)
@pytest.mark.parametrize("op", vc.OPS)
def test_every_op_runs_and_cleans_up(op, stream):
    cu = FakeCu()
    rows = [vc.probe(FakeCupy(), driver(cu), mode, where, op, exchange, stream)
            for mode in vc.MODES for where in ("same_thread", "other_thread") for exchange in (False, True)]
    assert all(r["calls_ok"] and r["capture_ok"] for r in rows), rows
    assert {r["stream"] for r in rows} == {stream} and {r["op"] for r in rows} == {op}
    assert cu.live == set(), cu.live                   # every range, page, buffer, stream and event went back
    made = {"unmap_only": "cuMemUnmap", "free": "cuMemFree_v2", "stream_sync": "cuStreamSynchronize",
            "event_query": "cuEventQuery", "legacy_event": "cuEventRecord", "unmap": "cuCtxSynchronize",
            "map": "cuMemMap", "reserve": "cuMemAddressReserve"}[op]
    assert made in cu.calls
    assert cu.calls.count("cuThreadExchangeStreamCaptureMode") == 2 * 3 * 2   # in and out, exchanged rows only


def test_a_refused_call_is_the_rows_answer_and_leaks_nothing():
    cu = FakeCu({"cuCtxSynchronize": CAPTURE_UNSUPPORTED, "cuMemFree_v2": CAPTURE_UNSUPPORTED})
    unmap = vc.probe(FakeCupy(), driver(cu), "global", "other_thread", "unmap", False)
    assert not unmap["calls_ok"] and unmap["results"] == "CUDA_ERROR_900 CUDA_SUCCESS"
    free = vc.probe(FakeCupy(), driver(cu), "global", "other_thread", "free", False)
    assert not free["calls_ok"] and free["results"] == "CUDA_ERROR_900"
    assert {h[0] for h in cu.live} == {"buffer"}      # the refused free's buffer: the probe's retry was refused too


def test_a_not_ready_query_is_a_legal_answer():
    cu = FakeCu({"cuEventQuery": vc.NOT_READY})
    row = vc.probe(FakeCupy(), driver(cu), "relaxed", "same_thread", "event_query", True)
    assert row["calls_ok"] and row["results"] == f"CUDA_ERROR_{vc.NOT_READY}"
