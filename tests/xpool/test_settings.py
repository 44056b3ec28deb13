"""xpool.Settings: resolved in one place (argument, then XPOOL_* variable, then default), every field checked
there with an error naming where the value came from, and read by the C core."""
import dataclasses
import inspect

import pytest

import xpool
from xpool import Pool, Settings
from xpool_twin import TwinBackend
from xpool.settings import DEFAULTS, ENV

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    for var in ENV.values():
        monkeypatch.delenv(var, raising=False)


def test_defaults_are_the_segments_scheme_with_nothing_on():
    s = Settings()
    assert (s.scheme, s.limit, s.debug, s.timeline) == ("segments", 0, False, 0)
    assert (s.small_segment, s.segment_round, s.release_on_miss, s.release_idle) == (2 * MiB, 512, "high_water", 64)
    assert s.classes_per_doubling is None and s.source("classes_per_doubling") == "n/a"
    assert s.peer_access is None and s.source("peer_access") == "n/a"         # scheme expandable's
    assert all(s.source(name) == "default" for name in ENV if name not in ("classes_per_doubling", "peer_access"))


def test_repr_shows_what_applies_and_round_trips():
    s = Settings(scheme="seed", limit="8GiB")
    assert repr(s) == ("Settings(scheme='seed', classes_per_doubling=1, limit=8589934592, debug=False, "
                       "timeline=0)")
    assert eval(repr(s), {"Settings": Settings}) == s


def test_describe_lists_value_source_and_meaning(monkeypatch):
    monkeypatch.setenv("XPOOL_DEBUG", "warn")
    text = Settings(limit="50%").describe()
    lines = {line.split()[0]: line for line in text.splitlines()}
    assert set(lines) == set(ENV) - {"classes_per_doubling", "peer_access"}
    assert "0.5 of each device" in lines["limit"] and " limit " in lines["limit"]
    assert "'warn'" in lines["debug"] and "XPOOL_DEBUG" in lines["debug"]
    assert "default" in lines["small_segment"] and "2097152 B" in lines["small_segment"]


def test_an_argument_beats_the_environment_which_beats_the_default(monkeypatch):
    monkeypatch.setenv("XPOOL_MEMORY_LIMIT", "1GiB")
    monkeypatch.setenv("XPOOL_TIMELINE", "100")
    s = Settings(limit="2GiB")
    assert (s.limit, s.source("limit")) == (2 * GiB, "limit")
    assert (s.timeline, s.source("timeline")) == (100, "XPOOL_TIMELINE")
    assert (s.release_idle, s.source("release_idle")) == (DEFAULTS["release_idle"], "default")


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
    assert Pool(TwinBackend()).settings.debug == (mode or None)


@pytest.mark.parametrize("text", ["2", "loud", "yes please"])
def test_a_bad_debug_variable_is_refused_naming_it(monkeypatch, text):
    monkeypatch.setenv("XPOOL_DEBUG", text)
    with pytest.raises(ValueError, match=f"^XPOOL_DEBUG='{text}': expected a debug mode"):
        Settings()


@pytest.mark.parametrize("name, value, why", [
    ("small_segment", 1000, "multiple of 512"), ("small_segment", 0, r"in \[512, "), ("small_segment", "1.25KiB",
                                                                                       "multiple of 512"),
    ("segment_round", -512, r"in \[512, "), ("segment_round", "big", "expected bytes"),
    ("segment_round", 512.0, "got float"),
    ("release_on_miss", 1, "expected one of 'never', 'high_water', 'always', 'bounded', 'growth'"),
    ("release_on_miss", "sometimes", "expected one of"), ("release_idle", -1, r"in \[0, "),
    ("release_idle", "64", "got str"), ("timeline", -5, r"in \[0, "), ("timeline", 2**63, r"in \[0, "),
    ("timeline", 1.0, "got float"), ("classes_per_doubling", 0, r"in \[1, 64\]"), ("scheme", "arena", "expected one of"),
    ("release_bound", 0.99, "from 1 to 1e6"), ("release_bound", "lots", "from 1 to 1e6"),
    ("release_bound", True, "from 1 to 1e6"), ("release_bound", float("nan"), "from 1 to 1e6"),
    ("peer_access", "some", "expected one of 'all', 'none'"), ("peer_access", True, "expected one of 'all', 'none'"),
])
def test_every_field_is_checked_naming_the_argument(name, value, why):
    fields = {name: value}
    if name == "classes_per_doubling":
        fields["scheme"] = "seed"
    if name == "peer_access":
        fields["scheme"] = "expandable"
    if name == "release_idle" and isinstance(value, str):
        why = "expected a whole number"             # an argument's text is read as a number, as a variable's
        fields[name] = "sixty-four"
    with pytest.raises(ValueError, match=rf"^{name}=.*: .*{why}"):
        Settings(**fields)


@pytest.mark.parametrize("var, text", [("XPOOL_SMALL_SEGMENT", "1000"), ("XPOOL_SEGMENT_ROUND", "0"),
                                       ("XPOOL_RELEASE_ON_MISS", "2"), ("XPOOL_RELEASE_IDLE", "-1"),
                                       ("XPOOL_TIMELINE", "1e6"), ("XPOOL_TIMELINE", str(2**63)),
                                       ("XPOOL_SCHEME", "buddy"), ("XPOOL_RELEASE_BOUND", "0.5"),
                                       ("XPOOL_RELEASE_BOUND", "1.05x")])
def test_every_variable_is_checked_naming_it(monkeypatch, var, text):
    monkeypatch.setenv(var, text)
    with pytest.raises(ValueError, match=f"^{var}='{text}': "):
        Settings()


def test_segment_tunables_take_byte_text(monkeypatch):
    assert Settings(small_segment="4MiB", segment_round="1MiB").small_segment == 4 * MiB
    monkeypatch.setenv("XPOOL_SMALL_SEGMENT", "3KiB")
    monkeypatch.setenv("XPOOL_RELEASE_ON_MISS", "never")
    s = Settings()
    assert (s.small_segment, s.release_on_miss) == (3 * KiB, "never")


def test_the_release_bound_takes_numbers_and_text(monkeypatch):
    assert Settings(release_bound=2).release_bound == 2.0 and Settings().release_bound == 1.05
    monkeypatch.setenv("XPOOL_RELEASE_BOUND", " 1.2 ")
    monkeypatch.setenv("XPOOL_RELEASE_ON_MISS", "bounded")
    s = Settings(scheme="expandable")
    assert (s.release_on_miss, s.release_bound, s.source("release_bound")) == ("bounded", 1.2, "XPOOL_RELEASE_BOUND")
    with pytest.raises(ValueError, match="^release_bound=1.1 applies to schemes 'segments' and 'expandable' only"):
        Settings(scheme="seed", release_bound=1.1)


def test_the_old_scheme_name_is_an_alias(monkeypatch):
    assert Settings(scheme="xpool").scheme == "segments"
    monkeypatch.setenv("XPOOL_SCHEME", "xpool")
    assert Settings().scheme == "segments"


def test_a_schemes_own_fields_need_that_scheme():
    with pytest.raises(ValueError, match=r"^classes_per_doubling=4 applies to scheme 'seed' only.*scheme='seed'"):
        Settings(classes_per_doubling=4)
    with pytest.raises(ValueError, match="^small_segment=4096 applies to scheme 'segments' only"):
        Settings(scheme="seed", small_segment=4096)
    s = Settings(scheme="seed", classes_per_doubling=4)
    assert (s.small_segment, s.release_on_miss) == (None, None)


def test_a_schemes_variable_needs_xpool_scheme_to_name_that_scheme(monkeypatch):
    monkeypatch.setenv("XPOOL_CLASSES_PER_DOUBLING", "4")
    with pytest.raises(ValueError, match="^XPOOL_CLASSES_PER_DOUBLING='4' applies to scheme 'seed' only.*"
                                         "set XPOOL_SCHEME=seed"):
        Settings(scheme="seed")
    monkeypatch.setenv("XPOOL_SCHEME", "seed")
    assert Settings().classes_per_doubling == 4
    assert Settings(scheme="segments").source("classes_per_doubling") == "n/a"   # an argument overrides
    monkeypatch.setenv("XPOOL_RELEASE_IDLE", "10")
    with pytest.raises(ValueError, match="^XPOOL_RELEASE_IDLE='10' applies to schemes 'segments' and 'expandable' "
                                         "only.*set XPOOL_SCHEME=segments"):
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
    with pytest.raises(TypeError, match=r"settings must be an xpool.Settings, got int 4 .classes_per_doubling is a "
                                        r"keyword now: Pool\(..., scheme='seed', classes_per_doubling=4\)"):
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


def test_the_core_reads_the_segments_tunables():
    backend = TwinBackend()
    pool = Pool(backend, small_segment="4MiB", segment_round="1MiB")
    pool.allocate(4096)
    assert backend.used(0) == 4 * MiB                    # a small block's segment
    pool.allocate(11 * MiB // 2)
    assert backend.used(0) == 10 * MiB                   # 5.5 MiB: no free range fits; rounded up to 6 MiB


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


def test_a_timeline_too_large_for_the_host_says_so():
    with pytest.raises(MemoryError, match=r"a timeline of \d+ events needs \d+ bytes"):
        Pool(TwinBackend(), timeline=1 << 40)
    pool = Pool(TwinBackend())
    with pytest.raises(ValueError, match="capacity"):
        pool.enable_timeline(2**63)
    with pytest.raises(MemoryError, match="needs"):
        pool.enable_timeline(1 << 40)


def test_every_field_has_its_variable_default_help_and_parser():
    """What a new field (or a new scheme's) must come with."""
    from xpool import settings
    fields = [f.name for f in dataclasses.fields(Settings)]
    assert fields == list(ENV) == list(DEFAULTS) == list(settings.HELP) == list(settings._PARSERS)
    owned = [name for names in settings.SCHEME_FIELDS.values() for name in names]
    assert set(settings.SCHEME_FIELDS) == set(settings.SCHEMES) and set(owned) <= set(fields)
    assert all(len(names) == len(set(names)) for names in settings.SCHEME_FIELDS.values())


def test_a_front_ends_defaults_fill_only_what_nothing_else_set(monkeypatch):
    s = Settings(frontend="torch")
    assert (s.scheme, s.release_on_miss, s.small_segment) == ("expandable", "peak", None)
    assert s.source("scheme") == "default (torch)" and s.source("release_on_miss") == "default (torch)"
    assert Settings(frontend="torch", scheme="seed").scheme == "seed"
    assert Settings(frontend="torch", release_on_miss="never").release_on_miss == "never"
    monkeypatch.setenv("XPOOL_SCHEME", "segments")
    s = Settings(frontend="torch")             # the front end's release rule is its scheme's: segments keeps its own
    assert (s.source("scheme"), s.release_on_miss, s.source("release_on_miss")) == ("XPOOL_SCHEME", "high_water",
                                                                                  "default")
    monkeypatch.setenv("XPOOL_SCHEME", "expandable")
    assert Settings(frontend="torch").release_on_miss == "peak"
    monkeypatch.setenv("XPOOL_RELEASE_ON_MISS", "bounded")
    assert Settings(frontend="torch").source("release_on_miss") == "XPOOL_RELEASE_ON_MISS"
    monkeypatch.delenv("XPOOL_SCHEME")
    monkeypatch.delenv("XPOOL_RELEASE_ON_MISS")
    kept = dataclasses.replace(Settings(frontend="torch"), debug="warn")   # resolved values carry over
    assert kept.scheme == "expandable" and kept.debug == "warn"
    with pytest.raises(ValueError, match="frontend must be None or one of 'torch', got 'cupy'"):
        Settings(frontend="cupy")
    with pytest.raises(TypeError):
        Settings("seed", None, 0, False, 0, None, None, None, None, None, None, "torch")   # keyword only
    assert Settings("seed").scheme == "seed"                                     # positional fields as before


def test_until_churn_is_the_expandable_schemes_only_and_says_so(monkeypatch):
    """release_on_miss "until_churn" watches which pages a miss maps: scheme expandable only, a clear error naming
    where the value came from otherwise."""
    assert Settings(scheme="expandable", release_on_miss="until_churn").release_on_miss == "until_churn"
    with pytest.raises(ValueError, match=r"release_on_miss='until_churn' needs scheme 'expandable'.*'segments'"):
        Settings(scheme="segments", release_on_miss="until_churn")
    monkeypatch.setenv("XPOOL_RELEASE_ON_MISS", "until_churn")
    with pytest.raises(ValueError, match=r"XPOOL_RELEASE_ON_MISS='until_churn' needs scheme 'expandable'"):
        Settings()
    monkeypatch.setenv("XPOOL_SCHEME", "expandable")
    assert Settings().release_on_miss == "until_churn"


def test_peer_access_is_the_expandable_schemes_and_every_peer_by_default(monkeypatch):
    """peer_access: which other devices a map makes the pool's pages reachable from (scheme expandable only):
    "all" by default, the pool enable_torch() makes included; "none" from the argument or XPOOL_PEER_ACCESS."""
    s = Settings(scheme="expandable")
    assert (s.peer_access, s.source("peer_access")) == ("all", "default")
    assert Settings(frontend="torch").peer_access == "all"
    assert Settings(scheme="expandable", peer_access=" None ").peer_access == "none"
    assert "peer_access" in s.describe() and "'all'" in s.describe()
    with pytest.raises(ValueError, match="^peer_access='none' applies to scheme 'expandable' only"):
        Settings(peer_access="none")
    monkeypatch.setenv("XPOOL_SCHEME", "expandable")
    monkeypatch.setenv("XPOOL_PEER_ACCESS", "none")
    assert (Settings().peer_access, Settings().source("peer_access")) == ("none", "XPOOL_PEER_ACCESS")
    monkeypatch.setenv("XPOOL_PEER_ACCESS", "some")
    with pytest.raises(ValueError, match="^XPOOL_PEER_ACCESS='some': expected one of 'all', 'none'"):
        Settings()
    monkeypatch.setenv("XPOOL_SCHEME", "segments")
    monkeypatch.setenv("XPOOL_PEER_ACCESS", "all")
    with pytest.raises(ValueError, match="^XPOOL_PEER_ACCESS='all' applies to scheme 'expandable' only"):
        Settings()
