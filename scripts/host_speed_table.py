"""The eleventh session's host-speed probe (Note [Pinned arms]): per-step host timestamps of the dynamic benchmark's
gpt_b4 and torch_fixed arms on the H200 machine, unpinned, windows of 20/30 and 100 steps, as a tidy CSV.

    python scripts/host_speed_table.py data/logs/eleventh_host_speed.tgz      (-> data/host_speed_probe.csv)

The log holds what `.gpu/diag.py` of that session wrote: diag_{base,long5}.csv (the benchmark's rows, with
provenance) and diag_steps.jsonl (one line per run, in the same order: perf_counter and thread_time after each step;
a CuPy arm's process makes two runs, the timed one and the counting one, whose row is the timed one's).
"""
from __future__ import annotations

import io
import json
import pathlib
import sys
import tarfile

import numpy as np
import pandas as pd

ROOT = pathlib.Path(__file__).resolve().parents[1]
KEEP = ["trial", "workload", "framework", "allocator", "position", "steps", "warmup"]


def table(tgz: pathlib.Path) -> pd.DataFrame:
    with tarfile.open(tgz) as tar:
        read = lambda name: tar.extractfile(name).read().decode()      # noqa: E731
        rows = pd.concat([pd.read_csv(io.StringIO(read(f"diag_{tag}.csv"))).assign(window=tag)
                          for tag in ("base", "long5")], ignore_index=True)
        steps = [json.loads(line) for line in read("diag_steps.jsonl").splitlines()]
    runs, it = [], iter(steps)
    for _, r in rows.iterrows():
        runs.append((r, next(it), "timed"))
        if r["framework"] == "cupy":
            runs.append((r, next(it), "counting"))
    if next(it, None) is not None:
        raise SystemExit(f"{len(steps)} step logs for {len(rows)} rows: not the same runs")
    out = []
    for r, s, run in runs:
        ts, w = np.array(s["ts"]), s["warmup"]
        wall, cpu = (np.diff(ts[:, i])[w - 1:] * 1e3 for i in (0, 1))        # the timed steps' intervals
        ms = 1e3 * s["window_s"] / len(wall)
        if s["workload"] != r["workload"] or run == "timed" and abs(ms - r["ms_per_step"]) > 1e-6:
            raise SystemExit(f"step log {s['pid']} is not row {r['trial']} {r['workload']} {r['allocator']}")
        out.append(dict(**{k: r[k] for k in KEEP}, run=run, window=r["window"], ms_per_step=ms,
                        host_ms_per_step=1e3 * s["host_s"] / len(wall),
                        step_ms_p10=np.percentile(wall, 10), step_ms_p50=np.median(wall),
                        step_ms_p90=np.percentile(wall, 90), step_cpu_ms_p50=np.median(cpu),
                        started_s=ts[0, 0] - steps[0]["ts"][0][0],
                        **{k: r[k] for k in ("gpu", "driver", "cuda", "cupy", "torch", "commit", "date", "host")}))
    return pd.DataFrame(out).assign(experiment="host_speed_probe", pinned="no")


if __name__ == "__main__":
    df = table(pathlib.Path(sys.argv[1]))
    df.to_csv(ROOT / "data" / "host_speed_probe.csv", index=False, float_format="%.4f")
    print(df.groupby(["window", "workload"])[["ms_per_step", "host_ms_per_step"]].describe().round(1).T.to_string())
