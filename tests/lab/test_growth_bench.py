"""The growth benchmark's plumbing on a CPU (xlab.bench.growth): the request sequence, the driver-call rules, the arms
interleaved a process per trial and arm, the CSV's shape and provenance, a failing arm kept as a row.

The GPU run itself: `python -m xlab.bench.growth` (scripts/gpu_suite.sh growth)."""
import os
import stat
import sys

import pandas as pd
import pytest

from xlab.bench import growth as bench

MIB = 1 << 20


def test_the_sequence_is_fixed_and_sums_to_the_target():
    s = bench.sequence()
    assert len(s) == 1500 and s == bench.sequence() and s != bench.sequence(seed=1)
    assert abs(sum(s) - 28e9) < 1500 * 512 and all(n % 512 == 0 and n >= 512 for n in s)
    assert max(s) / min(s) > 500                              # sizes over nearly three decades
    with pytest.raises(ValueError, match="target"):
        bench.sequence(10, 100)


def test_pytorchs_rule_by_hand():
    # 3 MiB: the large pool maps a 20 MiB segment (create, map, access); 3 MiB more fits its tail (a hit);
    # 30 MiB reaches 16 MiB past it: one more segment; 512 B: the small pool's first 2 MiB segment
    sizes = [3 * MIB, 3 * MIB, 30 * MIB, 512]
    assert bench.pytorch_driver_calls(sizes) == {"handles": 3, "maps": 3, "calls": 9}
    assert bench.pytorch_driver_calls(sizes, peers=1)["calls"] == 12   # setAccess once more per run, per peer
    assert bench.pytorch_driver_calls([41 * MIB])["handles"] == 3


def test_xpools_rule_by_hand():
    # only the pages a block reaches, in handles of 20 MiB (never larger), the last one the rest:
    # 3 MiB: 2 pages, one handle; 3 MiB more: 1 page past the tail; 30 MiB: 15 pages, 20 MiB + 10 MiB;
    # 512 B: a page (a small request's handle); 1 GiB: 1,022 MiB + 512 B past the tail, 512 pages: 51 handles of
    # 20 MiB and one of 4 MiB
    sizes = [3 * MIB, 3 * MIB, 30 * MIB, 512, 1 << 30]
    assert bench.xpool_driver_calls(sizes) == {"handles": 1 + 1 + 2 + 1 + 52, "maps": 5, "calls": 2 * 57 + 5}
    # ahead (the range manager's lab option): whole handles, so 3 MiB more and 512 B fit the tail: 3 maps, the
    # 1 GiB run rounded up to 1,040 MiB (52 handles)
    assert bench.xpool_driver_calls(sizes, ahead=True) == {"handles": 2 + 52, "maps": 3, "calls": 2 * 54 + 3}
    assert bench.xpool_driver_calls([512, 512])["calls"] == 3               # a 2 MiB page, then a hit
    # before handles: a handle a page, released at once (3 calls a page): 2 + 1 + 15 + 1 + 512 pages in 5 runs
    assert bench.xpool_driver_calls(sizes, page_handles=True) == {"handles": 531, "maps": 5, "calls": 3 * 531 + 5}


def stand_in(arm, n, target, seed, timeout, python):
    if arm == "cupy_pool":
        return {"error": "stand-in: no GPU"}
    t = {"xpool_expandable": 0.1, "torch_expandable": 0.09}.get(arm, 0.2)
    return dict(requests=n, bytes=target, total_s=t, us_median=t / n * 1e6, us_p90=2 * t / n * 1e6,
                device_calls=n // 2, peak_reserved=target)


def test_trials_interleave_the_arms_a_row_each_with_provenance(tmp_path):
    out = tmp_path / "growth.csv"
    df = bench.run(str(out), trials=5, n=30, target=30 * MIB, spawn=stand_in)
    assert len(df) == 5 * len(bench.ARMS) and list(df.columns[:len(bench.COLUMNS)]) == bench.COLUMNS
    for col in ("gpu", "driver", "cuda", "cupy", "commit", "date", "n_requests", "target_bytes", "seed"):
        assert col in df.columns
    firsts = df[df.order == 0].sort_values("trial").arm.tolist()
    assert firsts == list(bench.ARMS)                          # who goes first rotates
    assert (df.groupby("trial").arm.nunique() == len(bench.ARMS)).all()
    failed = df[df.arm == "cupy_pool"]
    assert (failed.error == "stand-in: no GPU").all() and failed.total_s.isna().all()
    sizes = bench.sequence(30, 30 * MIB)
    assert (df[df.arm == "torch_expandable"].driver_calls_model == bench.pytorch_driver_calls(sizes)["calls"]).all()
    assert df[df.arm == "cupy_async"].driver_calls_model.isna().all()
    back = pd.read_csv(out)
    assert len(back) == len(df) and list(back.columns) == list(df.columns)
    s = bench.summary(df).set_index("arm")
    assert "cupy_pool" not in s.index and s.loc["xpool_expandable", "trials"] == 5
    assert s.loc["xpool_expandable", "over_torch_expandable"] == pytest.approx(0.1 / 0.09)


def test_bad_arms_and_trials_are_named():
    with pytest.raises(ValueError, match="arms must be some of"):
        bench.run(None, arms=("nope",), spawn=stand_in)
    with pytest.raises(ValueError, match="trials must be at least 1"):
        bench.run(None, trials=0, spawn=stand_in)


def test_each_trial_is_a_process_and_torchs_gets_expandable_segments(tmp_path):
    """_spawn runs `python -m xlab.bench.growth --child ARM ...` and reads its last JSON line: a stand-in python that
    echoes its arguments and PYTORCH_CUDA_ALLOC_CONF; one that fails is a row with its error."""
    fake = tmp_path / "python"
    fake.write_text("#!" + sys.executable + "\nimport json, os, sys\n"
                    "if sys.argv[4] == 'cupy_pool': sys.exit('no GPU here')\n"
                    "print('noise'); print(json.dumps({'total_s': 1.0, 'argv': sys.argv[1:], "
                    "'conf': os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')}))\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    try:
        got = bench._spawn("torch_expandable", 30, 1 << 30, 3, 30, str(fake))
        assert got["argv"] == ["-m", "xlab.bench.growth", "--child", "torch_expandable", "--n", "30", "--target",
                               str(1 << 30), "--seed", "3"]
        assert got["conf"] == "expandable_segments:True"
        assert bench._spawn("xpool_expandable", 30, 1 << 30, 3, 30, str(fake))["conf"] == ""
        assert bench._spawn("cupy_pool", 30, 1 << 30, 3, 30, str(fake)) == {"error": "no GPU here"}
    finally:
        if env is not None:
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = env


@pytest.mark.parametrize("arm", ["xpool_expandable", "xpool_segments"])
def test_the_xpool_arms_grow_over_the_host_twin_and_count_their_calls(arm):
    """The child's xpool arms over the tests' host twin (2 MiB pages, as an H100): every request kept, the row's
    fields, and the ops calls the pool counts (expandable: a run per map, the rule's `maps`)."""
    xpool_twin = pytest.importorskip("xpool_twin")
    sizes = bench.sequence(60, 600 * MIB)
    backend = xpool_twin.TwinBackend(granularity=2 * MIB)
    got = bench.child(arm, sizes, backend=backend)
    assert got["requests"] == 60 and got["bytes"] == sum(sizes) and got["total_s"] > 0
    assert got["us_p90"] >= got["us_median"] > 0 and got["peak_reserved"] >= sum(sizes)
    if arm == "xpool_expandable":
        model = bench.xpool_driver_calls(sizes)
        c = backend.twin.counters()                            # the product's core: the twin's handles and maps
        assert got["device_calls"] == c["maps"] == model["maps"] and c["map_pages"] == model["handles"]
    else:
        assert 0 < got["device_calls"] <= 60                   # a cudaMalloc per miss


def test_a_bad_arm_is_named():
    with pytest.raises(ValueError, match="arm must be one of"):
        bench.child("nope", [512])
