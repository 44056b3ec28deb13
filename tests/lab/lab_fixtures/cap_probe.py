"""One arm's memory cap on a GPU, in a process of its own (PyTorch picks its allocator once per process): the arm's
allocator capped at --cap MiB (set_limit: Note [Memory caps] in xlab/allocators.py), then 64 MiB blocks of its
framework held until one is refused.

    python tests/lab/lab_fixtures/cap_probe.py --arm cupy_pool [--framework cupy] [--cap 256]

Prints one JSON line: the blocks held when one was refused (null: none was), whether
xlab.bench.dynamic_scale.is_oom takes the error for an out-of-memory one, its first line, and the allocator's peak
reserved bytes.
"""
import argparse
import json

BLOCK = 64 << 20


def run(arm, framework, cap_mib):
    from xlab import allocators as registry
    from xlab.bench import dynamic, dynamic_scale
    if framework == "torch":
        import torch
        alloc = dynamic.torch_allocator(arm)
        alloc.set_limit(cap_mib << 20)
        new = lambda: torch.empty(BLOCK, dtype=torch.uint8, device="cuda")      # noqa: E731
    else:
        import cupy
        alloc = registry.make(arm)
        alloc.set_limit(cap_mib << 20)
        alloc.install(counting=True)
        new = lambda: cupy.empty(BLOCK, dtype=cupy.uint8)                       # noqa: E731
    held, out = [], dict(arm=arm, framework=framework, refused_at=None, is_oom=None, error="")
    try:
        for _ in range(2 * (cap_mib << 20) // BLOCK):
            held.append(new())
    except Exception as e:                   # noqa: BLE001 - the error is the result
        out.update(refused_at=len(held), is_oom=dynamic_scale.is_oom(e), error=str(e).split("\n")[0][:300])
    out["peak_reserved"] = alloc.peak_reserved(0)
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--arm", required=True)
    p.add_argument("--framework", default="cupy", choices=("cupy", "torch"))
    p.add_argument("--cap", type=int, default=256, help="the cap in MiB")
    a = p.parse_args()
    print(json.dumps(run(a.arm, a.framework, a.cap)))
