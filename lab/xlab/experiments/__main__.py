"""CLI: `python -m xlab.experiments single|ddp|sweep [options]` (see --help); writes the CSV and prints a table
of medians over the trials."""
from __future__ import annotations

import argparse
import importlib
import os
import sys

from xlab import allocators
from xlab.allocators import NoGPU
from xlab.bench import at_least

EXPERIMENTS = {"single": "single_gpu", "ddp": "ddp", "sweep": "sweep"}     # command -> module
PRESETS = {   # (--quick or --cpu-smoke, the sweep) -> the settings it gives
    ("quick", False): dict(trials=2, warmup=2, steps=3, count_steps=2),
    ("quick", True): dict(trials=2, warmup=2, steps_scale=0.5),
    ("cpu_smoke", False): dict(trials=2, warmup=1, config="tiny", steps=2, count_steps=1),
    ("cpu_smoke", True): dict(trials=2, warmup=1, config="tiny", batches=[2, 4], steps_scale=0.3)}
SHOW = ["mode", "allocator", "world", "batch", "tokens_per_s", "speedup", "ratio_vs_cupy_pool", "host_ms_per_step",
        "gpu_ms_per_step", "gpu_util_mean", "device_mallocs_per_step", "reserved_over_requested"]


def _common(p, out, steps, warmup):
    p.add_argument("--allocators", nargs="+", type=allocators.arg,
                   help="arm names (xlab.allocators.ARMS; default: allocators.SETS of the experiment)")
    p.add_argument("--trials", type=at_least(1), default=5, help="trials per configuration, interleaved (default 5)")
    p.add_argument("--warmup", type=int, default=warmup, help=f"untimed steps first (default {warmup})")
    p.add_argument("--config", default="reference", help="GPT config: reference, small or tiny")
    p.add_argument("--out", help=f"CSV to write (default {out}; with --cpu-smoke: none)")
    p.set_defaults(default_out=out)
    p.add_argument("--quick", action="store_true", help="a smoke run: 2 trials of few steps")
    p.add_argument("--cpu-smoke", action="store_true",
                   help="run the loop on NumPy with the tiny config for two steps (no GPU needed; measures nothing)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--resume", action="store_true",
                   help="finish an interrupted run: keep what --out holds from this commit and settings")
    p.add_argument("--adamw", choices=["foreach", "per_param"], default=None,
                   help="optimizer form (default: $XPOOL_ADAMW or foreach, the flat-buffer AdamW)")
    if steps is not None:
        p.add_argument("--steps", type=int, default=steps, help=f"timed steps after warm-up (default {steps})")
        p.add_argument("--count-steps", type=int, default=3,
                       help="steps of the counting run (raw, cupy_pool; trial 0 only)")


def parse(argv=None):
    """The experiments' command line: its namespace, with --quick/--cpu-smoke applied."""
    ap = argparse.ArgumentParser(prog="python -m xlab.experiments", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("single", help="one GPU, every allocator, batch 32 and 4")
    _common(s, "data/single_gpu.csv", 10, 3)
    s.add_argument("--batches", nargs="+", type=int, default=[32, 4])
    d = sub.add_parser("ddp", help="data-parallel scaling over 1..N GPUs")
    _common(d, "data/ddp_scaling.csv", 6, 3)
    d.add_argument("--modes", nargs="+", default=["threads", "processes"], choices=["threads", "processes"])
    d.add_argument("--worlds", nargs="+", type=int, default=[1, 2])
    d.add_argument("--batch", type=int, default=32, help="per-GPU batch")
    d.add_argument("--launcher", default="auto", choices=["auto", "mpirun", "spawn"])
    w = sub.add_parser("sweep", help="threads on 1 and 2 GPUs against per-GPU batch")
    _common(w, "data/batch_sweep.csv", None, 2)
    w.add_argument("--batches", nargs="+", type=int, default=[4, 8, 16, 32, 64, 128])
    w.add_argument("--worlds", nargs="+", type=int, default=[1, 2])
    w.add_argument("--steps-scale", type=float, default=1.0, help="multiplies the timed steps per batch")
    k = sub.add_parser("worker", help=argparse.SUPPRESS)    # one mpirun-launched rank of `ddp`
    k.add_argument("spec")
    args = ap.parse_args(argv)
    if args.cmd != "worker":
        for preset in ("quick", "cpu_smoke"):
            if getattr(args, preset):
                vars(args).update(PRESETS[preset, args.cmd == "sweep"])
        if args.out is None and not args.cpu_smoke:
            args.out = args.default_out
    return args


def main(argv=None) -> int:
    """Run one experiment and print its medians; 2 without the GPUs, 1 if a run's checks failed."""
    args = parse(argv)
    if args.cmd == "worker":
        from .ddp import worker_main
        worker_main(args.spec)
        return 0
    if args.adamw:
        os.environ["XPOOL_ADAMW"] = args.adamw      # read by every rank, launched ones too
    kw = dict(warmup=args.warmup, config=args.config, out=args.out, cpu=args.cpu_smoke, progress=not args.no_progress,
              trials=args.trials, resume=args.resume, allocators=tuple(args.allocators or ()) or None)
    for name in ("steps", "count_steps", "batches", "modes", "worlds", "batch", "launcher", "steps_scale"):
        if hasattr(args, name):                     # the experiment's own options
            value = getattr(args, name)
            kw[name] = tuple(value) if isinstance(value, list) else value
    try:
        df = importlib.import_module(f".{EXPERIMENTS[args.cmd]}", __package__).run(**kw)
    except NoGPU as e:
        print(f"xlab.experiments {args.cmd}: {e}", file=sys.stderr)
        return 2
    keys = ["mode", "allocator", "world", "batch"]
    med = df.groupby(keys, sort=False)[[c for c in SHOW if c not in keys]].median(numeric_only=True).reset_index()
    print(f"medians over {args.trials} trial(s):")
    print(med.to_string(index=False, float_format=lambda v: f"{v:.3g}", line_width=200))
    if args.out:
        print(f"wrote {args.out}")
    return 0 if df["checks_passed"].all() else 1


if __name__ == "__main__":
    sys.exit(main())
