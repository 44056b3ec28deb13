"""Where the lab's repository lives: found once, here, from the working directory (or XPOOL_REPO).

The packages never derive paths from their own location: an installed (non-editable) xlab has no repository
next to it. The lab reads and writes the repository's data/, figures/, notebooks/, report/ and build/.
"""
from __future__ import annotations

import functools
import os
import pathlib

ENV = "XPOOL_REPO"


def _is_repo(path: pathlib.Path) -> bool:
    return (path / "pyproject.toml").is_file() and (path / "notebooks").is_dir() and (path / "lab" / "xlab").is_dir()


@functools.lru_cache(maxsize=None)
def _find(start: str) -> pathlib.Path:
    for path in (pathlib.Path(start), *pathlib.Path(start).parents):
        if _is_repo(path):
            return path
    raise FileNotFoundError(
        f"no xpool repository found at or above {start} (looked for pyproject.toml, notebooks/ and lab/xlab/); "
        f"run from inside the checkout or set {ENV}=/path/to/checkout")


def repo_root() -> pathlib.Path:
    """The checkout: $XPOOL_REPO if set, else the first folder at or above the working directory that is one."""
    env = os.environ.get(ENV)
    if env:
        path = pathlib.Path(env).resolve()
        if not _is_repo(path):
            raise FileNotFoundError(f"{ENV}={env} is not an xpool checkout (no pyproject.toml, notebooks/, lab/xlab/)")
        return path
    return _find(str(pathlib.Path.cwd().resolve()))


def data_dir() -> pathlib.Path:
    """<repo>/data: the committed CSVs."""
    return repo_root() / "data"


def figures_dir() -> pathlib.Path:
    """<repo>/figures: the committed figures."""
    return repo_root() / "figures"


def build_dir() -> pathlib.Path:
    """<repo>/build: what a run produces and nobody commits (executed notebooks, CPU check results)."""
    return repo_root() / "build"


def write_csv(df, out) -> None:
    """Write a DataFrame (without its index) to the CSV `out`, making its folder; nothing when out is None."""
    if out is None:
        return
    path = pathlib.Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(path, index=False)


def publish(df, out, text: str = ""):
    """A measurement's tail: print its table, write its CSV to `out` (None or "": none) and say so; the frame."""
    if text:
        print(text)
    if out:
        write_csv(df, out)
        print(f"wrote {out}")
    return df
