"""The mixed PyTorch + CuPy loop (xlab.bench.torch_interop.mixed_step) in a process of its own: PyTorch picks
its allocator once per process.

    python tests/lab/lab_fixtures/torch_mixed.py --arm xpool|native [--warmup 2] [--steps 3]
    python tests/lab/lab_fixtures/torch_mixed.py --arm oom       # torch OOM under an xpool limit
    python tests/lab/lab_fixtures/torch_mixed.py --arm late      # enable_torch() after torch used CUDA

The 64 MiB hidden activations of PyTorch and the 64 MiB CuPy temporaries share a size, so under xpool each
framework reuses what the other freed. Prints one JSON line (see the keys of `out`).
"""
import argparse
import hashlib
import json
import os
import sys

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")   # deterministic cuBLAS in PyTorch


def run(arm, warmup, steps):
    import cupy
    import torch

    from xlab.bench.torch_interop import mixed_setup, mixed_step
    pool = None
    if arm == "xpool":
        import xpool
        pool = xpool.enable_torch(timeline=2_000_000)      # the warm steps' events are those after `seen`
    torch.use_deterministic_algorithms(True)
    model, opt, x = mixed_setup(torch)
    losses, sums = [], []
    for i in range(warmup + steps):
        if i == warmup:
            torch.cuda.synchronize()
            before = pool.stats() if pool else None
            seen = len(pool.timeline()) if pool else 0      # events of the warm-up, left out of cross_reuse
        loss, total, x = mixed_step(torch, cupy, model, opt, x)
        losses.append(loss)
        sums.append(total)
    torch.cuda.synchronize()
    h = hashlib.sha256()
    for t in [*losses, *(torch.from_dlpack(s) for s in sums), *model.parameters(), x]:
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes())
    out = {"arm": arm, "digest": h.hexdigest(), "losses": [float(v) for v in losses]}
    if pool:
        delta = pool.stats() - before
        s = pool.stats(0)
        out.update(device_mallocs_warm=int(delta.device_mallocs), device_frees_warm=int(delta.device_frees),
                   device_maps_warm=int(delta.device_maps), device_unmaps_warm=int(delta.device_unmaps),
                   scheme=pool.settings.scheme, requests_warm=int(delta.requests),
                   params_in_virtual_memory=all(pool._core.vm_range(0, p.data_ptr()) is not None
                                                for p in model.parameters()),
                   peak_reserved=int(s.peak_bytes_reserved), bytes_in_use_torch=int(s.bytes_in_use_torch),
                   bytes_in_use_cupy=int(s.bytes_in_use_cupy), **cross_reuse(pool.timeline().iloc[seen:]))
        try:
            torch.cuda.memory_allocated()
            out["torch_memory_stats"] = "works"
        except RuntimeError as e:
            out["torch_memory_stats"] = str(e).splitlines()[0]
    else:
        out.update(peak_reserved_torch=int(torch.cuda.max_memory_reserved()),
                   peak_reserved_cupy=int(cupy.get_default_memory_pool().total_bytes()))
    return out


def cross_reuse(tl):
    """Hits on a block whose last free came from the other framework, per direction."""
    last_free, counts = {}, {"torch_reused_cupy": 0, "cupy_reused_torch": 0}
    for ev, ptr, origin in zip(tl.event, tl.ptr, tl.origin):
        if ev == "free":
            last_free[ptr] = origin
        elif ev == "alloc_hit" and last_free.get(ptr) not in (None, origin):
            key = f"{origin}_reused_{last_free[ptr]}"
            counts[key] = counts.get(key, 0) + 1
    return counts


def oom():
    """A PyTorch request past xpool's limit: an exception PyTorch surfaces; the process goes on."""
    import torch
    import xpool
    xpool.enable_torch(limit=1 << 30)
    keep = torch.ones(1 << 20, device="cuda")
    out = {"arm": "oom"}
    try:
        torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
        out["error"] = None
    except Exception as e:      # noqa: BLE001 - reported
        out["error_type"], out["error"] = type(e).__name__, str(e)
    out["after"] = float((keep * 2).sum())                 # the allocator still serves
    out["oom_errors"] = int(xpool.cupy_adapter.installed().stats(0).oom_errors)
    return out


def late():
    import torch
    import xpool
    torch.zeros(1, device="cuda")
    try:
        xpool.enable_torch()
        return {"arm": "late", "error": None}
    except RuntimeError as e:
        return {"arm": "late", "error": str(e), "installed": xpool.cupy_adapter.installed() is not None}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arm", choices=["xpool", "native", "oom", "late"], required=True)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    a = p.parse_args(argv)
    out = oom() if a.arm == "oom" else late() if a.arm == "late" else run(a.arm, a.warmup, a.steps)
    print(json.dumps(out))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
