"""The reserve recipe on the GPU (`xpool.Pool.reserve`): the ResNets at
varying image sizes (the benchmark's and the held-out one at batch 64) through the pool `xpool.enable_torch()` makes,
plain and with `frac` times the program's peak requested bytes reserved, seeds 0-4, the arms in turn (rotated by
seed), each run in a process of its own. The reserve is `pool.reserve` (`--recipe pool.reserve`, the default) or the
same by hand (`--recipe tensor`: a tensor of that many bytes made and dropped, then
`pool.reset_peak_stats(history=True)`; the first run, at 48c89f0), made before anything (`--when start`) or once
the model and its optimizer are made (`--when build`: `pool.reserve` holds the bytes in use and a free block of the
rest). The peak is what a dry run reports: the benchmark's rows of the default pool (data/dynamic_shapes.csv,
data/dynamic_heldout.csv; the largest image comes first, so every seed's is the same). One row per run: peak
reserved / peak requested, device calls in the benchmark's steady state (xlab.bench.dynamic.steady_state), maps and
unmaps in all, and ms per step over the timed steps (after the warm-up; the window synchronises the device at both
ends, and the per-step counter reads are in every arm alike), with NVML's GPU utilisation over that window and what
it says bounds the steps (xlab.experiments.train.step_bound; rows since 5200ab5).

    python -m xlab.bench.reserve --out build/reserve_probe.csv
    python -m xlab.bench.reserve --when start,build --out build/reserve_probe.csv     # data/reserve_probe.csv
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

PAGE = 2 << 20


def dry_run_peak(workload: str) -> int:
    """The most bytes `workload` requested under the default pool in the benchmark's committed rows."""
    import pandas as pd
    from xlab.bench.dynamic import WORKLOADS
    from xlab.paths import data_dir
    csv = "dynamic_heldout.csv" if WORKLOADS[workload].held_out else "dynamic_shapes.csv"
    d = pd.read_csv(data_dir() / csv)
    return int(d.loc[(d["workload"] == workload) & (d["allocator"] == "xpool_expandable_peak"),
                     "peak_requested_bytes"].max())


def one(workload: str, seed: int, frac: float, recipe: str, when: str = "start") -> dict:
    import torch
    import xpool
    from xlab.bench.dynamic import WORKLOADS, steady_state
    from xlab.experiments.train import Window, step_bound
    from xlab.nvml import UtilSampler
    reserve = int(frac * dry_run_peak(workload)) // PAGE * PAGE
    pool, taken = xpool.enable_torch(), [0]

    def make_reserve():
        if reserve and recipe == "pool.reserve":
            taken[0] = pool.reserve(reserve)
        elif reserve:           # the recipe by hand: a tensor made and dropped, then the reset pool.reserve does
            x = torch.empty(reserve, dtype=torch.uint8, device="cuda")
            taken[0] = x.numel()
            del x
            pool.reset_peak_stats(history=True)
    probes = []

    def after_step():
        s = pool.stats(0)
        probes.append((int(s["device_maps"] + s["device_unmaps"]), int(s["peak_bytes_requested"])))
    w = WORKLOADS[workload]
    if when == "start":
        make_reserve()
    window = Window(lambda: 0, torch.cuda.synchronize, sampler=UtilSampler([0]))
    w.fn(w.steps, w.warmup, seed, window, True, False, after_step=after_step,
         after_build=make_reserve if when == "build" else lambda: None)
    torch.cuda.synchronize()
    s = pool.stats(0)
    st = steady_state(probes, w.warmup)
    ms, util = 1e3 * window.seconds / w.steps, window.util.get(0, float("nan"))
    return dict(workload=workload, seed=seed, frac=frac, reserve_bytes=reserve, recipe=recipe if reserve else "",
                when=when if reserve else "none", trial=seed, block_bytes=taken[0],
                peak_bytes_reserved=int(s["peak_bytes_reserved"]), peak_bytes_requested=int(s["peak_bytes_requested"]),
                reserved_over_requested=s["peak_bytes_reserved"] / s["peak_bytes_requested"],
                steady_calls=st["device_calls_steady"], steady_steps=st["steady_steps"],
                demand_peak_step=st["demand_peak_step"], device_maps=int(s["device_maps"]),
                device_unmaps=int(s["device_unmaps"]), ms_per_step=ms, gpu_util_mean=util,
                bound=step_bound(util, float("nan"), ms),
                release_on_miss=pool.settings.release_on_miss, scheme=pool.settings.scheme, steps=w.steps, warmup=w.warmup)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--one", help="JSON [workload, seed, frac, recipe, when]: one run, in this process")
    p.add_argument("--recipe", default="pool.reserve", choices=("pool.reserve", "tensor"))
    p.add_argument("--out", default="build/reserve_probe.csv")
    p.add_argument("--seeds", default="0,1,2,3,4")
    p.add_argument("--fracs", default="0,1.03")
    p.add_argument("--workloads", default="resnet_varres,resnet_varres_b64")
    p.add_argument("--when", default="start", help="comma-separated: start (before anything), build (after the model)")
    a = p.parse_args(argv)
    if a.one:
        print(json.dumps(one(*json.loads(a.one))), flush=True)
        return 0
    import pandas as pd
    from xlab.provenance import provenance
    if a.recipe == "tensor" and "build" in a.when.split(","):
        p.error("--when build needs --recipe pool.reserve (a tensor by hand would not count the model's bytes)")
    fracs, rows = [float(f) for f in a.fracs.split(",")], []
    arms = [(f, when) for f in fracs for when in (a.when.split(",") if f else ["start"])]
    for w in a.workloads.split(","):
        for seed in (int(s) for s in a.seeds.split(",")):
            for frac, when in arms[seed % len(arms):] + arms[:seed % len(arms)]:
                cp = subprocess.run([sys.executable, "-m", "xlab.bench.reserve", "--one",
                                     json.dumps([w, seed, frac, a.recipe, when])],
                                    capture_output=True, text=True, timeout=300)
                line = [x for x in cp.stdout.splitlines() if x.startswith("{")]
                if cp.returncode or not line:
                    print(cp.stdout[-1500:], cp.stderr[-3000:], flush=True)
                    return 1
                rows.append(json.loads(line[-1]))
                r = rows[-1]
                print(f"{w} seed {seed} frac {frac} {r['when']}: {r['reserved_over_requested']:.4f}, "
                      f"{r['steady_calls']} steady calls, {r['device_maps']} maps, {r['ms_per_step']:.1f} ms/step",
                      flush=True)
                pd.DataFrame(rows).assign(**provenance(experiment="reserve_probe")).to_csv(a.out, index=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
