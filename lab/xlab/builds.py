"""Another build of xpool beside this one, in the same process, to time two builds with every trial interleaved
(xlab.bench.alloc --xpool-path): `load_xpool("build/core_before").MemoryPool(...)`.
The package is imported from PATH/xpool under another name; its imports are relative, so it loads its own C core.
"""
from __future__ import annotations

import importlib.util
import pathlib
import sys


def load_xpool(path, name: str = "xpool_before"):
    """The xpool package of the checkout at `path` (its C core built in place), imported as `name`. FileNotFoundError:
    no xpool package there; ImportError: its C core is not built; ValueError: name is "xpool", the package is imported
    under another name already (xpool itself, say: one C core loaded twice would share its state), or a module of
    that name is loaded from elsewhere."""
    if name == "xpool":
        raise ValueError("name must not be 'xpool': this checkout's package has that name")
    pkg = pathlib.Path(path).resolve() / "xpool"
    init = pkg / "__init__.py"
    if not init.is_file():
        raise FileNotFoundError(f"path={str(path)!r}: no xpool package at {pkg}")
    for other_name, module in list(sys.modules.items()):
        origin = getattr(getattr(module, "__spec__", None), "origin", None)
        if other_name != name and origin and pathlib.Path(origin).resolve() == init:
            raise ValueError(f"path={str(path)!r} holds the xpool imported as {other_name}: give another build")
    loaded = sys.modules.get(name)
    if loaded is not None:
        origin = getattr(loaded.__spec__, "origin", None)
        if origin is None or pathlib.Path(origin).resolve() != init:
            raise ValueError(f"name={name!r} is taken by {origin}")
        return loaded
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(pkg)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
