"""xpool.Settings: resolved in one place (argument, then XPOOL_* variable, then default), every field checked
there with an error naming where the value came from, and read by the C core."""
import dataclasses
import inspect

import numpy as np
import pytest

import xpool
from xpool import Pool, Settings
from xpool.settings import DEFAULTS, ENV
from xpool_twin import HostBackend, TwinBackend


KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for var in ENV.values():
        monkeypatch.delenv(var, raising=False)


def test_defaults_are_the_segments_scheme_with_nothing_on():
    s = Settings()
    assert (s.scheme, s.limit, s.debug, s.timeline) == ("segments", 0, False, 0)
    assert s.classes_per_doubling is None and s.source("classes_per_doubling") == "n/a"   # scheme seed's
    assert all(s.source(name) == "default" for name in ENV if name != "classes_per_doubling")


def test_repr_shows_what_applies_and_round_trips():
    s = Settings(scheme="seed", limit="8GiB")
    assert repr(s) == ("Settings(scheme='seed', classes_per_doubling=1, limit=8589934592, debug=False, "
                       "timeline=0)")
    assert eval(repr(s), {"Settings": Settings}) == s


def test_describe_lists_value_source_and_meaning(monkeypatch):
    monkeypatch.setenv("XPOOL_DEBUG", "warn")
    text = Settings(limit="50%").describe()
    lines = {line.split()[0]: line for line in text.splitlines()}
    assert set(lines) == set(ENV) - {"classes_per_doubling"}
    assert "0.5 of each device" in lines["limit"] and " limit " in lines["limit"]
    assert "'warn'" in lines["debug"] and "XPOOL_DEBUG" in lines["debug"]
    assert "'segments'" in lines["scheme"] and "default" in lines["scheme"] and "best fit" in lines["scheme"]
    assert "classes_per_doubling" in Settings(scheme="seed").describe()


def test_an_argument_beats_the_environment_which_beats_the_default(monkeypatch):
    monkeypatch.setenv("XPOOL_MEMORY_LIMIT", "1GiB")
    monkeypatch.setenv("XPOOL_TIMELINE", "100")
    s = Settings(limit="2GiB")
    assert (s.limit, s.source("limit")) == (2 * GiB, "limit")
    assert (s.timeline, s.source("timeline")) == (100, "XPOOL_TIMELINE")
    assert (s.debug, s.source("debug")) == (DEFAULTS["debug"], "default")


def test_a_blank_variable_counts_as_unset(monkeypatch):
    monkeypatch.setenv("XPOOL_SCHEME", "  ")
    monkeypatch.setenv("XPOOL_TIMELINE", "")
    assert Settings() == Settings(scheme="segments", timeline=0)


def test_replace_keeps_every_resolved_value_whatever_the_environment_says_later(monkeypatch):
    s = Settings(scheme="seed", classes_per_doubling=4, debug=False)
    monkeypatch.setenv("XPOOL_DEBUG", "raise")
    monkeypatch.setenv("XPOOL_MEMORY_LIMIT", "1GiB")
    t = dataclasses.replace(s, timeline=10)
    assert (t.scheme, t.classes_per_doubling, t.debug, t.limit, t.timeline) == ("seed", 4, False, 0, 10)


@pytest.mark.parametrize("value, expected", [
    ("8GiB", 8 * GiB), ("500MB", 500_000_000), ("1073741824", GiB), ("1.5GiB", 3 * GiB // 2), (" 2 MiB ", 2 * MiB),
    ("50%", 0.5), ("12.5%", 0.125), ("100%", 1.0), ("0%", 0), ("0", 0), (0, 0), (4096, 4096), (0.25, 0.25),
])
def test_limit_takes_bytes_or_a_share(value, expected):
    got = Settings(limit=value).limit
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize("value, why", [
    ("0.5", "not a whole number of bytes .a share of the device is written '50%'"),
    ("0.4B", "not a whole number of bytes"), ("lots", "expected bytes"), ("200%", "between 0% and 100%"),
    (-1, r"in \[0, "), (1.5, "a float is a share"), (True, "not a bool"), (2**49, r"in \[0, 281474976710656\]"),
    ([8], "got list"),
])
def test_a_bad_limit_is_refused_naming_the_argument(value, why):
    with pytest.raises(ValueError, match=rf"^limit={value!r}: ".replace("[", r"\[") + ".*" + why):
        Settings(limit=value)


@pytest.mark.parametrize("text", ["0.5", "0.4B", "8 gigs", "-3"])
def test_a_bad_limit_variable_is_refused_naming_the_variable(monkeypatch, text):
    monkeypatch.setenv("XPOOL_MEMORY_LIMIT", text)
    with pytest.raises(ValueError, match=f"^XPOOL_MEMORY_LIMIT='{text}': "):
        Pool(TwinBackend())


@pytest.mark.parametrize("text, mode", [("1", "raise"), ("on", "raise"), ("RAISE", "raise"), ("warn", "warn"),
                                        ("0", False), ("off", False), ("false", False)])
def test_debug_variable_values(monkeypatch, text, mode):
    monkeypatch.setenv("XPOOL_DEBUG", text)
    assert Settings().debug == mode
    assert Pool(TwinBackend()).settings.debug == mode


@pytest.mark.parametrize("text", ["2", "loud", "yes please"])
def test_a_bad_debug_variable_is_refused_naming_it(monkeypatch, text):
    monkeypatch.setenv("XPOOL_DEBUG", text)
    with pytest.raises(ValueError, match=f"^XPOOL_DEBUG='{text}': expected a debug mode"):
        Settings()


@pytest.mark.parametrize("name, value, why", [
    ("timeline", -5, r"in \[0, "), ("timeline", 2**63, r"in \[0, "), ("timeline", 1.0, "got float"),
    ("timeline", "many", "expected a whole number"), ("classes_per_doubling", 0, r"in \[1, 64\]"),
    ("classes_per_doubling", 65, r"in \[1, 64\]"), ("classes_per_doubling", True, "not a bool"),
    ("scheme", "arena", "expected one of 'segments', 'seed', 'expandable'"), ("scheme", 3, "expected one of"),
    ("debug", "loud", "expected a debug mode"), ("debug", 2, "expected a debug mode"),
])
def test_every_field_is_checked_naming_the_argument(name, value, why):
    fields = {name: value}
    if name == "classes_per_doubling":
        fields["scheme"] = "seed"
    with pytest.raises(ValueError, match=rf"^{name}=.*: .*{why}"):
        Settings(**fields)


@pytest.mark.parametrize("var, text", [("XPOOL_TIMELINE", "1e6"), ("XPOOL_TIMELINE", str(2**63)),
                                       ("XPOOL_SCHEME", "buddy"), ("XPOOL_MEMORY_LIMIT", "lots"),
                                       ("XPOOL_DEBUG", "loud")])
def test_every_variable_is_checked_naming_it(monkeypatch, var, text):
    monkeypatch.setenv(var, text)
    with pytest.raises(ValueError, match=f"^{var}='{text}': "):
        Settings()


def test_classes_per_doubling_needs_scheme_seed():
    with pytest.raises(ValueError, match=r"^classes_per_doubling=4 applies to scheme 'seed' only.*scheme='seed'"):
        Settings(classes_per_doubling=4)
    with pytest.raises(ValueError, match=r"^classes_per_doubling=2 applies to scheme 'seed' only.*'expandable'"):
        Settings(scheme="expandable", classes_per_doubling=2)
    s = Settings(scheme="seed", classes_per_doubling=4)
    assert (s.classes_per_doubling, s.source("classes_per_doubling")) == (4, "classes_per_doubling")


def test_the_seed_variable_follows_the_pools_scheme(monkeypatch):
    monkeypatch.setenv("XPOOL_CLASSES_PER_DOUBLING", "4")
    s = Settings(scheme="seed")
    assert (s.classes_per_doubling, s.source("classes_per_doubling")) == (4, "XPOOL_CLASSES_PER_DOUBLING")
    monkeypatch.setenv("XPOOL_SCHEME", "seed")
    assert Settings().classes_per_doubling == 4
    monkeypatch.setenv("XPOOL_SCHEME", "expandable")
    with pytest.raises(ValueError, match="^XPOOL_CLASSES_PER_DOUBLING='4' applies to scheme 'seed' only, and "
                                         "XPOOL_SCHEME is 'expandable'"):
        Settings()


def test_a_scheme_argument_overrides_the_seed_variables(monkeypatch):
    """XPOOL_SCHEME=seed with XPOOL_CLASSES_PER_DOUBLING, and a pool made with scheme='segments': the argument
    wins over the variables, and classes_per_doubling, scheme seed's, does not apply."""
    monkeypatch.setenv("XPOOL_SCHEME", "seed")
    monkeypatch.setenv("XPOOL_CLASSES_PER_DOUBLING", "4")
    s = Settings(scheme="segments")
    assert (s.scheme, s.classes_per_doubling, s.source("classes_per_doubling")) == ("segments", None, "n/a")


def test_the_seed_variable_alone_is_refused_not_dropped(monkeypatch):
    """XPOOL_CLASSES_PER_DOUBLING set while nothing names a scheme: the pool is scheme segments, so the variable
    would be dropped without a word; it is refused, naming the variable (as "given for another scheme it is an
    error", xpool/settings.py)."""
    monkeypatch.setenv("XPOOL_CLASSES_PER_DOUBLING", "4")
    with pytest.raises(ValueError, match="^XPOOL_CLASSES_PER_DOUBLING='4' applies to scheme 'seed' only"):
        Settings()


def test_numpy_integers_are_taken_as_ints():
    np = pytest.importorskip("numpy")
    s = Settings(scheme="seed", classes_per_doubling=np.int64(4), limit=np.int64(4096), timeline=np.int32(5))
    assert (s.classes_per_doubling, s.limit, s.timeline) == (4, 4096, 5)
    assert all(type(v) is int for v in (s.classes_per_doubling, s.limit, s.timeline))


def test_pool_takes_settings_or_keywords_or_both():
    base = Settings(scheme="seed", classes_per_doubling=2)
    assert Pool(TwinBackend(), base).settings is base
    pool = Pool(TwinBackend(), base, debug="warn")
    assert pool.settings == dataclasses.replace(base, debug="warn") and pool.settings.debug == "warn"
    assert Pool(TwinBackend(), scheme="seed").settings.scheme == "seed"
    assert xpool.MemoryPool(base, backend=TwinBackend()).settings.classes_per_doubling == 2


def test_install_and_use_take_a_settings_in_place_of_a_pool():
    pytest.importorskip("cupy")
    base = Settings(scheme="seed", classes_per_doubling=2)
    with xpool.use(base, backend=TwinBackend()) as pool:
        assert pool.settings is base and xpool.current() is pool
    with xpool.use(base, backend=TwinBackend(), debug="warn") as pool:
        assert pool.settings == dataclasses.replace(base, debug="warn")


def test_pool_refuses_a_positional_k_and_unknown_settings_by_name():
    with pytest.raises(TypeError, match=r"settings must be an xpool.Settings, got int 4"):
        Pool(TwinBackend(), 4)
    with pytest.raises(TypeError, match="Pool.. got no setting 'classes'; the settings are scheme, "):
        Pool(TwinBackend(), classes=4)
    with pytest.raises(TypeError, match="MemoryPool.. got no setting '_segments'"):
        xpool.MemoryPool(backend=TwinBackend(), _segments={})


def test_the_signatures_list_every_setting():
    for cls in (Pool, xpool.MemoryPool):
        params = inspect.signature(cls).parameters
        assert set(ENV) <= set(params) and params["settings"].default is None
        assert all(params[name].kind is inspect.Parameter.KEYWORD_ONLY for name in ENV)


def test_the_core_reads_scheme_k_limit_and_timeline():
    pool = Pool(TwinBackend(capacity=16 * MiB), scheme="seed", classes_per_doubling=4, limit="50%", timeline=100)
    assert pool._core.scheme == "seed" and pool._core.classes_per_doubling == 4
    assert pool.allocate(4 * MiB + 1).size == 5 * MiB       # k = 4: 5, 6, 7, 8 MiB between 4 and 8 MiB
    assert pool.get_limit(device=1) == 8 * MiB
    assert list(pool.timeline().event) == ["alloc_miss", "free"]
    assert pool._core.settings is pool.settings


def test_the_core_takes_only_a_settings():
    from xpool import _core
    from xpool.errors import make_error
    with pytest.raises(TypeError, match=r"settings must be an xpool.Settings .* got <class 'dict'>"):
        _core.Allocator(TwinBackend(), make_error, {"scheme": "seed"})


def test_a_timeline_too_large_for_the_host_says_so(monkeypatch):
    with pytest.raises(MemoryError, match=r"a timeline of \d+ events needs \d+ bytes"):
        Pool(TwinBackend(), timeline=1 << 40)
    monkeypatch.setenv("XPOOL_TIMELINE", str(1 << 40))
    with pytest.raises(MemoryError, match="needs"):
        Pool(TwinBackend())


def test_every_field_has_its_variable_default_help_and_parser():
    """What a new field must come with; the surface stays small: five settings, each with its variable."""
    from xpool import settings
    fields = [f.name for f in dataclasses.fields(Settings)]
    assert fields == list(ENV) == list(DEFAULTS) == list(settings.HELP) == list(settings._PARSERS)
    assert fields == ["scheme", "classes_per_doubling", "limit", "debug", "timeline"]
    assert all(var == "XPOOL_" + name.upper() for name, var in ENV.items() if name != "limit")
    assert ENV["limit"] == "XPOOL_MEMORY_LIMIT"
    assert settings.SCHEMES == ("segments", "seed", "expandable")


def test_a_front_ends_default_scheme_fills_only_what_nothing_else_set(monkeypatch):
    s = Settings(frontend="torch")
    assert (s.scheme, s.source("scheme")) == ("expandable", "default (torch)")
    assert Settings(frontend="torch", scheme="seed").scheme == "seed"
    monkeypatch.setenv("XPOOL_SCHEME", "segments")
    s = Settings(frontend="torch")
    assert (s.scheme, s.source("scheme")) == ("segments", "XPOOL_SCHEME")
    monkeypatch.delenv("XPOOL_SCHEME")
    kept = dataclasses.replace(Settings(frontend="torch"), debug="warn")   # resolved values carry over
    assert kept.scheme == "expandable" and kept.debug == "warn"
    with pytest.raises(ValueError, match="frontend must be None or one of 'torch', got 'cupy'"):
        Settings(frontend="cupy")
    with pytest.raises(TypeError):
        Settings("seed", None, 0, False, 0, "torch")                          # keyword only
    assert Settings("seed").scheme == "seed"                                 # positional fields as before


P = 1 << 16


def expandable(**kw):
    backend = TwinBackend(n_devices=1, granularity=P)
    return Pool(backend, scheme="expandable", **kw), backend


def test_keywords_over_a_settings_replace_those_fields_alone_and_say_so():
    base = Settings(limit="1GiB", debug="warn")
    for scheme in ("expandable", "seed", "segments"):
        pool = Pool(TwinBackend(), base, scheme=scheme)
        s = pool.settings
        assert (s.scheme, s.limit, s.debug) == (scheme, 1 << 30, "warn")
        assert (s.source("scheme"), s.source("limit"), s.source("debug")) == ("scheme", "limit", "debug")
        assert s.source("timeline") == "default"
    seed = Settings(scheme="seed", classes_per_doubling=4)
    assert Pool(TwinBackend(), seed, scheme="segments").settings.classes_per_doubling is None
    assert xpool.MemoryPool(base, backend=TwinBackend(), scheme="expandable").settings.scheme == "expandable"


@pytest.mark.parametrize("value", [[1], {}, {1}, bytearray(b"seed"), 3, 2.5])
def test_a_scheme_of_the_wrong_kind_names_the_argument(value):
    with pytest.raises(ValueError, match=r"^scheme=.*expected one of 'segments', 'seed', 'expandable'"):
        Settings(scheme=value)


@pytest.mark.usefixtures("seed_scheme")
@pytest.mark.parametrize("var, value", [("XPOOL_CLASSES_PER_DOUBLING", "four"),
                                        ("XPOOL_CLASSES_PER_DOUBLING", "0"),
                                        ("XPOOL_TIMELINE", "lots"), ("XPOOL_TIMELINE", "-3")])
def test_bad_environment_settings_name_the_variable(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=var):
        Pool(HostBackend())


@pytest.mark.usefixtures("seed_scheme")
def test_classes_per_doubling_takes_numpy_integers():
    pool = Pool(HostBackend(), classes_per_doubling=np.int64(4))
    assert pool.settings.classes_per_doubling == 4 and type(pool.settings.classes_per_doubling) is int
    assert pool.allocate(4 * MiB + 1).size == 5 * MiB
    assert xpool.sizeclass.size_class(4 * MiB + 1, np.int32(4)) == 5 * MiB


@pytest.mark.parametrize("value", ["bogus", "2", "maybe", "raise it"])
def test_a_bad_debug_setting_names_its_variable(value, monkeypatch):
    monkeypatch.setenv("XPOOL_DEBUG", value)
    with pytest.raises(ValueError, match="XPOOL_DEBUG"):
        Pool(HostBackend())
    monkeypatch.delenv("XPOOL_DEBUG")
    with pytest.raises(ValueError, match=r"\bdebug\b"):
        Pool(HostBackend(), debug=value)


def test_an_unknown_setting_is_named():
    with pytest.raises(TypeError, match="no_such_setting"):
        Pool(HostBackend(), no_such_setting=1)


@pytest.mark.parametrize("events", [1 << 60, 1 << 63, 1 << 64])
def test_a_timeline_too_large_names_its_argument(events, monkeypatch):
    with pytest.raises((ValueError, MemoryError), match="timeline"):
        Pool(HostBackend(), timeline=events)
    monkeypatch.setenv("XPOOL_TIMELINE", str(events))
    with pytest.raises((ValueError, MemoryError), match="XPOOL_TIMELINE"):
        Pool(HostBackend())
