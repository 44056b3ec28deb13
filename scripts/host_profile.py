"""Where a training step's host time goes, on one GPU: per-step host (thread CPU) ms, wall ms, GPU ms (events),
and a cProfile of a few steps; plus the raw cudaMalloc pair cost two ways. A diagnostic for issue #13/#12:
    python scripts/host_profile.py --out DIR
"""
import argparse
import cProfile
import io
import pathlib
import pstats
import time

import cupy
import pandas as pd

from tapegpt import AdamW, GPT, GPTConfig, get_batch, load_corpus
from xlab.provenance import provenance


def step_times(cfg, foreach, steps=8, warmup=3):
    data = load_corpus()
    model = GPT(cfg, xp=cupy, seed=0)
    opt = AdamW(model.params, lr=1e-3, foreach=foreach)
    batches = [get_batch(data, cfg.batch_size, cfg.block_size, s, xp=cupy) for s in range(warmup + steps)]
    rows = []
    stream = cupy.cuda.get_current_stream()
    for i, (x, y) in enumerate(batches):
        cupy.cuda.Device().synchronize()
        e0, e1 = cupy.cuda.Event(), cupy.cuda.Event()
        e0.record(stream)
        t0, c0 = time.perf_counter(), time.thread_time()
        loss, grads = model.loss_and_grads(x, y)
        opt.step(grads)
        c1 = time.thread_time()
        e1.record(stream)
        e1.synchronize()
        t1 = time.perf_counter()
        if i >= warmup:
            rows.append(dict(batch=cfg.batch_size, foreach=foreach, step=i, host_ms=1e3 * (c1 - c0),
                             wall_ms=1e3 * (t1 - t0), gpu_ms=cupy.cuda.get_elapsed_time(e0, e1)))
    prof = cProfile.Profile()
    for x, y in batches[:3]:
        prof.enable()
        loss, grads = model.loss_and_grads(x, y)
        opt.step(grads)
        prof.disable()
        cupy.cuda.Device().synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(45)
    return rows, s.getvalue()


def raw_pairs(n=2000):
    rows = []
    prev = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(None)
    for size in (4096, 1 << 20):
        for what in ("cupy.empty+del", "runtime.malloc+free"):
            for _ in range(50):
                a = cupy.empty(size, cupy.uint8); del a
            t0 = time.perf_counter()
            for _ in range(n):
                if what == "cupy.empty+del":
                    a = cupy.empty(size, cupy.uint8); del a
                else:
                    p = cupy.cuda.runtime.malloc(size); cupy.cuda.runtime.free(p)
            rows.append(dict(size=size, what=what, us_per_pair=1e6 * (time.perf_counter() - t0) / n))
    cupy.cuda.set_allocator(prev)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = pathlib.Path(args.out); out.mkdir(parents=True, exist_ok=True)
    prov = provenance(script="host_profile")
    rows, texts = [], []
    for batch in (32, 4):
        for foreach in (True, False):
            r, text = step_times(GPTConfig(batch_size=batch), foreach)
            rows += r
            texts.append(f"==== batch {batch} foreach {foreach}\n{text}")
    df = pd.DataFrame(rows).assign(**prov)
    df.to_csv(out / "host_profile.csv", index=False)
    print(df.groupby(["batch", "foreach"])[["host_ms", "wall_ms", "gpu_ms"]].median().to_string())
    (out / "host_profile.txt").write_text("\n".join(texts))
    raw = pd.DataFrame(raw_pairs()).assign(**prov)
    raw.to_csv(out / "raw_pairs.csv", index=False)
    print(raw[["size", "what", "us_per_pair"]].to_string(index=False))


if __name__ == "__main__":
    main()
