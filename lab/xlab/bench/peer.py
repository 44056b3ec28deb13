"""Which uses of pool memory across two GPUs of one host work under each scheme (needs 2 GPUs).

Each case runs in a process of its own (a fault poisons a CUDA context), under a pool of the given scheme and
`peer_access` setting, and says whether it finished and gave the right numbers:

- ``nccl_threads``: one process, one thread per GPU, one NCCL communicator per thread (the lab's threads mode);
  an all-reduce of 64 MiB from and into pool memory. NCCL gives the ranks of one process direct access to each
  other's buffers (NCCL_P2P_DIRECT_DISABLE turns that off).
- ``nccl_procs``: one process per GPU (NCCL's usual setup), the same all-reduce.
- ``cupy_kernel``: a CuPy kernel on GPU 1 reads an array of GPU 0 (peer access on).
- ``cupy_copy``: a CuPy copy of GPU 0's array onto GPU 1.
- ``torch_copy``: ``tensor.to("cuda:1")`` of a tensor from the pool ``enable_torch`` makes on GPU 0.

The product has one behaviour (every peer mapped: docs/decisions/0007-peer-access-on-every-map.md), so a
``--peer-access`` other than null fails its case. The committed rows under each setting and the map cost under
"all" and "none" (data/peer_probe.csv, data/peer_map_cost.csv, d07f649; data/peer_probe_before.csv, the probe
before the setting) were measured on builds with the setting; the tag record-2026-12-05 keeps that code.

    python -m xlab.bench.peer --out build/peer.csv
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading

N = 16 << 20          # float32 elements: 64 MiB


def _pool(scheme, peer_access):
    """The product's pool: peer_access None, its one behaviour (every peer). ValueError for a setting: the product
    has none since the freeze; the rows under each setting before it are committed (data/peer_probe.csv,
    data/peer_map_cost.csv, measured at d07f649; the code at the tag record-2026-12-05)."""
    if peer_access is not None:
        raise ValueError(f"peer_access must be None (the product's one behaviour), got {peer_access!r}")
    import xpool
    return xpool.MemoryPool(scheme=scheme)


def _all_reduce(rank, uid, times=1):
    """Rank `rank` of two: an NCCL all-reduce of 64 MiB from and into pool memory (the current allocator's) on
    its own GPU, `times` times; whether every element came out the sum."""
    import cupy
    from cupy.cuda import nccl
    comm = nccl.NcclCommunicator(2, uid, rank)
    x = cupy.full(N, rank + 1, dtype=cupy.float32)
    y = cupy.empty_like(x)
    s = cupy.cuda.get_current_stream()
    for _ in range(times):
        comm.allReduce(x.data.ptr, y.data.ptr, N, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, s.ptr)
    s.synchronize()
    return bool((y == 3).all())


def nccl_threads(scheme, peer_access):
    import cupy
    from cupy.cuda import nccl
    import xpool
    pool = _pool(scheme, peer_access)
    uid, ok, errors = nccl.get_unique_id(), [None, None], []

    def rank(r):
        try:
            with cupy.cuda.Device(r), xpool.use(pool):
                ok[r] = _all_reduce(r, uid, times=3)
        except Exception as e:      # noqa: BLE001 -- reported
            errors.append(f"rank {r}: {type(e).__name__}: {e}")
    ts = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(90)
    return dict(ok=all(ok) and not errors, detail="; ".join(errors) or f"ranks ok {ok}")


def nccl_rank(scheme, peer_access):
    import cupy
    import xpool
    r, uid = int(os.environ["PROBE_RANK"]), bytes(json.loads(os.environ["PROBE_UID"]))
    with cupy.cuda.Device(r), xpool.use(_pool(scheme, peer_access)):
        return dict(ok=_all_reduce(r, uid), detail=f"rank {r}")


def nccl_procs(scheme, peer_access):
    from cupy.cuda import nccl
    uid = json.dumps(list(nccl.get_unique_id()))
    ps = [subprocess.Popen([sys.executable, "-m", "xlab.bench.peer", "--case", "nccl_rank", "--scheme", scheme,
                            "--peer-access", json.dumps(peer_access)],
                           env=dict(os.environ, PROBE_RANK=str(r), PROBE_UID=uid),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in ps]
    res = [_last_json(o) for o in outs]
    return dict(ok=all(x.get("ok") for x in res),
                detail="; ".join(x.get("detail", o[-300:]) for x, o in zip(res, outs)))


def cupy_kernel(scheme, peer_access):
    import cupy
    import xpool
    with xpool.use(_pool(scheme, peer_access)):
        with cupy.cuda.Device(0):
            x = cupy.arange(N, dtype=cupy.float32)
        with cupy.cuda.Device(1):
            try:
                cupy.cuda.runtime.deviceEnablePeerAccess(0)
            except cupy.cuda.runtime.CUDARuntimeError:
                pass        # already on
            y = x * 2       # a kernel on GPU 1 reading GPU 0's pages
            cupy.cuda.Device(1).synchronize()
            return dict(ok=bool((y[-1] == 2 * (N - 1)).item()), detail="kernel on 1 read 0's array")


def cupy_copy(scheme, peer_access):
    import cupy
    import xpool
    with xpool.use(_pool(scheme, peer_access)):
        with cupy.cuda.Device(0):
            x = cupy.arange(N, dtype=cupy.float32)
        with cupy.cuda.Device(1):
            y = cupy.empty_like(x)
            y.data.copy_from_device(x.data, x.nbytes)
            cupy.cuda.Device(1).synchronize()
            return dict(ok=bool((y[-1] == N - 1).item()), detail="copy_from_device 0 -> 1")


def torch_copy(scheme, peer_access):
    import torch
    import xpool
    xpool.enable_torch(pool=_pool(scheme, peer_access))
    x = torch.arange(N, dtype=torch.float32, device="cuda:0")
    y = x.to("cuda:1")
    z = torch.empty(N, device="cuda:1")
    z.copy_(x)
    torch.cuda.synchronize(1)
    return dict(ok=bool(y[-1].item() == N - 1 and z[-1].item() == N - 1), detail="tensor.to and copy_ 0 -> 1")


CASES = {f.__name__: f for f in (nccl_threads, nccl_procs, cupy_kernel, cupy_copy, torch_copy, nccl_rank)}


def _last_json(out):
    for line in reversed(out.strip().splitlines()):
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                pass
    return {}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case")
    p.add_argument("--scheme", default="expandable")
    p.add_argument("--peer-access", default="null", help="JSON: the pool's peer_access setting, null for its default")
    p.add_argument("--out", default="build/peer_probe.csv")
    p.add_argument("--schemes", default="segments,expandable")
    p.add_argument("--peer-accesses", default="null", help="';'-separated JSON values to try")
    p.add_argument("--cases", default="nccl_threads,nccl_procs,cupy_kernel,cupy_copy,torch_copy")
    a = p.parse_args(argv)
    if a.case:      # one case, in this process: its result as the last JSON line
        print(json.dumps(CASES[a.case](a.scheme, json.loads(a.peer_access))), flush=True)
        return 0
    import pandas as pd
    from xlab.provenance import provenance
    rows = []
    for case in a.cases.split(","):
        for scheme in a.schemes.split(","):
            for pa in a.peer_accesses.split(";"):
                if scheme != "expandable" and pa != "null":
                    continue                # peer_access is scheme expandable's setting
                envs = [{}] + ([{"NCCL_P2P_DIRECT_DISABLE": "1"}] if case == "nccl_threads" else [])
                for extra in envs:
                    env = dict(os.environ, NCCL_NVLS_ENABLE="0", **extra)
                    try:
                        cp = subprocess.run([sys.executable, "-m", "xlab.bench.peer", "--case", case,
                                             "--scheme", scheme, "--peer-access", pa], env=env, capture_output=True,
                                            text=True, timeout=180)
                        rc, out = cp.returncode, cp.stdout + cp.stderr
                    except subprocess.TimeoutExpired as e:
                        rc, out = "timeout", str(e.stdout or "")[-500:]
                    res = _last_json(out)
                    row = dict(case=case, scheme=scheme, peer_access=pa,
                               env=" ".join(f"{k}={v}" for k, v in extra.items()), rc=rc, ok=bool(res.get("ok")),
                               detail=res.get("detail") or out.strip()[-400:].replace("\n", " | "))
                    print(row, flush=True)
                    rows.append(row)
    df = pd.DataFrame(rows)
    for k, v in provenance(experiment="peer_probe").items():
        df[k] = v
    df.to_csv(a.out, index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
