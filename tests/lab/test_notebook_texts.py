"""What a notebook says is computed from the rows it shows: the machine each committed CSV was measured on (a GPU's
rows beside a CPU's are not "measured on a machine without a GPU"), and why two figures of one set-up differ (04:
the runs they come from, and what differs between them)."""
import pandas as pd

from lab_fixtures import synthetic
from xlab import notebook_utils as nbu
from xlab import paths, sources


def test_a_gpus_rows_beside_a_cpus_name_each_machine():
    rows = pd.concat([synthetic.correctness().assign(gpu="none", date="2000-01-02T00:00:00Z"),
                      synthetic.correctness()], ignore_index=True)
    said = nbu.describe_provenance(rows)
    assert said.startswith("measured on a machine without a GPU (") and "; and on SYNTHETIC GPU (" in said
    assert "2000-01-02" in said.split("; and on")[0] and "2000-01-02" not in said.split("; and on")[1]


def test_the_committed_gpu_checks_are_said_to_come_from_a_gpu():
    """The rows shown are the newest of each arm over the checks' lineage (the H100 run at db0b678 beside the CPU's):
    each machine they ran on is named, and a GPU whose rows are not shown is not."""
    said = nbu.shown_from("correctness_gpu")
    shown = sources.current(paths.data_dir(), "correctness")
    gpus = set(shown["gpu"].astype(str)) - {"none"}
    assert gpus and all(f"on {gpu} (" in said for gpu in gpus)
    assert ("none" in set(shown["gpu"].astype(str))) == ("measured on a machine without a GPU (" in said)
    older = set(sources.read(paths.data_dir(), "correctness_gpu")["gpu"].astype(str)) - gpus
    assert not any(f"on {gpu} (" in said for gpu in older)


def _run(csv, commit, speedups, steps):
    return pd.DataFrame({"mode": "threads", "world": 2, "batch": 32, "allocator": ["xpool", "cupy_pool"] * 5,
                         "speedup": speedups * 5, "gpu_util_mean": 80.0, "csv": csv, "commit": commit,
                         "date": "2000-01-01T00:00:00Z", "gpu": "SYNTHETIC GPU", "steps": steps})


def test_one_setup_in_two_runs_names_both_and_what_differs():
    a = _run("ddp_scaling.csv", "aaaaaaa", [1.36, 1.56], 6)
    b = pd.concat([_run("graph/ddp_scaling.csv", "bbbbbbb", [1.82, 1.78], 12),
                   _run("graph/ddp_scaling.csv", "bbbbbbb", [1.9, 1.9], 12).assign(allocator="xpool_graph")])
    table, said = nbu.same_setup(a, b, where=dict(mode="threads", world=2, batch=32))
    assert said == ("The same set-up (mode threads, world 2, batch 32) in 2 runs: ddp_scaling.csv, "
                    "graph/ddp_scaling.csv; they differ in commit, steps.")
    assert list(table["allocator"]) == ["xpool", "cupy_pool", "xpool", "cupy_pool"]      # the arms both show
    assert list(table["speedup"].str[:5]) == ["1.36×", "1.56×", "1.82×", "1.78×"]
    assert nbu.same_setup(a, None) == (None, "")
    assert nbu.same_setup(a, a.assign(world=1), where=dict(world=2))[0] is None           # one run: nothing to say


def test_the_committed_runs_of_04_are_told_apart():
    table, said = nbu.same_setup(sources.current(paths.data_dir(), "ddp"), sources.current(paths.data_dir(), "graph"),
                                 where=dict(mode="threads", world=2, batch=32))
    assert table is not None and table["csv"].nunique() == 2 and "they differ in commit" in said
