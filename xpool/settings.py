"""Settings: the five choices a pool makes, in one typed, frozen object, resolved and checked in one place.

    s = xpool.Settings(scheme="seed", limit="8GiB")     # or xpool.Pool(backend, scheme="seed", limit="8GiB")
    print(s.describe())                                # each value, where it came from, what it does

Each field comes from the argument when one is given, else from its ``XPOOL_*`` environment variable (``ENV``), else
from its default. Every value is checked here, once; a bad one raises a ``ValueError`` that names the argument or the
variable it came from, e.g. ``ValueError: XPOOL_MEMORY_LIMIT='0.4B': not a whole number of bytes``. The C core reads
the resolved object.

``classes_per_doubling`` belongs to scheme seed: given for another scheme it is an error (its variable too, unless a
scheme argument overrides the environment), and it is None in a resolved Settings of another scheme.
"""
from __future__ import annotations

import dataclasses
import numbers
import operator
import os
import re
from dataclasses import dataclass
from fractions import Fraction

from . import _core
from .sizeclass import MAX_CLASSES_PER_DOUBLING, MAX_REQUEST

SCHEMES = ("segments", "seed", "expandable")   # how blocks are made (README: the settings)
DEBUG_MODES = ("raise", "warn")
ENV = {
    "scheme": "XPOOL_SCHEME",
    "classes_per_doubling": "XPOOL_CLASSES_PER_DOUBLING",
    "limit": "XPOOL_MEMORY_LIMIT",
    "debug": "XPOOL_DEBUG",
    "timeline": "XPOOL_TIMELINE",
}
DEFAULTS = {"scheme": "segments", "classes_per_doubling": 1, "limit": 0, "debug": False, "timeline": 0}
# A front end's default scheme where it differs: the pool xpool.enable_torch() makes is expandable, as PyTorch's
# expandable segments (docs/decisions: the default scheme per front end)
FRONTEND_SCHEMES = {"torch": "expandable"}
HELP = {
    "scheme": "how blocks are made: 'segments' (best fit in segments), 'seed' (size classes) or 'expandable' "
              "(best fit in pages mapped into reserved address ranges)",
    "classes_per_doubling": "seed: size classes per doubling above 1 MiB (1: powers of two)",
    "limit": "bytes each device may hold for the pool (0: none), or a share of each device",
    "debug": "debug mode: poison freed blocks, canary after each block ('raise', 'warn' or False)",
    "timeline": "allocation events kept (0: off)",
}
MAX_TIMELINE = 1 << 40                      # events (64 B each): past any host's memory
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4,
          "tb": 1000**4, "tib": 1024**4}
_OFF = ("0", "", "off", "false", "no")
_ON = ("1", "on", "true", "yes")


@dataclass(frozen=True, repr=False)
class Settings:
    """Everything a pool is configured with, resolved and checked.

    Fields left None are resolved: the ``XPOOL_*`` variable of ``ENV``, else the default; a resolved Settings holds
    normalised values (``limit="8GiB"`` becomes 8589934592), and keywords over it (``xpool.Pool(backend, s, debug="warn")``)
    replace those fields alone.

    Attributes:
        scheme (str): how blocks are made (``XPOOL_SCHEME``): ``"segments"`` (CuPy's default), best fit in segments of one
            ``cudaMalloc`` each; ``"expandable"`` (``xpool.enable_torch()``'s default), best fit in pages mapped into one
            reserved address range per stream (CUDA's virtual memory; no CUDA IPC of its blocks); ``"seed"``, the
            design's size classes, one ``cudaMalloc`` per block, kept as the reference.
        classes_per_doubling (int): scheme seed: classes between p and 2p above 1 MiB, 1 to 64
            (``XPOOL_CLASSES_PER_DOUBLING``; default 1, powers of two).
        limit (int or float): bytes each device may hold for the pool, in use, cached and in flight
            (``XPOOL_MEMORY_LIMIT``): an int (0: none), a float in (0, 1] (that share of each device), or text
            (``"8GiB"``, ``"500MB"``, ``"50%"``).
        debug (str or bool): ``"raise"``, ``"warn"`` or False (``XPOOL_DEBUG``: also ``1``/``on``, ``0``/``off``); True
            is ``"raise"``. See ``xpool.debug``.
        timeline (int): allocation events kept in a ring (``XPOOL_TIMELINE``; 0: off); ``Pool.timeline()`` reads them.

    Args:
        frontend (str or None): whose default scheme fills a scheme left None: xpool's (None) or ``"torch"``
            (``FRONTEND_SCHEMES``); its source then says ``"default (torch)"``.

    Raises:
        ValueError: a bad value, or a removed setting, naming the argument or variable it came from.
    """

    scheme: str | None = None
    classes_per_doubling: int | None = None
    limit: int | float | str | None = None
    debug: str | bool | None = None
    timeline: int | None = None
    _: dataclasses.KW_ONLY
    frontend: dataclasses.InitVar[str | None] = None

    def __post_init__(self, frontend):
        if frontend is not None and not (isinstance(frontend, str) and frontend in FRONTEND_SCHEMES):
            raise ValueError(f"frontend must be None or one of {', '.join(map(repr, FRONTEND_SCHEMES))}, "
                             f"got {frontend!r}")
        env = _environment()
        if "scheme" in env:
            scheme, source = env["scheme"], ENV["scheme"]
        elif frontend is not None:
            scheme, source = FRONTEND_SCHEMES[frontend], f"default ({frontend})"
        else:
            scheme, source = DEFAULTS["scheme"], "default"
        if self.scheme is not None:
            scheme, source = self.scheme, "scheme"
        resolved, sources = {"scheme": _scheme(scheme, source)}, {"scheme": source}
        for name in ENV:
            if name == "scheme":
                continue
            given = getattr(self, name)
            if name == "classes_per_doubling" and resolved["scheme"] != "seed":
                if given is not None:
                    raise ValueError(f"classes_per_doubling={given!r} applies to scheme 'seed' only, and this "
                                     f"pool's scheme is {resolved['scheme']!r}: give scheme='seed' with it")
                if name in env and sources["scheme"] != "scheme":   # the environment is one configuration
                    said = (f"{ENV['scheme']} is {env['scheme']!r}" if "scheme" in env else
                            f"the scheme is {resolved['scheme']!r} ({sources['scheme']})")
                    raise ValueError(f"{ENV[name]}={env[name]!r} applies to scheme 'seed' only, and {said}: set "
                                     f"{ENV['scheme']}=seed with it")
                resolved[name], sources[name] = None, "n/a"
                continue
            if given is not None:
                value, source = given, name
            elif name in env:
                value, source = env[name], ENV[name]
            else:
                value, source = DEFAULTS[name], "default"
            resolved[name], sources[name] = _PARSERS[name](value, source), source
        for name, value in resolved.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_sources", sources)   # field -> argument, variable, "default" or "n/a"

    def __repr__(self):
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in ENV if self._sources[name] != "n/a")
        return f"Settings({shown})"

    def source(self, name: str) -> str:
        """Where a field's value came from: the argument's name, the ``XPOOL_*`` variable, ``"default"``
        (``"default (torch)"``: the front end's), or ``"n/a"`` (scheme seed's field under another scheme).

        Raises:
            ValueError: ``name`` is no field.
        """
        if not isinstance(name, str) or name not in ENV:
            raise ValueError(f"name must be one of {', '.join(ENV)}, got {name!r}")
        return self._sources[name]

    def describe(self) -> str:
        """The settings as a table: each field that applies, its value, where it came from, what it does."""
        rows = [(name, _shown(name, getattr(self, name)), self._sources[name], HELP[name])
                for name in ENV if self._sources[name] != "n/a"]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        return "\n".join(f"{n:<{widths[0]}}  {v:<{widths[1]}}  {s:<{widths[2]}}  {h}" for n, v, s, h in rows)


def resolve(settings: Settings | None, fields: dict, who: str = "Pool") -> Settings:
    """The Settings a pool is made with: ``settings`` with ``fields`` (keyword settings) over it.

    A keyword over a given Settings replaces that field alone: the fields given as arguments keep their values,
    the others are resolved again (the environment, the defaults) and say so in ``source()``; a new scheme drops
    classes_per_doubling.

    Raises:
        TypeError: ``settings`` is not a Settings, or a keyword is no setting.
        ValueError: a bad value.
    """
    unknown = sorted(set(fields) - set(ENV))
    if unknown:
        raise TypeError(f"{who}() got no setting {', '.join(map(repr, unknown))}; the settings are "
                        f"{', '.join(ENV)}")
    if settings is None:
        return Settings(**fields)
    if not isinstance(settings, Settings):
        raise TypeError(f"settings must be an xpool.Settings, got {type(settings).__name__} {settings!r}")
    if not fields:
        return settings
    kept = {name: getattr(settings, name) for name in ENV if settings.source(name) == name}
    if "scheme" in fields and fields["scheme"] != settings.scheme:
        kept.pop("classes_per_doubling", None)
    frontend = next((f for f in FRONTEND_SCHEMES if settings.source("scheme") == f"default ({f})"), None)
    return Settings(**{**kept, **fields}, frontend=frontend)


# --- parsers: (value, where it came from) -> the normalised value, or a ValueError naming the source

def _environment() -> dict:
    """The XPOOL_* variables that are set (blank ones count as unset)."""
    return {name: os.environ[var] for name, var in ENV.items() if os.environ.get(var, "").strip()}


def _bad(source: str, value, why: str) -> ValueError:
    return ValueError(f"{source}={value!r}: {why}")


def _choice(value, source: str, name: str, choices) -> str:
    """One of `choices`, given as text in any case."""
    s = value.strip().lower() if isinstance(value, str) else None
    if s not in choices:
        raise _bad(source, value, f"expected one of {', '.join(map(repr, choices))}")
    return s


def _scheme(value, source: str) -> str:
    return _choice(value, source, "scheme", SCHEMES)


def _whole(value, source: str, lo: int, hi: int, what: str, given=None) -> int:
    """An int (not a bool; NumPy integers too; text from a variable) in [lo, hi]; errors show `given` (the
    value as given, when `value` was parsed from it)."""
    given = value if given is None else given
    if isinstance(value, str):
        try:
            n = int(value.strip())
        except ValueError:
            raise _bad(source, given, f"expected a whole number of {what}") from None
    elif isinstance(value, bool):
        raise _bad(source, given, f"expected a whole number of {what}, not a bool")
    else:
        try:
            n = operator.index(value)
        except TypeError:
            raise _bad(source, given, f"expected a whole number of {what}, got {type(value).__name__}") from None
    if not lo <= n <= hi:
        raise _bad(source, given, f"expected {what} in [{lo}, {hi}]")
    return n


def _classes(value, source: str) -> int:
    return _whole(value, source, 1, MAX_CLASSES_PER_DOUBLING, "classes per doubling")


def _timeline(value, source: str) -> int:
    return _whole(value, source, 0, MAX_TIMELINE, "events")


def _bytes_text(text: str, source: str, percent: bool):
    """Bytes ("8GiB", "500MB", "1073741824", "1.5GiB": a whole number of bytes), or, when `percent`, a share
    ("50%") as a float. Returns an int or a float."""
    s = text.strip().lower()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*%", s)
    if m and percent:
        share = Fraction(m.group(1)) / 100
        if share > 1:
            raise _bad(source, text, "a share of the device must be between 0% and 100%")
        return float(share) if share else 0
    m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([a-z]*)", s)
    if not m or m.group(2) not in _UNITS:
        share = " or a share like '50%'" if percent else ""
        raise _bad(source, text, f"expected bytes like '8GiB', '500MB' or '1073741824'{share}")
    n = Fraction(m.group(1)) * _UNITS[m.group(2)]
    if n.denominator != 1:
        share = " (a share of the device is written '50%')" if percent and not m.group(2) else ""
        raise _bad(source, text, f"not a whole number of bytes{share}")
    return int(n)


def _limit(value, source: str):
    given = value
    if isinstance(value, str):
        value = _bytes_text(value, source, percent=True)
    if isinstance(value, float):
        if not 0 <= value <= 1:
            raise _bad(source, given, "a float is a share of each device's memory, in [0, 1]; give bytes "
                                      "as an int or as text like '8GiB'")
        return value if value else 0
    return _whole(value, source, 0, MAX_REQUEST, "bytes", given=given)


def _debug(value, source: str):
    if value is False or value is True:
        return "raise" if value else False
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return "raise" if value else False
    s = value.strip().lower() if isinstance(value, str) else None
    if s in DEBUG_MODES:
        return s
    if s in _ON:
        return "raise"
    if s in _OFF:
        return False
    raise _bad(source, value, "expected a debug mode: 'raise', 'warn', True or False (in the environment "
                              "also 1/on or 0/off)")


_PARSERS = {"scheme": _scheme, "classes_per_doubling": _classes, "limit": _limit, "debug": _debug,
            "timeline": _timeline}


def _shown(name: str, value) -> str:
    if name == "limit":
        if isinstance(value, float):
            return f"{value:.4g} of each device"
        return "none" if value == 0 else f"{value} B"
    return repr(value)


_core.Settings = Settings   # the class the C core trusts: it reads a resolved Settings and checks nothing again
