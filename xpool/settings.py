"""Settings: every choice a pool makes, in one typed, frozen object, resolved in one place.

    s = xpool.Settings(scheme="seed", limit="8GiB")     # or xpool.Pool(backend, scheme="seed", limit="8GiB")
    print(s.describe())                                # each value, where it came from, what it does

Each field comes from the argument when one is given, else from its ``XPOOL_*`` environment variable
(``ENV``), else from its default (``DEFAULTS``). Every value is checked here, once; a bad one raises a
``ValueError`` that names the argument or the variable it came from, e.g.
``ValueError: XPOOL_MEMORY_LIMIT='0.4B': not a whole number of bytes``. The C core reads the resolved object.

Some fields belong to some schemes only (``SCHEME_FIELDS``): given for another scheme they are an error, and
they are None in a resolved Settings of another scheme. The environment is one configuration: a scheme's variable
(``XPOOL_CLASSES_PER_DOUBLING``) without ``XPOOL_SCHEME`` naming a scheme it applies to is an error; a scheme given
as an argument overrides ``XPOOL_SCHEME``, and the other schemes' variables then do not apply.
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
from .sizeclass import ALIGN, MAX_CLASSES_PER_DOUBLING, MAX_REQUEST

SCHEMES = ("segments", "seed", "expandable")   # how blocks are made (README: the table of schemes)
SCHEME_ALIASES = {"xpool": "segments"}      # the default scheme's old name: XPOOL_SCHEME=xpool keeps working
RELEASE_ON_MISS = ("never", "high_water", "always", "bounded", "growth", "until_churn", "peak")
DEBUG_MODES = ("raise", "warn")
PEER_ACCESS = ("all", "none")
# The fields that apply to some schemes only (the release rule is the segments' and the expandable scheme's).
SCHEME_FIELDS = {
    "seed": ("classes_per_doubling",),
    "segments": ("small_segment", "segment_round", "release_on_miss", "release_idle", "release_bound"),
    "expandable": ("release_on_miss", "release_idle", "release_bound", "peer_access"),
}
ENV = {
    "scheme": "XPOOL_SCHEME",
    "classes_per_doubling": "XPOOL_CLASSES_PER_DOUBLING",
    "limit": "XPOOL_MEMORY_LIMIT",
    "debug": "XPOOL_DEBUG",
    "timeline": "XPOOL_TIMELINE",
    "small_segment": "XPOOL_SMALL_SEGMENT",
    "segment_round": "XPOOL_SEGMENT_ROUND",
    "release_on_miss": "XPOOL_RELEASE_ON_MISS",
    "release_idle": "XPOOL_RELEASE_IDLE",
    "release_bound": "XPOOL_RELEASE_BOUND",
    "peer_access": "XPOOL_PEER_ACCESS",
}
DEFAULTS = {
    "scheme": "segments",
    "classes_per_doubling": 1,
    "limit": 0,
    "debug": False,
    "timeline": 0,
    # Note [Small segments]: blocks up to 1 MiB share 2 MiB segments; larger ones get a segment of their size
    "small_segment": 2 << 20,
    "segment_round": ALIGN,
    "release_on_miss": "high_water",   # Note [Release on miss]
    "release_idle": 64,
    "release_bound": 1.05,             # "bounded", "growth", "until_churn", "peak": Note [Release on miss: expandable]
    # expandable: pages are mapped for every device that can reach them, as cudaMalloc's memory is reachable from
    # every peer once peer access is on (Note [Expandable segments]: peer access)
    "peer_access": "all",
}
# A scheme's own defaults where it differs from DEFAULTS.  Expandable: a miss unmaps nothing, as PyTorch's
# expandable segments ("bounded" churns on fixed shapes: Note [Release on miss: expandable])
SCHEME_DEFAULTS = {"expandable": {"release_on_miss": "never"}}
# A front end's own defaults where it differs from DEFAULTS: the pool xpool.enable_torch() makes is scheme expandable,
# which held the least of every allocator on the lab's four PyTorch workloads, below PyTorch's expandable segments
# (Note [The default scheme per front end]), with release_on_miss "peak": a miss gives back only at the program's
# peak demand (within release_bound of its most), where its peak reserved is decided, and never below it, where a
# loop's layout drifts, so a fixed-shape loop makes no device call once warm; "growth" (only a miss past the most)
# held 1.116 on two of five realizations of the PyTorch model at varying lengths, "peak" 1.049 on all five
# (Note [Release on miss: peak]).  CuPy's pool (install(), MemoryPool()) keeps DEFAULTS' segments.  A front end's
# fields besides its scheme apply to that scheme only: XPOOL_SCHEME=segments under enable_torch() gets segments' own
# defaults.
FRONTEND_DEFAULTS = {"torch": {"scheme": "expandable", "release_on_miss": "peak"}}
HELP = {
    "scheme": "how blocks are made: 'segments' (best fit in segments), 'seed' (size classes) or 'expandable' "
              "(best fit in pages mapped into reserved address ranges)",
    "classes_per_doubling": "seed: size classes per doubling above 1 MiB (1: powers of two)",
    "limit": "bytes each device may hold for the pool (0: none), or a share of each device",
    "debug": "debug mode: poison freed blocks, canary after each block ('raise', 'warn' or False)",
    "timeline": "allocation events kept (0: off)",
    "small_segment": "segments: bytes of a segment made for a block up to 1 MiB (shared by later ones)",
    "segment_round": "segments: a larger block's segment is rounded up to this",
    "release_on_miss": "segments, expandable: what a miss gives back first ('never', 'high_water', 'always', "
                       "'bounded', 'growth', 'peak', 'until_churn': expandable only)",
    "release_idle": "segments, expandable, high_water: requests a whole free segment (expandable: free pages) must "
                    "stay idle before it may go back",
    "release_bound": "segments, expandable, bounded, growth, until_churn and peak: a miss gives back idle memory "
                     "over this many times the most bytes ever requested",
    "peer_access": "expandable: which other devices may read and write the pool's pages: 'all' (every device "
                   "that can access the pool's device) or 'none' (its own device only)",
}
MAX_TIMELINE = 1 << 40                      # events (64 B each): past any host's memory
MAX_RELEASE_IDLE = 1 << 62
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4,
          "tb": 1000**4, "tib": 1024**4}
_OFF = ("0", "", "off", "false", "no")
_ON = ("1", "on", "true", "yes")


@dataclass(frozen=True, repr=False)
class Settings:
    """Everything a pool is configured with, resolved and checked.

    Fields left None are resolved: the ``XPOOL_*`` variable of ``ENV``, else ``DEFAULTS``. A resolved
    Settings holds normalised values (``limit="8GiB"`` becomes 8589934592), so
    ``dataclasses.replace(s, debug="warn")`` resolves to the same pool but in debug mode.

    Attributes:
        scheme (str): how blocks are made (``XPOOL_SCHEME``): ``"segments"`` (the default; ``"xpool"`` is
            its old name; ``"expandable"`` is the default of the pool ``xpool.enable_torch()`` makes): best
            fit in segments of one device allocation each, split and merged;
            ``"seed"``: the design's size classes, one device allocation per block; ``"expandable"``: best fit
            in pages of the device's granularity mapped into one reserved address range per stream as the pool
            grows (CUDA's virtual memory; needs a backend with ``vmm()``; no CUDA IPC of its blocks). See the
            README's table.
        classes_per_doubling (int): scheme seed: classes between p and 2p above 1 MiB, 1 to 64
            (``XPOOL_CLASSES_PER_DOUBLING``; default 1, powers of two).
        limit (int or float): bytes each device may hold for the pool, in use, cached and in flight
            (``XPOOL_MEMORY_LIMIT``): an int (0: no limit), a float in (0, 1] (that share of each
            device's memory), or text: ``"8GiB"``, ``"500MB"``, ``"1073741824"``, ``"50%"``.
        debug (str or bool): ``"raise"``, ``"warn"`` or False (``XPOOL_DEBUG``: also ``1``/``on``, ``0``/
            ``off``); True means ``"raise"``. See ``xpool.debug``.
        timeline (int): allocation events kept in a ring (``XPOOL_TIMELINE``; 0: off).
        small_segment (int or str): scheme segments: bytes of the segment a block up to 1 MiB starts, which
            later small blocks share (``XPOOL_SMALL_SEGMENT``; default 2 MiB; a positive multiple of 512).
        segment_round (int or str): scheme segments: a larger block's segment is its size rounded up to
            this (``XPOOL_SEGMENT_ROUND``; default 512 B).
        release_on_miss (str): schemes segments and expandable: what a miss gives back first
            (``XPOOL_RELEASE_ON_MISS``): ``"high_water"`` (scheme segments' default) just enough idle whole
            free segments (expandable: whole free pages) of its stream to stay at the pool's high-water mark;
            ``"never"`` (scheme expandable's default: pages go back on ``empty_cache``/``trim`` and out of
            memory only); ``"always"`` every whole free segment (page) of its stream; ``"bounded"`` just enough
            whole free segments (pages) of its stream, however recently freed, to keep the pool within
            ``release_bound`` of the most bytes ever requested (less memory for shapes that keep changing, but
            device calls every step on some fixed-shape programs: Note [Release on miss: expandable]);
            ``"growth"`` as ``"bounded"``, but only on a miss that takes the bytes requested past their most ever,
            so once a program's largest demand has been seen its misses only map (Note [Release on miss:
            growth]); ``"until_churn"`` (scheme expandable only) as ``"bounded"`` until a miss maps pages that
            a miss unmapped since the demand last rose, then as ``"growth"`` until it rises again (Note [Release
            on miss: until_churn]); ``"peak"`` (the default of the pool ``xpool.enable_torch()`` makes) as
            ``"bounded"``, but only on a miss that brings the bytes requested within ``release_bound`` of their
            most ever, or past it: at the program's peak, never below it, where a loop's layout drifts; on
            scheme expandable only until a miss maps pages a miss unmapped at that peak (churn at a peak that
            recurs), then as ``"growth"`` until the demand passes it (Note [Release on miss: peak]).
        release_idle (int): schemes segments and expandable with ``"high_water"``: requests a whole free
            segment (a free block's pages) must have stayed free and unchanged before a miss may give it back
            (``XPOOL_RELEASE_IDLE``; default 64).
        release_bound (float): schemes segments and expandable with ``"bounded"``, ``"growth"``,
            ``"until_churn"`` or ``"peak"``: a miss that would take the pool above this many times the most bytes
            ever requested (by the pool's users, this request included) gives back idle memory first
            (``XPOOL_RELEASE_BOUND``; default 1.05; at least 1).
        peer_access (str): scheme expandable: which other devices' kernels and copies may reach the pool's
            pages (``XPOOL_PEER_ACCESS``): ``"all"`` (the default) every device that can access the pool's
            device (CUDA's ``cuDeviceCanAccessPeer``), so a copy to another GPU (``tensor.to("cuda:1")``) or a
            kernel reading another GPU's array works as with ``cudaMalloc``'s memory; ``"none"`` its own
            device only (a map sets access for one device; a peer's access then faults). Note [Expandable
            segments]: peer access.

    Args:
        frontend (str or None): whose defaults fill the fields left None: None, xpool's (``DEFAULTS``), or
            ``"torch"``, those of the pool ``xpool.enable_torch()`` makes (``FRONTEND_DEFAULTS``); a field's
            source then says ``"default (torch)"``.

    Raises:
        ValueError: a bad value, naming the argument or variable it came from.
    """

    scheme: str | None = None
    classes_per_doubling: int | None = None
    limit: int | float | str | None = None
    debug: str | bool | None = None
    timeline: int | None = None
    small_segment: int | str | None = None
    segment_round: int | str | None = None
    release_on_miss: str | None = None
    release_idle: int | None = None
    release_bound: float | None = None
    peer_access: str | None = None
    _: dataclasses.KW_ONLY
    frontend: dataclasses.InitVar[str | None] = None

    def __post_init__(self, frontend):
        if frontend is not None and frontend not in FRONTEND_DEFAULTS:
            raise ValueError(f"frontend must be None or one of {', '.join(map(repr, FRONTEND_DEFAULTS))}, "
                             f"got {frontend!r}")
        own = FRONTEND_DEFAULTS.get(frontend, {})
        own_scheme = own.get("scheme")          # a front end's other fields are that scheme's defaults only
        env = _environment()
        env_scheme = _scheme(env["scheme"], ENV["scheme"]) if "scheme" in env else own_scheme or DEFAULTS["scheme"]
        for name in env:
            owners = _owners(name)
            if owners and env_scheme not in owners:
                scheme = (f"{ENV['scheme']} is {env_scheme!r}" if "scheme" in env else
                          f"{ENV['scheme']} is unset (the default{f' of {frontend}' if own else ''}: {env_scheme!r})")
                raise ValueError(f"{ENV[name]}={env[name]!r} applies to {_schemes(owners)} only, and {scheme}: "
                                 f"set {ENV['scheme']}={owners[0]} with it")
        resolved, sources = {}, {}
        for name in ENV:
            given = getattr(self, name)
            owners = _owners(name)
            if owners and resolved["scheme"] not in owners:
                if given is not None:
                    raise ValueError(f"{name}={given!r} applies to {_schemes(owners)} only, and this pool's "
                                     f"scheme is {resolved['scheme']!r}: give scheme={owners[0]!r} with it")
                resolved[name], sources[name] = None, "n/a"
                continue
            if given is not None:
                value, source = given, name
            elif name in env:   # a scheme's variable comes with XPOOL_SCHEME naming it (checked above)
                value, source = env[name], ENV[name]
            elif name in own and (name == "scheme" or own_scheme in (None, resolved["scheme"])):
                value, source = own[name], f"default ({frontend})"
            else:
                value, source = SCHEME_DEFAULTS.get(resolved.get("scheme"), {}).get(name, DEFAULTS[name]), "default"
            resolved[name], sources[name] = _PARSERS[name](value, source), source
        if resolved["release_on_miss"] == "until_churn" and resolved["scheme"] != "expandable":
            raise ValueError(f"{sources['release_on_miss']}='until_churn' needs scheme 'expandable' (it watches "
                             f"which pages a miss maps), and this pool's scheme is {resolved['scheme']!r}")
        for name, value in resolved.items():
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_sources", sources)   # field -> argument, variable, "default" or "n/a"

    def __repr__(self):
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in ENV if self._sources[name] != "n/a")
        return f"Settings({shown})"

    def source(self, name: str) -> str:
        """Where a field's value came from.

        Args:
            name: a field name.

        Returns:
            str: the argument's name, the ``XPOOL_*`` variable, ``"default"`` (``"default (torch)"``: the
            front end's, ``FRONTEND_DEFAULTS``), or ``"n/a"`` (another scheme's field).
        """
        if name not in ENV:
            raise ValueError(f"name must be one of {', '.join(ENV)}, got {name!r}")
        return self._sources[name]

    def describe(self) -> str:
        """The settings as a table: each field, its value, where it came from, what it does.

        Returns:
            str: one line per field that applies to this scheme.
        """
        rows = [(name, _shown(name, getattr(self, name)), self._sources[name], HELP[name])
                for name in ENV if self._sources[name] != "n/a"]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        return "\n".join(f"{n:<{widths[0]}}  {v:<{widths[1]}}  {s:<{widths[2]}}  {h}" for n, v, s, h in rows)


def resolve(settings: Settings | None, fields: dict, who: str = "Pool") -> Settings:
    """The Settings a pool is made with: ``settings`` with ``fields`` (keyword settings) over it.

    Args:
        settings: a Settings, or None.
        fields: field values given as keywords (they override those of ``settings``).
        who: the caller, for an error.

    Returns:
        Settings: resolved.

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
        hint = (f" (classes_per_doubling is a keyword now: {who}(..., scheme='seed', classes_per_doubling="
                f"{settings!r}))" if isinstance(settings, numbers.Integral) else "")
        raise TypeError(f"settings must be an xpool.Settings, got {type(settings).__name__} {settings!r}{hint}")
    return dataclasses.replace(settings, **fields) if fields else settings


# --- parsers: (value, where it came from) -> the normalised value, or a ValueError naming the source

def _environment() -> dict:
    """The XPOOL_* variables that are set (blank ones count as unset)."""
    return {name: os.environ[var] for name, var in ENV.items() if os.environ.get(var, "").strip()}


def _owners(name: str) -> tuple:
    """The schemes a field applies to; () for a field of every scheme."""
    return tuple(scheme for scheme, names in SCHEME_FIELDS.items() if name in names)


def _schemes(owners: tuple) -> str:
    return f"scheme {owners[0]!r}" if len(owners) == 1 else f"schemes {' and '.join(map(repr, owners))}"


def _bad(source: str, value, why: str) -> ValueError:
    return ValueError(f"{source}={value!r}: {why}")


def _scheme(value, source: str) -> str:
    s = value.strip().lower() if isinstance(value, str) else value
    s = SCHEME_ALIASES.get(s, s)
    if s not in SCHEMES:
        raise _bad(source, value, f"expected one of {', '.join(map(repr, SCHEMES))} "
                                  f"({', '.join(f'{a!r} is {b!r}' for a, b in SCHEME_ALIASES.items())})")
    return s


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


def _idle(value, source: str) -> int:
    return _whole(value, source, 0, MAX_RELEASE_IDLE, "requests")


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


def _segment_bytes(value, source: str) -> int:
    n = _bytes_text(value, source, percent=False) if isinstance(value, str) else value
    n = _whole(n, source, ALIGN, MAX_REQUEST, "bytes", given=value)
    if n % ALIGN:
        raise _bad(source, value, f"expected a multiple of {ALIGN} bytes")
    return n


def _release(value, source: str) -> str:
    s = value.strip().lower() if isinstance(value, str) else value
    if s not in RELEASE_ON_MISS:
        raise _bad(source, value, f"expected one of {', '.join(map(repr, RELEASE_ON_MISS))}")
    return s


def _bound(value, source: str) -> float:
    try:
        f = float(value.strip()) if isinstance(value, str) else value
    except ValueError:
        f = None
    if isinstance(f, bool) or not isinstance(f, numbers.Real) or not (1.0 <= f <= 1e6):
        raise _bad(source, value, "expected a number from 1 to 1e6 (times the most bytes ever requested)")
    return float(f)


def _peer_access(value, source: str) -> str:
    s = value.strip().lower() if isinstance(value, str) else value
    if s not in PEER_ACCESS:
        raise _bad(source, value, f"expected one of {', '.join(map(repr, PEER_ACCESS))}")
    return s


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
            "timeline": _timeline, "small_segment": _segment_bytes, "segment_round": _segment_bytes,
            "release_on_miss": _release, "release_idle": _idle, "release_bound": _bound,
            "peer_access": _peer_access}


def check_timeline(capacity, name: str = "capacity") -> int:
    """Events a timeline keeps, as enable_timeline takes them; a ValueError naming ``name``."""
    return _timeline(capacity, name)


def parse_debug(mode, name: str = "mode"):
    """A debug mode as set_debug takes it: ``"raise"``, ``"warn"``, or False (off); a ValueError naming ``name``."""
    return False if mode is None else _debug(mode, name)


def _shown(name: str, value) -> str:
    if name == "limit":
        if isinstance(value, float):
            return f"{value:.4g} of each device"
        return "none" if value == 0 else f"{value} B"
    if name in ("small_segment", "segment_round"):
        return f"{value} B"
    return repr(value)


_core.Settings = Settings   # the class the C core trusts: it reads a resolved Settings and checks nothing again
