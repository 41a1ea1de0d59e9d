"""Specs and presets: parsing, validation messages, and the quantized-count schedule."""

from __future__ import annotations

import pytest

from kvsqueeze import PRESETS, CacheSpec, QuantSpec, preset
from kvsqueeze.cli import main


def test_every_preset_is_valid_for_head_dim_64():
    for name, spec in PRESETS.items():
        assert preset(name) is spec
        spec.check_head_dim(64)


def test_spec_string():
    s = preset("k2c32-v2t32-w128-s4")
    assert (s.key.bits, s.key.axis, s.key.group) == (2, "channel", 32)
    assert (s.value.bits, s.value.axis, s.value.group) == (2, "token", 32)
    assert (s.window, s.sinks, s.flush_tokens) == (128, 4, 32)


def test_spec_round_trips_through_dict_and_json():
    s = preset("kivi-2-sink4")
    assert CacheSpec.from_dict(s.to_dict()) == s
    import json

    assert preset(json.dumps(s.to_dict())) == s


@pytest.mark.parametrize("n, expected", [(0, 0), (131, 0), (164, 32), (195, 32), (196, 64), (1000, 864)])
def test_quantized_count_schedule(n, expected):
    # kivi-2-sink4: 4 sinks, window 128, keys grouped over 32 tokens
    assert preset("kivi-2-sink4").quantized_count(n) == expected


def test_full_preset_quantizes_nothing():
    assert preset("full").quantized_count(77) == 0 and not preset("full").quantized


@pytest.mark.parametrize("build, message", [
    (lambda: QuantSpec(bits=0), "allowed: 1, 2, 3, 4, 5, 6, 7, 8"),
    (lambda: QuantSpec(axis="channel"), "needs a token group size"),
    (lambda: QuantSpec(clip=1.5), r"clip ratio must be in \(0, 1\]"),
    (lambda: QuantSpec(param_dtype="fp64"), "allowed: fp32, fp16, bf16, fp8-e4m3"),
    (lambda: CacheSpec(key=QuantSpec(bits=2, axis="channel", group=32), window=48), "not a multiple"),
    (lambda: CacheSpec(sinks=-1), "non-negative"),
    (lambda: preset("nope"), "unknown preset 'nope'; allowed: full, int8"),
    (lambda: QuantSpec(bits=4, group=48).check_head_dim(64), "does not divide head_dim 64"),
    # a centred rotated group that does not divide the 256-token block: refused when parsed, naming those that fit
    (lambda: preset("k3rc24-v2.5r-w48-s4"), "token groups that fit 256-token blocks: 1, 2, 4, 8, 16, 32, 64, 128, 256"),
])
def test_bad_specs_name_the_allowed_values(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_cli_bad_preset_is_one_line_and_exit_2(capsys):
    assert main(["generate", "--prompt", "hi", "--kv", "kivi-9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown cache 'kivi-9'" in err[0]


def test_cli_presets_lists_bits(capsys):
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    assert "kivi-2" in out and "3.000" in out  # 2-bit codes + fp16 scale and zero per 32 elements
