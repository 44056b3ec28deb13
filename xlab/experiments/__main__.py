"""CLI: `python -m xlab.experiments single|ddp [options]` (see --help); writes the CSV and prints the table."""
from __future__ import annotations

import argparse
import os
import sys

from xlab.allocators import NoGPU

SHOW = ["mode", "allocator", "world", "batch", "tokens_per_s", "speedup", "speedup_vs_raw", "ratio_vs_cupy_pool",
        "gpu_util_mean", "device_mallocs_per_step", "reserved_over_requested", "checks_passed"]


def _common(p, out):
    p.add_argument("--allocators", nargs="+", help="allocator names (default: raw cupy_pool xpool xpool_seed)")
    p.add_argument("--steps", type=int, default=30, help="timed steps after warm-up")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    p.add_argument("--count-steps", type=int, default=3, help="steps of the counting run (raw, cupy_pool)")
    p.add_argument("--config", default="reference", help="GPT config: reference, small or tiny")
    p.add_argument("--out", help=f"CSV to write (default {out}; with --cpu-smoke: none)")
    p.set_defaults(default_out=out)
    p.add_argument("--quick", action="store_true", help="a smoke run: 5 timed steps, 2 warm-up, 2 counted")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="run the loop on NumPy with the tiny config for two steps (no GPU needed; measures nothing)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--adamw", choices=["per_param", "foreach"], default=None,
                   help="optimizer form (default: $XPOOL_ADAMW or per_param, the workload as measured)")


def parse(argv=None):
    ap = argparse.ArgumentParser(prog="python -m xlab.experiments", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("single", help="one GPU, every allocator, batch 32 and 4")
    _common(s, "data/single_gpu.csv")
    s.add_argument("--batches", nargs="+", type=int, default=[32, 4])
    d = sub.add_parser("ddp", help="data-parallel scaling over 1..N GPUs")
    _common(d, "data/ddp_scaling.csv")
    d.add_argument("--modes", nargs="+", default=["threads", "processes"], choices=["threads", "processes"])
    d.add_argument("--worlds", nargs="+", type=int, default=[1, 2])
    d.add_argument("--batch", type=int, default=32, help="per-GPU batch")
    d.add_argument("--launcher", default="auto", choices=["auto", "mpirun", "spawn"])
    w = sub.add_parser("worker", help=argparse.SUPPRESS)    # one mpirun-launched rank of `ddp`
    w.add_argument("spec")
    args = ap.parse_args(argv)
    if args.cmd != "worker":
        if args.quick:
            args.steps, args.warmup, args.count_steps = 5, 2, 2
        if args.cpu_smoke:
            args.steps, args.warmup, args.count_steps, args.config = 2, 1, 1, "tiny"
        elif args.out is None:
            args.out = args.default_out
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.cmd == "worker":
        from .ddp import worker_main
        worker_main(args.spec)
        return 0
    if args.adamw:
        os.environ["XPOOL_ADAMW"] = args.adamw      # read by every rank, launched ones too
    common = dict(steps=args.steps, warmup=args.warmup, count_steps=args.count_steps, config=args.config,
                  out=args.out, cpu=args.cpu_smoke, progress=not args.no_progress)
    if args.allocators:
        common["allocators"] = tuple(args.allocators)
    try:
        if args.cmd == "single":
            from .single_gpu import run
            df = run(batches=tuple(args.batches), **common)
        else:
            from .ddp import run
            df = run(modes=tuple(args.modes), worlds=tuple(args.worlds), batch=args.batch, launcher=args.launcher,
                     **common)
    except NoGPU as e:
        print(f"xlab.experiments {args.cmd}: {e}", file=sys.stderr)
        return 2
    with __import__("pandas").option_context("display.width", 200, "display.max_columns", 20):
        print(df[SHOW].to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    if args.out:
        print(f"wrote {args.out}")
    return 0 if df["checks_passed"].all() else 1


if __name__ == "__main__":
    sys.exit(main())
