"""The research build: xpool as at a past commit, materialised from git history and loaded beside the product.

The product keeps one release rule per scheme; the lab keeps studying every rule through the package as it was at
RESEARCH_COMMIT, the last commit with all of them. `research_build()` extracts that commit's `xpool/` into
`build/research-<commit>/` (git-ignored) and builds its two C extensions in place; `load_research()` imports it as
`xpool_research` (xlab.builds.load_xpool), beside `xpool`:

    pkg = load_research()
    pool = pkg.pool.Pool(pkg.backends.HostBackend(), scheme="expandable", release_on_miss="peak")
"""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig

from xlab.builds import load_xpool
from xlab.paths import build_dir, repo_root

RESEARCH_COMMIT = "5bcaad4"                 # the last commit whose xpool has every release rule
EXTENSIONS = ("xpool._core", "xpool._vmm")  # the research build's C extensions (never the lab's xlab._probes)
NAME = "xpool_research"

# Run in the build folder by `python -c`: reads the commit's own setup.py (its sources and flags) with
# setuptools.setup captured, then builds only the extensions named in argv[1:] in place.
_BUILD_SCRIPT = """
import sys, setuptools
captured = {}
real_setup, setuptools.setup = setuptools.setup, lambda **kw: captured.update(kw)
exec(compile(open("setup.py").read(), "setup.py", "exec"), {"__name__": "__main__"})
setuptools.setup = real_setup
wanted = sys.argv[1:]
exts = [e for e in captured["ext_modules"] if e.name in wanted]
missing = sorted(set(wanted) - {e.name for e in exts})
if missing:
    sys.exit(f"setup.py builds no extension {missing}")
real_setup(name="xpool-research", packages=[], py_modules=[], ext_modules=exts,
           script_args=["build_ext", "--inplace", "--build-temp", ".build-temp", "--build-lib", ".build-temp/lib"])
"""


class ResearchBuildError(RuntimeError):
    """The research build could not be made: no git, no such commit, or its C extensions failed to build."""


def _git(*args: str, stdout=subprocess.PIPE) -> subprocess.CompletedProcess:
    """git ARGS at the repository root; ResearchBuildError when git is missing or fails."""
    try:
        return subprocess.run(["git", *args], cwd=repo_root(), stdout=stdout, stderr=subprocess.PIPE, check=True)
    except FileNotFoundError as e:
        raise ResearchBuildError("git is not installed: the research build is materialised from git history") from e
    except subprocess.CalledProcessError as e:
        raise ResearchBuildError(f"git {' '.join(args)} failed: {e.stderr.decode().strip()}") from e


def resolve_commit(commit: str) -> str:
    """The full hash of `commit`; ResearchBuildError when the repository has no such commit."""
    try:
        return _git("rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}").stdout.decode().strip()
    except ResearchBuildError as e:
        raise ResearchBuildError(f"commit {commit!r} is not in the repository at {repo_root()} (a shallow clone? "
                                 f"`git fetch --unshallow`)") from e


def _built(path: pathlib.Path) -> bool:
    """Whether path holds an xpool/ package with both extensions built for this interpreter."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    return all((path / (name.replace(".", "/") + suffix)).is_file() for name in EXTENSIONS)


def _materialise(sha: str, dest: pathlib.Path) -> None:
    """Extract commit `sha`'s xpool/ and setup.py into dest and build EXTENSIONS there in place."""
    dest.mkdir(parents=True)
    archive = _git("archive", sha, "xpool", "setup.py").stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    done = subprocess.run([sys.executable, "-c", _BUILD_SCRIPT, *EXTENSIONS], cwd=dest, capture_output=True,
                          text=True)
    if done.returncode != 0 or not _built(dest):
        raise ResearchBuildError(f"building {', '.join(EXTENSIONS)} of {sha[:12]} failed:\n"
                                 f"{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    shutil.rmtree(dest / ".build-temp", ignore_errors=True)


def research_build(commit: str = RESEARCH_COMMIT) -> pathlib.Path:
    """build/research-<commit>/: that commit's xpool/ (`git archive`) with its C core built in place, made once.
    The folder is named by the first 7 hex digits of the commit. ResearchBuildError: no git, no such commit, or a
    failed build (nothing is left behind then)."""
    sha = resolve_commit(commit)
    path = build_dir() / f"research-{sha[:7]}"
    if _built(path):
        return path
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _materialise(sha, tmp)
        if not _built(path):                    # another process may have finished first: keep its build
            shutil.rmtree(path, ignore_errors=True)
            try:
                tmp.rename(path)
            except OSError:
                if not _built(path):
                    raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def load_research(commit: str = RESEARCH_COMMIT, name: str = NAME):
    """The research build's xpool package (research_build(commit)), imported as `name` beside the product."""
    return load_xpool(research_build(commit), name)
