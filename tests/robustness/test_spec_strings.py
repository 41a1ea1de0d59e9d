"""Generated spec strings and JSON specs: each either resolves to a CacheSpec whose string and JSON forms give
the same spec back, or is refused with a one-line KvsqueezeError.  Nothing else (no bare ValueError, no
TypeError, no traceback) may come out of ``kvsqueeze.resolve_kv``."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvsqueeze.errors import KvsqueezeError
from kvsqueeze.resolve import resolve_kv
from kvsqueeze.spec import PRESETS, CacheSpec

from ._counts import record

SPEC_STRINGS = 1600  # valid-looking strings
GARBAGE_STRINGS = 500  # anything at all
JSON_SPECS = 400

_digits = st.integers(0, 9).map(str)
_group = st.one_of(st.just(""), st.integers(0, 300).map(str), st.sampled_from(["0", "007", "99999999999999999999"]))
_bits = st.one_of(_digits, st.sampled_from(["2.5", "2.875", "3.0", "1.5", "9.99", "0.0"]))
_side = st.one_of(
    st.tuples(_digits, st.sampled_from("tcx"), _group).map("".join),
    st.tuples(_bits, st.sampled_from(["r", "rq", "rc", "q"]), _group.map(lambda g: f"c{g}" if g else "")).map(
        "".join),
)
_suffix = st.lists(st.tuples(st.sampled_from(["-w", "-s", "-x", "w", "-"]), _group).map("".join), max_size=3).map(
    "".join)
_good_side = st.one_of(
    st.tuples(st.sampled_from("12345678"), st.just("t"), st.sampled_from(["", "16", "32", "64", "128"])).map("".join),
    st.tuples(st.sampled_from("12345678"), st.just("c"), st.sampled_from(["16", "32", "64", "128"])).map("".join),
    st.tuples(st.sampled_from(["2", "3", "4", "2.5", "2.875", "3.5"]), st.sampled_from(["r", "rq"])).map("".join),
    st.sampled_from(["2.875rc128", "3rc64", "4rc32"]),
)
_good = st.tuples(st.just("k"), _good_side, st.just("-v"), _good_side,
                  st.sampled_from(["", "-w0", "-w32", "-w128", "-w4096"]),
                  st.sampled_from(["", "-s0", "-s4", "-s17"])).map("".join)
_mangled = st.tuples(st.sampled_from(["k", "K", "", "kk"]), _side, st.sampled_from(["-v", "v", "-V", "--v"]),
                       _side, _suffix, st.sampled_from(["", "", "", "\n", " ", "\x00", "é"])).map("".join)
_spec_like = st.one_of(_good, _mangled, _good.map(lambda x: x + "\n"), _good.map(lambda x: x.replace("4", "٤")))
_garbage = st.one_of(st.text(max_size=40), st.sampled_from(list(PRESETS)).map(lambda p: p + "x"),
                     st.text(alphabet="kvtcrwsq0123456789.-", max_size=30))


def _check(x: str) -> None:
    try:
        spec = resolve_kv(x)
    except KvsqueezeError as exc:
        msg = str(exc)
        assert msg and "\n" not in msg, f"not one line for {x!r}: {msg!r}"
        record("spec strings", "refused")
        return
    assert isinstance(spec, CacheSpec), (x, spec)
    assert x == x.strip() and x.isascii(), f"accepted a name with blanks or non-ASCII characters: {x!r}"
    # the string form round-trips: its name resolves to the same spec, and so does its JSON form
    assert resolve_kv(spec.name) == spec
    assert resolve_kv(json.dumps(spec.to_dict())) == spec
    record("spec strings", "parsed")


@settings(max_examples=SPEC_STRINGS, deadline=None, suppress_health_check=list(HealthCheck), database=None,
          derandomize=True)
@given(_spec_like)
def test_spec_like_strings_parse_and_round_trip_or_are_refused_in_one_line(x):
    _check(x)


@settings(max_examples=GARBAGE_STRINGS, deadline=None, suppress_health_check=list(HealthCheck), database=None,
          derandomize=True)
@given(_garbage)
@example("~0")  # a home directory that does not exist: pathlib raised RuntimeError (found by this test)
@example("a" * 300)  # a name no file system holds
def test_garbage_strings_are_refused_in_one_line(x):
    _check(x)


_json_value = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True),
                        st.text(max_size=8), st.lists(st.integers(), max_size=2), st.just({}))
_quant_doc = st.dictionaries(st.sampled_from(["fmt", "bits", "axis", "group", "symmetric", "clip", "param_dtype",
                                              "fp8_scale", "bogus"]), _json_value, max_size=4)
_cache_doc = st.dictionaries(st.sampled_from(["key", "value", "window", "sinks", "name", "block_tokens",
                                              "quantize_sliding", "nope"]),
                             st.one_of(_json_value, _quant_doc), max_size=5)


@settings(max_examples=JSON_SPECS, deadline=None, suppress_health_check=list(HealthCheck), database=None,
          derandomize=True)
@given(_cache_doc)
def test_json_specs_with_wrong_types_are_refused_in_one_line(doc):
    for x in (doc, json.dumps(doc)):
        try:
            spec = resolve_kv(x)
        except KvsqueezeError as exc:
            assert str(exc) and "\n" not in str(exc), (doc, str(exc))
            record("JSON specs", "refused")
            continue
        assert isinstance(spec, CacheSpec)
        assert resolve_kv(json.dumps(spec.to_dict())) == spec
        record("JSON specs", "parsed")


def test_known_spec_strings_parse():
    for x in ["k2c32-v2t32-w128-s4", "k4t-v8t", "k3r-v2.5r-w128-s4", "k2.875rc128-v2.5r", "k2rq-v2rq"]:
        assert resolve_kv(x).name == x
