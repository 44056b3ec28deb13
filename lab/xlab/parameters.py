"""A notebook's parameters checked before anything else is imported: the standard library and xlab.paths alone (and,
to check `allocators` or `workloads`, the lab's tables that name them, without CuPy), so a misspelled or
out-of-range `-p` stops the notebook a moment after its kernel is up, not after pandas, matplotlib, jupytext and CuPy
have loaded (seconds each). Each notebook's cell after its parameters starts with

    from xlab import parameters
    parameters.check("NN_name", globals())

and xlab.notebook_utils.setup checks again (the same rules: it uses these) and says which parameters the machine
ignores. A notebook's cells are read from its jupytext .py here without jupytext (`code_cells`: its percent format's
`# %%` lines; a test keeps them equal to what jupytext reads)."""
from __future__ import annotations

import ast
import builtins
import dataclasses
import difflib
import importlib
import json
import pathlib
import re

from . import paths

_IPYTHON = {"In", "Out", "get_ipython", "exit", "quit", "open", "display"}


class ParameterError(ValueError, TypeError):
    """A notebook parameter of the wrong type, out of its range, or unknown. In a notebook it shows as one line that
    names the parameter and what it allows (IPython's `_render_traceback_`), not a traceback; papermill exits 1 with
    that line last."""

    def _render_traceback_(self) -> list[str]:
        return [f"\x1b[1;31mParameterError\x1b[0m: {self}"]


@dataclasses.dataclass(frozen=True)
class Param:
    """What one notebook parameter allows beside its annotated type: numbers (a list's items) from `lo` to `hi`,
    or one of `choices` ('module:attribute' is imported when checked; a dict gives its keys), or what `check`
    ('module:function', raising ValueError) accepts, described by `what`; a list empty or not; a str naming a
    folder. `only`: "gpu" where it sets what a GPU measures (a CPU ignores it and says so), "cpu" where it acts only
    without a GPU."""

    lo: float | None = None
    hi: float | None = None
    choices: tuple | str | None = None
    check: str = ""
    what: str = ""
    nonempty: bool = False
    folder: bool = False
    only: str = ""

    def options(self) -> tuple:
        found = _resolve(self.choices) if isinstance(self.choices, str) else self.choices
        return tuple(found) if isinstance(found, (tuple, list, dict)) else (found,)

    def allowed(self, ann: str) -> str:
        """'1 to 10,000', 'threads or processes', 'True or False', ...: the range a comment and a message give."""
        if ann == "bool":
            return "True or False"
        if self.folder:
            return "a folder of CSVs, or empty for data/"
        if self.what:
            what = self.what
        elif self.choices is not None:
            names = [f"{v:,}" if isinstance(v, int) else str(v) for v in self.options()]
            what = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
        elif self.lo is not None:
            what = f"{self.lo:,} to {self.hi:,}"
        else:
            what = "any"
        if ann.startswith("list"):
            return f"{what} each" + (", at least one" if self.nonempty else ", or empty for the default")
        return what

    def problem(self, ann: str, value) -> str | None:
        """None where `value` (of its annotated type) is allowed, else what is wrong with it ("" where the range
        says it all)."""
        items = value if ann.startswith("list") else [value]
        if ann.startswith("list") and self.nonempty and not items:
            return ""
        if self.folder:
            return "no such folder" if value and not pathlib.Path(value).is_dir() else None
        if self.choices is not None:
            bad = [v for v in items if v not in self.options()]
            return (f"{bad[0]!r} is not one of {', '.join(map(str, self.options()))}" if self.what else "") \
                if bad else None
        if self.check:
            try:
                _resolve(self.check)(items)
            except ValueError as e:
                return str(e)
            return None
        if self.lo is not None and any(not self.lo <= v <= self.hi for v in items):
            return ""
        return None


# Every parameter of every notebook (a name means the same in each), its range and where it acts: `setup` checks the
# values against it, and each parameter's comment in its notebook ends with what it allows (a test keeps them equal).
PARAMETERS = {
    "data_dir": Param(folder=True),
    "publish": Param(),
    "measure": Param(only="gpu"),
    "cpu_check": Param(only="cpu"),
    "quick": Param(only="gpu"),
    "with_torch": Param(),
    "fail_on_error": Param(),
    "transparency_steps": Param(1, 10_000, only="gpu"),
    "steps": Param(1, 10_000, only="gpu"),
    "warmup": Param(0, 1_000, only="gpu"),
    "trials": Param(1, 100, only="gpu"),
    "batch": Param(1, 4_096, only="gpu"),
    "batches": Param(1, 4_096, nonempty=True, only="gpu"),
    "worlds": Param(1, 64, nonempty=True, only="gpu"),
    "modes": Param(choices=("threads", "processes"), nonempty=True, only="gpu"),
    "allocators": Param(check="xlab.allocators:parse", what="arms of xlab.allocators.ARMS", only="gpu"),
    "sweep": Param(only="gpu"),
    "graph": Param(only="gpu"),
    "ks": Param(1, 64, nonempty=True),          # xpool's classes_per_doubling: 1 to 64
    "workloads": Param(choices="xlab.shared:WORKLOADS", what="workloads of xlab.bench.dynamic.WORKLOADS",  # its keys
                       only="gpu"),
    "scale": Param(only="gpu"),
}


def _resolve(fn):
    """A callable, or 'package.module:function' imported only now (so a CPU never imports GPU code)."""
    if callable(fn):
        return fn
    module, _, name = fn.partition(":")
    return getattr(importlib.import_module(module), name)


def code_cells(name: str) -> list[tuple[str, bool]]:
    """(source, tagged `parameters`) of each code cell of notebooks/NAME.py (jupytext's percent format: a cell starts
    at a `# %%` line, `[markdown]` or `[raw]` after it for a cell of text, `tags=[...]` for its tags; the header
    between `# ---` lines before the first cell is metadata), read without jupytext."""
    text = (paths.repo_root() / "notebooks" / f"{name}.py").read_text()
    cells, current = [], None
    for line in text.splitlines():
        if line.startswith("# %%"):
            head = line[4:]
            tags = re.search(r"tags=(\[[^\]]*\])", head)
            current = None if re.search(r"\[(markdown|md|raw)\]", head) else [
                "parameters" in (json.loads(tags[1]) if tags else []), []]
            if current is not None:
                cells.append(current)
        elif current is not None:
            current[1].append(line)
    return [("\n".join(lines).strip("\n"), tagged) for tagged, lines in cells]


def schema(name: str) -> dict:
    """{parameter: (annotation, default)} from the notebook's cell tagged `parameters`."""
    source = next(src for src, tagged in code_cells(name) if tagged)
    return {n.target.id: (ast.unparse(n.annotation), ast.literal_eval(n.value))
            for n in ast.parse(source).body if isinstance(n, ast.AnnAssign)}


def _example(name: str, ann: str, default) -> str:
    """How papermill passes this parameter, from its own name and default: '-p worlds 2, or -y "worlds: [2, 1]"'."""
    if ann.startswith("list"):
        items = [str(v) for v in default] or ["..."]
        return f"-p {name} {items[0]}, or -y '{name}: [{', '.join(items)}]'"
    return f"-p {name} {default if default != '' else '...'}"


def _coerce(name: str, ann: str, value, default=None):
    """The value as its annotation wants it; papermill's `-p x 4` (a scalar, or 'a,b') stands for a list too."""
    kinds = {"int": int, "float": (int, float), "str": str, "bool": bool}
    base = ann.removeprefix("list[").removesuffix("]")
    example = {ann: _example(name, ann, default)}
    if ann.startswith("list"):
        items = value.replace(",", " ").split() if isinstance(value, str) else value
        items = items if isinstance(items, (list, tuple)) else [items]
        try:
            items = [int(v) if base == "int" and isinstance(v, str) else v for v in items]
        except ValueError:
            items = None
        if items is None or not all(isinstance(v, kinds[base]) and not (isinstance(v, bool) and base != "bool")
                                    for v in items):
            raise ParameterError(f"parameter {name!r} must be a {ann} ({example[ann]}), got {value!r}")
        return list(items)
    if not isinstance(value, kinds[ann]) or (isinstance(value, bool) and ann != "bool"):
        raise ParameterError(f"parameter {name!r} must be {ann} ({example[ann]}), got {type(value).__name__} "
                             f"{value!r}")
    return float(value) if ann == "float" else value


def injected(namespace: dict) -> list[str]:
    """The names papermill's injected cells assigned in this run (IPython's `In`, the cells run so far): the cells
    starting "# Parameters" (papermill's translator writes them, tagged `injected-parameters`) run between the
    parameters cell and the current one. A name the notebook assigns in a later cell (`-p rows 4`) is caught here,
    where the namespace alone cannot tell it from the notebook's own; none outside IPython or in JupyterLab."""
    inputs = namespace.get("In")
    if not isinstance(inputs, list):
        return []
    names = []
    for source in reversed(inputs[:-1]):              # In[-1]: the cell running now (the setup cell)
        if not str(source).lstrip().startswith("# Parameters"):
            break
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        names = [t.id for node in tree.body if isinstance(node, ast.Assign)
                 for t in node.targets if isinstance(t, ast.Name)] + names
    return list(dict.fromkeys(names))


def check(name: str, namespace: dict) -> None:
    """Bring each parameter of notebook `name` in `namespace` to its annotated type and check it against PARAMETERS.
    ParameterError: an unknown parameter (the closest named: one papermill injected, or any name in the namespace
    the notebook never assigns), a wrong type, a value out of range."""
    params = schema(name)
    assigned = {node.id for src, _ in code_cells(name) for node in ast.walk(ast.parse(src))
                if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)}
    strays = [k for k in injected(namespace) if k not in params] + [
        key for key, value in namespace.items()
        if not (key.startswith("_") or key in params or key in assigned or key in _IPYTHON or hasattr(builtins, key)
                or not isinstance(value, (int, float, str, bool, list, tuple, dict)))]
    for key in strays:
        close = difflib.get_close_matches(key, params, n=1)
        raise ParameterError(f"unknown parameter {key!r} for notebook {name}" + (f" (did you mean {close[0]!r}?)"
                             if close else "") + f"; its parameters: {', '.join(params)}")
    for key, (ann, default) in params.items():
        value = namespace[key] = _coerce(key, ann, namespace[key], default)
        spec = PARAMETERS[key]
        why = spec.problem(ann, value)
        if why is not None:
            raise ParameterError(f"parameter {key!r} ({ann}) must be {spec.allowed(ann)}; got {value!r}"
                                 + (f": {why}" if why else ""))


def ignored(name: str, namespace: dict, gpu: bool) -> list[str]:
    """The parameters of notebook `name` this machine ignores, set away from their default ('steps=3'): GPU-only
    ones on a CPU, CPU-only ones on a GPU."""
    return [f"{key}={namespace[key]!r}" for key, (_, default) in schema(name).items()
            if (spec := PARAMETERS[key]).only and (spec.only == "gpu") != gpu and namespace[key] != default]


def check_parameters(name: str, namespace: dict, gpu: bool) -> list[str]:
    """`check`, then the parameters this machine ignores (`ignored`)."""
    check(name, namespace)
    return ignored(name, namespace, gpu)
