"""scripts/expandable_variants.py: its replay of an H200 trace under the rule that trace ran gives that run's
peaks and device calls (so the other rules' rows can be believed), and the release rules differ where they should."""
import pathlib
import sys

import pandas as pd

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "scripts"))
import expandable_variants as ev  # noqa: E402

DATA = pathlib.Path(__file__).resolve().parents[2] / "data"


def test_a_replay_under_the_traces_own_rule_is_the_gpus_run_and_growth_unmaps_less_than_bounded():
    tl = pd.read_csv(DATA / "memory_trace_dyn_cupy_mix.csv.gz")
    gpu = tl.iloc[0]
    own = ev.replay(tl, dict(scheme="expandable", release_on_miss=gpu.release_on_miss), False)
    assert (own["peak_bytes_reserved"], own["peak_bytes_requested"], own["device_calls"]) == \
        (gpu.gpu_peak_bytes_reserved, gpu.gpu_peak_bytes_requested, gpu.gpu_device_calls)
    bounded, growth = (ev.replay(tl, dict(scheme="expandable", release_on_miss=rule), False)
                       for rule in ("bounded", "growth"))
    assert bounded["reserved_over_requested"] < own["reserved_over_requested"]       # the bound gives pages back
    assert own["device_calls"] < growth["device_calls"] < bounded["device_calls"]      # growth only while it grows
