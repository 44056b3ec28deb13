"""The report (headlines computed from the CSVs, one page, exit status) and the memory study's replay."""
import pathlib
import re

import numpy as np
import pandas as pd
import pytest

import xpool
from fixtures import synthetic
from xlab import memory_study, paths, plots, report
from xlab.memory_study import AddressSpaceBackend, replay, replay_waste, waste_table

# ---------------------------------------------------------------------------------------------------------
# Replay: a recorded trace through a fresh pool reproduces the pool's own decisions exactly


def _record(k, seed=0, n=3000, devices=(0,), streams=(0,)):
    """Random allocs and frees of GPT-like sizes through a real pool; returns (timeline, stats)."""
    pool = xpool.Pool(AddressSpaceBackend(), scheme="seed", classes_per_doubling=k, limit=0, debug=False, timeline=100_000)
    rng = np.random.default_rng(seed)
    sizes = [100, 4096, 70_000, 1 << 20, (1 << 20) + 1, 3 << 20, 5_000_000, 12_582_912, 50_331_649]
    live = []
    for _ in range(n):
        if live and rng.random() < 0.47:
            live.pop(int(rng.integers(len(live))))
        else:
            live.append(pool.allocate(int(rng.choice(sizes)) + int(rng.integers(0, 3000)),
                                      device=int(rng.choice(devices)), stream=int(rng.choice(streams))))
    stats = pool.stats()
    tl = pool.timeline()
    del live
    return tl, stats


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_replay_of_a_synthetic_trace_reproduces_every_setting(k):
    """The trace is recorded at k=1; replayed at k it must match a pool that ran the same program at k."""
    trace, _ = _record(1, devices=(0, 1), streams=(0, 7))
    _, truth = _record(k, devices=(0, 1), streams=(0, 7))
    got = replay(trace, k)
    for name in ("peak_bytes_reserved", "peak_bytes_requested", "device_mallocs", "requests"):
        assert got[name] == int(truth[name].sum()), name
    assert got["unmatched_frees"] == 0


def test_replay_skips_frees_of_blocks_allocated_before_the_recording():
    trace, _ = _record(1, n=400)
    frees = trace.index[trace["event"] == "free"]
    first_alloc_of_a_freed_block = trace.index[
        trace["ptr"].isin(trace.loc[frees, "ptr"]) & trace["event"].str.startswith("alloc")][0]
    cut = trace.drop(index=first_alloc_of_a_freed_block)
    assert replay(cut, 1)["unmatched_frees"] >= 1


def test_replay_waste_table():
    trace, stats = _record(1)
    w = replay_waste(trace, (1, 2, 4, 8))
    assert list(w["k"]) == [1, 2, 4, 8] and (w["source"] == "replay").all()
    assert (w["class_over_requested"] >= 1).all() and (w["reserved_over_requested"] >= 1).all()
    # The classes of k are among those of 2k, so handing out bytes can only get tighter.
    assert w["class_bytes"].is_monotonic_decreasing
    assert w.loc[0, "peak_bytes_reserved"] == int(stats["peak_bytes_reserved"].sum())
    measured = w.assign(source="measured")
    t = waste_table(measured, w)
    assert t["replay_exact"].all() and list(t["k"]) == [1, 2, 4, 8]
    off = measured.assign(peak_bytes_reserved=measured["peak_bytes_reserved"] + 512)
    assert not waste_table(off, w)["replay_exact"].any()
    assert waste_table(None, None) is None


def test_replay_uses_only_the_last_steps_requests_for_class_waste():
    tl = synthetic.memory_timeline(steps=2)
    w = replay_waste(tl, (1,))
    last = tl[(tl["step"] == tl["step"].max()) & tl["event"].str.startswith("alloc")]
    assert w.loc[0, "requests"] == len(last) and w.loc[0, "requested_bytes"] == last["requested"].sum()
    assert w.loc[0, "gpu"] == synthetic.PROV["gpu"]          # the replay keeps the recording's provenance


def test_replay_of_the_committed_timeline_matches_the_committed_waste():
    """On any machine: the committed GPU measurements are reproduced exactly by the CPU replay."""
    data = pathlib.Path(__file__).resolve().parents[1] / "data"
    if not (data / "memory_timeline.csv").is_file() or not (data / "memory_waste.csv").is_file():
        pytest.skip("no committed memory measurements yet")
    measured = pd.read_csv(data / "memory_waste.csv")
    replayed = replay_waste(pd.read_csv(data / "memory_timeline.csv"), tuple(measured["k"]))
    assert waste_table(measured, replayed)["replay_exact"].all()


@pytest.mark.gpu
def test_recorded_gpu_timeline_replays_exactly():
    cfg = dict(n_layer=2, n_head=2, n_embd=64, n_ffn=256, block_size=32, batch_size=4)
    waste, timeline = memory_study.measure_waste((1, 4), config=cfg)
    assert set(timeline["step"]) == {-1, 0, 1}
    assert waste_table(waste, replay_waste(timeline, (1, 4)))["replay_exact"].all()
    assert (timeline["step"] == 1).any() and not (timeline[timeline["step"] == 1]["event"] == "alloc_miss").any()


# ---------------------------------------------------------------------------------------------------------
# The report


def _write(data, trials):
    synthetic.write_all(data, trials=trials)
    synthetic.correctness("cpu").assign(gpu="none").to_csv(data / "correctness_cpu.csv", index=False)
    return data


@pytest.fixture
def synthetic_data(tmp_path):
    """The old schema: one row per configuration (what data/ held before trials were kept)."""
    return _write(tmp_path / "data", 0)


@pytest.fixture
def trial_data(tmp_path):
    """Five interleaved trials per configuration, with host/GPU ms, and the batch sweep."""
    return _write(tmp_path / "trials", 5)


def test_headlines_are_computed_from_the_csvs(synthetic_data):
    heads = "\n".join(report.headlines(synthetic_data))
    assert "CPU 6 of 6 checks pass" in heads and "GPU 6 of 6" in heads
    # synthetic xpool_k1 / cupy_pool at 64 KiB; the old CSV's rows are single runs and say so
    assert "2.10 µs (single run)" in heads and "2.00 µs (single run) (xpool takes 1.05× (single run)" in heads
    assert "raw 1.02× (single run) → xpool_k1 1.75× (single run)" in heads
    assert "raw 1.50× (single run) → xpool_k1 1.93× (single run)" in heads
    assert "3.02× (single run) raw cudaMalloc" in heads
    assert "exactly for every k" in heads
    # Change a CSV, and the headline follows.
    df = pd.read_csv(synthetic_data / "ddp_scaling.csv")
    df.loc[(df["mode"] == "threads") & (df["allocator"] == "xpool_k1") & (df["world"] == 2), "speedup"] = 1.99
    df.to_csv(synthetic_data / "ddp_scaling.csv", index=False)
    assert "xpool_k1 1.99×" in "\n".join(report.headlines(synthetic_data))


def test_headlines_with_trials_give_intervals(trial_data):
    heads = "\n".join(report.headlines(trial_data))
    assert "(single run)" not in heads
    assert re.search(r"xpool_k1 2\.\d\d µs \[2\.\d\d, 2\.\d\d\]", heads)
    # ratios are paired per trial: the shared drift cancels, so the interval is the point
    assert "3.02× [3.02, 3.02] raw cudaMalloc" in heads
    assert "**Batch sweep**" in heads and "128: 2.00×" in heads


def test_targets_are_judged_on_the_interval(trial_data):
    rows = {r["target"]: r for r in report.targets(trial_data)}
    key = "2 GPUs, one thread per GPU, batch 32: xpool_k1 ≥ 1.85×"
    assert rows[key]["verdict"] == "missed"                             # 1.75x in every trial
    df = pd.read_csv(trial_data / "ddp_scaling.csv")
    sel = (df["mode"] == "threads") & (df["allocator"] == "xpool_k1") & (df["world"] == 2)
    df.loc[sel, "speedup"] = [1.80, 1.84, 1.86, 1.90, 1.83]             # straddles 1.85
    df.to_csv(trial_data / "ddp_scaling.csv", index=False)
    assert {r["target"]: r for r in report.targets(trial_data)}[key]["verdict"] == "within noise"
    df.loc[sel, "speedup"] = [1.90, 1.92, 1.95, 1.91, 1.93]
    df.to_csv(trial_data / "ddp_scaling.csv", index=False)
    row = {r["target"]: r for r in report.targets(trial_data)}[key]
    assert row["verdict"] == "met" and row["measured"].startswith("1.92× [")
    host = "host ms per step ≤ 12 at batch 32 (xpool_k1, thread CPU time)"
    rows = {r["target"]: r for r in report.targets(trial_data)}
    assert rows[host]["bound"] == "gpu"                                  # what bounds each target's steps
    assert rows["one GPU, batch 4: GPU busy ≥ 70% (xpool_k1, NVML)"]["bound"] == "host"
    assert rows["one GPU, batch 32: xpool_k1 ≥ 2.9× raw (tokens/s)"]["bound"] == "xpool_k1 gpu, raw host"
    assert rows["xpool_k1 µs per pair ≤ 1.05× CuPy MemoryPool's, every size (worst size)"]["bound"] == "host"


def test_bounds_and_projection(trial_data, synthetic_data):
    rows = {(r["batch"], r["allocator"]): r for r in report.bound_rows(trial_data)}
    assert rows[32, "xpool_k1"]["bound"] == "gpu" and rows[4, "xpool_k1"]["bound"] == "host"
    proj = {p["allocator"]: p for p in report.projection(trial_data)}
    p = proj["xpool_k1"]
    assert p["h_source"] == "batch-32 thread CPU time"
    for n, s in p["speedup"].items():
        assert s == pytest.approx(n * max(p["h"], p["g"]) / max(n * p["h"], p["g"]))
    assert p["speedup"][8] <= p["speedup"][4] * 2 and "raw" not in proj
    text = "\n".join(report.bounds(trial_data))
    assert "Projection, not a measurement" in text and "| 8 GPUs (s_8) |" in text
    # a CSV without host ms (measured before it was recorded): the projection says where h came from instead
    df = pd.read_csv(trial_data / "single_gpu.csv").drop(columns=["host_ms_per_step", "bound"])
    # (and at batch 32 the thread time is preferred; without it the batch-4 wall time stands in)
    df.to_csv(synthetic_data / "single_gpu.csv", index=False)
    old = {p["allocator"]: p for p in report.projection(synthetic_data)}
    assert old["xpool_k1"]["h_source"].startswith("batch-4 wall time")


def _gil_csv(data, share=(0.7, 0.6)):
    rows = []
    for trial in range(5):
        for n, sp in zip((1, 2, 4), (1.0,) + share):
            rows.append(dict(arm="add", threads=n, trial=trial, switch_interval_s=0.005, ops_per_s=1e5 * sp,
                             speedup=sp, us_per_op=10.0 * n / sp, commit="abc"))
    pd.DataFrame(rows).to_csv(data / "gil_probe.csv", index=False)


def test_the_gil_probe_feeds_the_projection_and_its_own_table(trial_data):
    _gil_csv(trial_data)
    assert report.gil_sharing(trial_data) == {2: (0.7, 0.7, 0.7), 4: (0.6, 0.6, 0.6)}
    p = {p["allocator"]: p for p in report.projection(trial_data)}["xpool_k1"]
    assert p["sharing"] == {2: 0.7, 4: 0.6, 8: 1.0}                   # 8 threads not probed: plain serialisation
    for n, s in p["speedup"].items():
        assert s == pytest.approx(n * max(p["h"], p["g"]) / max(n * p["h"] / p["sharing"][n], p["g"]))
    text = "\n".join(report.gil_lines(trial_data))
    assert "| `x + x`, 1 element, CuPy (allocation + launch, GIL released) | 10.0 [10.0, 10.0] | 0.70× [0.70, 0.70] | 0.60×" in text
    assert "### Threads under one GIL" in report.render(trial_data, [], {}, trial_data)


def test_the_host_target_uses_the_dispatch_time_when_measured(trial_data):
    df = pd.read_csv(trial_data / "single_gpu.csv")
    df["dispatch_ms_per_step"] = 11.0
    df.to_csv(trial_data / "single_gpu.csv", index=False)
    rows = {r["target"]: r for r in report.targets(trial_data)}
    row = rows["host ms per step ≤ 12 at batch 32 (xpool_k1, thread CPU time of a step started on an idle device)"]
    assert row["verdict"] == "met" and row["bound"] == "host"
    assert report.projection(trial_data)[0]["h"] == 11.0


def test_a_second_run_is_checked_against_the_first_runs_intervals(trial_data):
    assert report.replication(trial_data) == [] and "second run" not in report.render(trial_data, [], {}, trial_data)
    synthetic.write_all(trial_data / "rerun", trials=5)
    rows = {r["name"]: r for r in report.replication(trial_data)}
    assert len(rows) > 20 and all(r["inside"] for r in rows.values())      # the same numbers: every one inside
    df = pd.read_csv(trial_data / "rerun" / "ddp_scaling.csv")
    df.loc[(df["mode"] == "threads") & (df["allocator"] == "xpool_k1") & (df["world"] == 2), "speedup"] = 1.95
    df.to_csv(trial_data / "rerun" / "ddp_scaling.csv", index=False)
    rows = {r["name"]: r for r in report.replication(trial_data)}
    assert rows["2 GPUs, threads, batch 32: xpool_k1 speedup"]["inside"] is False
    _gil_csv(trial_data)
    _gil_csv(trial_data / "rerun", share=(0.9, 0.6))
    rows = {r["name"]: r for r in report.replication(trial_data)}
    assert rows["GIL probe (add): 2 threads / 1 thread, ops per second"]["inside"] is False
    text = report.render(trial_data, [], {}, trial_data)
    assert "### Does a second run agree?" in text and "| **no** |" in text and "`data/rerun/ddp_scaling.csv`" in text


def test_report_builds_from_trials_with_every_figure(trial_data, tmp_path):
    rc = report.main(["--no-notebooks", "--data", str(trial_data), "--figures", str(tmp_path / "figures"),
                      "--build", str(tmp_path / "build"), "--report-dir", str(tmp_path / "report")])
    assert rc == 0
    page = (tmp_path / "report" / "REPORT.md").read_text()
    assert "not built" not in page and "batch_sweep" in page


def test_headlines_without_data(tmp_path):
    assert report.headlines(tmp_path) == []
    text = report.render(tmp_path, [], {}, tmp_path)
    assert "No measurements" in text and "Not measured yet" in text


def test_a_malformed_csv_costs_one_line_not_the_report(synthetic_data):
    (synthetic_data / "single_gpu.csv").write_text("mode,allocator\nsingle,raw\n")
    heads = report.headlines(synthetic_data)
    assert any("could not compute" in h for h in heads) and any("Allocation cost" in h for h in heads)


def test_main_writes_one_page_with_working_figure_links(synthetic_data, tmp_path):
    rc = report.main(["--no-notebooks", "--data", str(synthetic_data), "--figures", str(tmp_path / "figures"),
                      "--build", str(tmp_path / "build"), "--report-dir", str(tmp_path / "report")])
    assert rc == 0
    page = (tmp_path / "report" / "REPORT.md").read_text()
    assert page == (tmp_path / "build" / "report.md").read_text()
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", page)
    assert len(links) == len(plots.FIGURES) - 2       # the old schema has no batch sweep and no graph runs
    assert all((tmp_path / "report" / link).resolve().is_file() for link in links)
    assert "SYNTHETIC GPU" in page                                   # the data table names the machines


def test_main_fails_when_a_notebook_fails(synthetic_data, tmp_path, monkeypatch):
    def fake_run(path, out_dir, parameters=None, timeout=0):
        ok = not path.stem.startswith("03")
        return dict(notebook=path.stem, ok=ok, seconds=0.0, output="", error="" if ok else "boom")

    monkeypatch.setattr(report, "run_notebook", fake_run)
    rc = report.main(["--cpu-quick", "--data", str(synthetic_data), "--figures", str(tmp_path / "figures"),
                      "--build", str(tmp_path / "build"), "--report-dir", str(tmp_path / "report")])
    assert rc == 1
    assert "FAILED: boom" in (tmp_path / "build" / "report.md").read_text()
    # the committed page does not depend on how a run went: only on data/
    assert "## Notebooks" not in (tmp_path / "report" / "REPORT.md").read_text()


def test_cpu_quick_parameters_exist_in_the_notebooks():
    import nbformat
    from papermill.translators import PythonTranslator
    for name, params in report.CPU_QUICK.items():
        nb = nbformat.read(paths.repo_root() / "notebooks" / f"{name}.ipynb", as_version=4)
        cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
        assert set(params) <= {p.name for p in PythonTranslator.inspect(cell)}, name
        assert params["measure"] is False                     # CPU mode never measures, even on a GPU


def test_targets_follow_the_csvs(synthetic_data):
    rows = {r["target"]: r for r in report.targets(synthetic_data)}
    key = "2 GPUs, one thread per GPU, batch 32: xpool_k1 ≥ 1.85×"
    assert rows[key]["measured"] == "1.75× (single run)" and "misses" in rows[key]["verdict"]
    df = pd.read_csv(synthetic_data / "ddp_scaling.csv")
    df.loc[(df["mode"] == "threads") & (df["allocator"] == "xpool_k1") & (df["world"] == 2), "speedup"] = 1.9
    df.to_csv(synthetic_data / "ddp_scaling.csv", index=False)
    rows = {r["target"]: r for r in report.targets(synthetic_data)}
    assert rows[key]["verdict"] == "single run, no interval (the median meets it)"
    text = report.render(synthetic_data, [], {}, synthetic_data)
    assert "## Targets" in text and "| " + key in text


def test_the_committed_report_is_what_the_committed_csvs_give():
    """report/REPORT.md is rebuilt from data/ by `make report`; committed stale, a fresh clone's `make report`
    would change it. Regenerate with `python -m xlab.report --no-notebooks`."""
    root = paths.repo_root()
    figs = {}
    for name, (csvs, _) in plots.FIGURES.items():
        have = plots.load_for(name, root / "data") is not None
        figs[name] = (root / "figures" / f"{name}.png" if have
                      else f"skipped: {' / '.join(c + '.csv' for c in csvs)} missing")
    assert report.render(root / "data", [], figs, root / "report") == (root / "report" / "REPORT.md").read_text()


def _memory_csvs(data, varlen_gpu: bool):
    """single_gpu rows (xpool and CuPy's pool at batch 32 and 4), the CPU replay's varying-length rows, and, if
    varlen_gpu, the GPU's varying-length rows."""
    data.mkdir(parents=True, exist_ok=True)
    prov = dict(gpu="NVIDIA H200", n_gpus=1, driver="580", cuda="13.2", cupy="14.2.0", commit="abc", date="2026-11-30")
    pd.DataFrame([dict(allocator=a, batch=b, trial=0, tokens_per_s=1.0, reserved_over_requested=r, **prov)
                  for a, b, r in (("xpool", 32, 1.008), ("cupy_pool", 32, 1.075), ("xpool", 4, 1.459),
                                  ("cupy_pool", 4, 1.460))]).to_csv(data / "single_gpu.csv", index=False)
    pd.DataFrame([dict(trace="gpt_varlen_numpy", allocator=a, reserved_over_requested=r, gpu="none")
                  for a, r in (("xpool", 1.024), ("cupy_pool_model", 1.321))]).to_csv(data / "memory_schemes.csv",
                                                                                       index=False)
    if varlen_gpu:
        pd.DataFrame([dict(trace="gpt_varlen_gpu", allocator=a, reserved_over_requested=r, **prov)
                      for a, r in (("xpool", 1.40), ("xpool_seed", 2.5), ("cupy_pool", 1.35))]).to_csv(
            data / "memory_varlen.csv", index=False)
    return data


def test_memory_targets_of_issue_14_use_gpu_rows_for_the_varying_trace_when_measured(tmp_path):
    rows = {r["target"]: r for r in report.memory_targets(_memory_csvs(tmp_path / "cpu", varlen_gpu=False))}
    assert rows["#14: batch 32: xpool peak reserved / peak requested ≤ 1.05 (one GPU)"]["verdict"] == "met"
    b4 = rows["#14: batch 4: xpool peak reserved / peak requested ≤ CuPy MemoryPool's (one GPU)"]
    assert b4["verdict"] == "met" and b4["measured"] == "1.459 (CuPy 1.460)"
    (replayed,) = [r for t, r in rows.items() if "varying" in t]
    assert "CPU replay" in replayed["target"] and replayed["verdict"] == "met"
    rows = {r["target"]: r for r in report.memory_targets(_memory_csvs(tmp_path / "gpu", varlen_gpu=True))}
    (measured,) = [r for t, r in rows.items() if "varying" in t]
    assert "measured, NVIDIA H200" in measured["target"] and "CPU replay" not in measured["target"]
    assert measured["verdict"] == "missed" and measured["measured"] == "1.400 (CuPy 1.350)"


def test_memory_targets_prefer_the_recheck_at_the_final_release_rule(tmp_path):
    data = _memory_csvs(tmp_path, varlen_gpu=False)
    prov = dict(gpu="NVIDIA H200", n_gpus=1, driver="580", cuda="13.2", cupy="14.2.0", commit="def", date="2026-11-30")
    pd.DataFrame([dict(allocator=a, batch=b, trial=t, tokens_per_s=tps * (1 + 0.01 * t), device_mallocs_per_step=m,
                       reserved_over_requested=r, **prov)
                  for t in range(5)
                  for a, b, r, m, tps in (("xpool", 32, 1.017, 0.0, 100.0), ("cupy_pool", 32, 1.03, 0.0, 100.0),
                                          ("xpool", 4, 1.042, 0.0, 90.0), ("cupy_pool", 4, 1.15, 0.0, 100.0))]
                 ).to_csv(data / "single_gpu_recheck.csv", index=False)
    rows = {r["target"]: r for r in report.memory_targets(data)}
    where = "one GPU, `single_gpu_recheck.csv`, commit def"
    assert rows[f"#14: batch 4: xpool peak reserved / peak requested ≤ CuPy MemoryPool's ({where})"]["measured"] == \
        "1.042 (CuPy 1.150)"
    assert rows[f"#14: xpool device mallocs per step after warm-up, batch 4 and 32 (max; {where})"]["verdict"] == "met"
    tps = "tokens/s within CuPy MemoryPool's ({}; the paired ratio's interval reaches 1)".format(where)
    assert rows[f"#14: batch 32: xpool {tps}"]["verdict"] == "met"
    assert rows[f"#14: batch 4: xpool {tps}"]["verdict"] == "missed"         # 0.90x in every trial


def test_graph_targets_judge_the_graph_runs(tmp_path):
    synthetic.write_all(tmp_path, trials=5)
    rows = {r["target"]: r for r in report.graph_targets(tmp_path)}
    threads = rows["2 GPUs, one thread per GPU, batch 32: xpool_graph ≥ 1.85× (step as a CUDA graph)"]
    assert threads["verdict"] == "met" and threads["measured"].startswith("1.96×")
    raw = rows["2 GPUs, one thread per GPU, batch 32: raw ≤ 1.3× beside the graph arms (the cliff stays visible)"]
    assert raw["verdict"] == "met"
    host = rows["host ms per step ≤ 12 at batch 32 (xpool_graph, thread CPU time of a step started on an idle "
                "device)"]
    assert host["verdict"] == "met" and host["measured"].startswith("1.10 ms")
    assert rows["one GPU, batch 4: GPU busy ≥ 70% (xpool_graph, NVML over 250-step windows)"]["verdict"] == "met"
    assert not any("process" in t for t in rows)                      # no processes CSV: no such row
    text = "\n".join(report.graph_lines(tmp_path))
    assert "| one GPU, batch 4, 250 steps | xpool_graph |" in text and "| threads, batch 32, 10 steps | raw |" in text
    assert "eager xpool reserves at most 4.56 GiB; xpool_graph 410 MiB in the arm's pool plus 4.28 GiB" in text
    assert report.graph_targets(tmp_path / "nothing") == [] and report.graph_lines(tmp_path / "nothing") == []


def test_the_hit_and_graph_headlines(tmp_path):
    synthetic.write_all(tmp_path, trials=5)
    assert report.headline_hit(tmp_path) is None                       # no sweep: no sentence
    rows = [dict(allocator=a, sweep="size", size_bytes=size, threads=1, trial=t, us_per_pair=us,
                 ratio_vs_cupy_pool=2.0 / us, **synthetic.PROV)
            for t in range(5) for size, us in ((4096, 1.9), (1 << 20, 1.8)) for a in ("xpool", "cupy_pool")]
    pd.DataFrame(rows).to_csv(tmp_path / "alloc_hit_sweep.csv", index=False)
    text = report.headline_hit(tmp_path)
    assert "1.05× [1.05, 1.05] at the worst size to 1.11×" in text and "commit synthetic" in text
    graph = report.headline_graph(tmp_path)
    assert "host work per step 1.10 ms" in graph and "xpool_graph 1.96×" in graph and "GPU busy 95%" in graph
