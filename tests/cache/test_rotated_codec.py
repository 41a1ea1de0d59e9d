"""The rotated codebook format through the spec, the codec and the real cache: spec strings, presets, exact
bits in nbytes(), errors that name what is allowed, and the codec's round trip."""

from __future__ import annotations

import json

import pytest
import torch

from kvsqueeze import CacheSpec, QuantSpec, preset
from kvsqueeze.cache.factory import make_codec
from kvsqueeze.cache.layer import LayerKV
from kvsqueeze.cli import main
from kvsqueeze.quant import bits_per_element
from kvsqueeze.quant.codebook import lloyd_max


def test_presets_meet_their_bit_budgets():
    for name, budget in (("rot-3", 3.0), ("rot-3.5", 3.5)):
        s = preset(name)
        assert (s.key.fmt, s.value.fmt, s.window, s.sinks) == ("rot", "rot", 128, 4)
        k, v = bits_per_element(s.key, 64), bits_per_element(s.value, 64)
        assert (k + v) / 2 == budget


def test_spec_strings():
    s = preset("k3.25r-v2.5rq-w64-s2")
    assert (s.key.fmt, s.key.bits, s.value.fmt, s.value.bits) == ("rot", 3.25, "rot-qjl", 2.5)
    assert (s.window, s.sinks, s.flush_tokens) == (64, 2, 1)
    mixed = preset("k2c32-v3r")
    assert (mixed.key.fmt, mixed.value.fmt, mixed.value.bits) == ("int", "rot", 3)
    assert bits_per_element(s.value, 64) == 2.5 + 0.25 + 1 + 0.25  # codes, norm, sign bits, residual norm
    assert CacheSpec.from_dict(json.loads(json.dumps(s.to_dict()))) == s


@pytest.mark.parametrize("build,message", [
    (lambda: QuantSpec(fmt="rot", bits=5), "rot bits must be a number in \\[1, 4\\]"),
    (lambda: QuantSpec(fmt="rot", bits=3, axis="channel", group=32), "axis='token', group=None"),
    (lambda: QuantSpec(fmt="rot", bits=2.7).check_head_dim(64), "multiple of 0.125 bits"),
    (lambda: QuantSpec(fmt="rot", bits=3).check_head_dim(48), "power-of-two head_dim"),
])
def test_bad_rotated_specs(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_cli_bad_rotated_spec_is_one_line_and_exit_2(capsys):
    assert main(["ppl", "--kv", '{"key": {"fmt": "rot", "bits": 7}}']) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "[1, 4]" in err


@pytest.mark.parametrize("kv", ["rot-3", "rot-3.5", "k2.75rq-v2.5r-w128-s4"])
def test_cache_nbytes_is_exact(kv):
    """The real cache stores exactly the format's bits: codes + fp16 norms (+ sketch bits and residual norms)."""
    spec = preset(kv)
    layer = LayerKV(spec)
    g = torch.Generator().manual_seed(0)
    for n in (300, 1, 1, 57):
        layer.stage(torch.randn(2, 3, n, 64, generator=g), torch.randn(2, 3, n, 64, generator=g))
        layer.commit()
    b = layer.nbytes()
    q = b["quantized_elements"]
    assert q == 2 * 3 * 64 * (359 - 4 - 128) * 2
    expect = (bits_per_element(spec.key, 64) + bits_per_element(spec.value, 64)) / 2
    assert 8 * (b["codes"] + b["params"]) / q == pytest.approx(expect, rel=1e-12)


def test_codec_round_trip_and_rotation_undone():
    codec = make_codec(QuantSpec(fmt="rot", bits=4), 64, torch.float32)
    x = torch.randn(1, 2, 50, 64, generator=torch.Generator().manual_seed(3)) + torch.linspace(-3, 3, 64)
    parts = codec.encode(x)
    assert set(parts) == {"codes", "norm"} and parts["codes"].shape[-1] == 32 and parts["norm"].dtype == torch.float16
    y = codec.decode(parts)
    rel = float(((y - x) ** 2).sum() / (x ** 2).sum())
    assert rel < 2 * 64 * lloyd_max(4, 64).mse  # the codebook's distortion (0.009), in the original space
    # decoding the exact rotated levels through R^T gives back the vector up to the codebook error only
    assert float((y.norm(dim=-1) / x.norm(dim=-1) - 1).abs().max()) < 0.05
