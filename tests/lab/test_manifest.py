"""data/ keeps what a figure, the report, a notebook or a test reads, and says so: data/MANIFEST.csv has one row per
file (file, made_by: the command or module that made it, read_by: the modules, notebooks or tests that read it).
Logs and one-off studies stay in git history (tag record-2026-12-05), not in data/."""
import csv
import pathlib
import re

import pytest

from xlab import sources

ROOT = pathlib.Path(__file__).resolve().parents[2]
DATA = ROOT / "data"
READER_FOLDERS = ("lab/", "notebooks/", "tests/", "scripts/")


def manifest() -> list[dict]:
    with open(DATA / "MANIFEST.csv", newline="") as f:
        return list(csv.DictReader(f))


def files_under_data() -> set[str]:
    return {p.relative_to(DATA).as_posix() for p in DATA.rglob("*") if p.is_file()} - {"MANIFEST.csv"}


def stem(name: str) -> str:
    """'graph/single_gpu_b4.csv' -> 'single_gpu_b4'; 'memory_trace_dyn_x_s1.csv.gz' -> 'memory_trace_dyn_x_s1'."""
    return re.sub(r"\.csv(\.gz)?$", "", name.rpartition("/")[2])


def lineages(name: str) -> list[str]:
    """The kinds of xlab.sources.KINDS whose CSVs include this file (a rerun/ copy counts as its first run's)."""
    plain = re.sub(r"\.csv$", "", re.sub(r"(^|/)rerun/", r"\1", name))
    return [kind for kind, (csvs, _) in sources.KINDS.items() if any(c == plain for c, _ in csvs)]


def mentions(text: str, name: str) -> bool:
    """Whether a reader's text names the file: its name without the suffix, a lineage it belongs to (as a quoted
    kind), or an f-string prefix of its name (`f"memory_trace_dyn_{name}.csv.gz"` reads every such trace)."""
    s = stem(name)
    if s in text or any(f'"{kind}"' in text for kind in lineages(name)):
        return True
    return any(s.startswith(prefix) for prefix in re.findall(r"([A-Za-z0-9_]{8,})\{", text))


def test_the_manifest_and_data_hold_the_same_files():
    rows = manifest()
    named = [r["file"] for r in rows]
    assert len(named) == len(set(named)), "a file named twice"
    files = files_under_data()
    assert sorted(files - set(named)) == [], "files under data/ the manifest does not name"
    assert sorted(set(named) - files) == [], "manifest rows whose file does not exist"


def test_data_holds_no_logs():
    assert not (DATA / "logs").exists()
    logs = [f for f in files_under_data() if re.search(r"\.(log|txt|tgz|tar|tar\.gz|zip)$", f)]
    assert logs == []


def test_every_row_says_what_made_it_and_what_reads_it():
    for row in manifest():
        assert row["made_by"].strip(), row["file"]
        readers = [r.strip() for r in row["read_by"].split(";")]
        assert readers and all(readers), row["file"]
        for reader in readers:
            assert reader.startswith(READER_FOLDERS), (row["file"], reader, "not a module, notebook or test")
            assert (ROOT / reader).is_file(), (row["file"], reader, "no such file")


@pytest.mark.parametrize("row", manifest(), ids=lambda r: r["file"])
def test_every_reader_named_mentions_its_file(row):
    for reader in (r.strip() for r in row["read_by"].split(";")):
        assert mentions((ROOT / reader).read_text(), row["file"]), f"{reader} does not mention {row['file']}"


def test_the_reader_check_can_fail():
    assert mentions('d = read(data, "alloc_hit_sweep")', "alloc_hit_sweep.csv")
    assert mentions('sources.current(data, "alloc_size")', "rerun/alloc_hit_sweep.csv")
    assert mentions('pd.read_csv(folder / f"memory_trace_dyn_{name}.csv.gz")', "memory_trace_dyn_cupy_mix_s3.csv.gz")
    assert not mentions('pd.read_csv("alloc_microbench.csv")', "alloc_hit_sweep.csv")
    assert not mentions('f"trace_{x}"', "memory_trace_dyn_cupy_mix.csv.gz")     # too short a prefix to count
