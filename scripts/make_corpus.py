"""Build workload/tapegpt/corpus.txt: Python standard-library source in a fixed, sorted file order."""
import argparse
import pathlib
import sysconfig

# Machine-specific or generated modules would make the corpus depend on the build.
SKIP_PREFIXES = ("_sysconfigdata", "__phello__", "__hello__")
DEFAULT_LIMIT = 3_000_000


def stdlib_files(root):
    """Top-level stdlib *.py files, sorted by name so the order never depends on the filesystem."""
    files = sorted(p for p in pathlib.Path(root).glob("*.py") if not p.name.startswith(SKIP_PREFIXES))
    return files


def build(root, limit):
    """Concatenate files (each behind a header line) until the next one would pass `limit` bytes."""
    out = bytearray()
    for path in stdlib_files(root):
        chunk = b"# ==== " + path.name.encode() + b" ====\n" + path.read_bytes()
        if len(out) + len(chunk) > limit:
            break
        out += chunk
    return bytes(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"])
    ap.add_argument("--limit", type=int, default=DEFAULT_LIMIT)
    ap.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parents[1] / "workload" / "tapegpt" /
                                         "corpus.txt"))
    args = ap.parse_args()
    data = build(args.stdlib, args.limit)
    pathlib.Path(args.out).write_bytes(data)
    print(f"wrote {len(data)} bytes to {args.out}")


if __name__ == "__main__":
    main()
