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
    c = preset("k2.875rc128-v2.5r-w128-s4")
    assert (c.key.fmt, c.key.bits, c.key.axis, c.key.group, c.flush_tokens) == ("rot", 2.875, "channel", 128, 128)
    assert bits_per_element(c.key, 64) == 2.875 + 0.25 + 0.125  # codes, scale, one fp16 mean per 128 tokens
    assert c.key.label() == "rot2.875/mean128/fp16"
    assert CacheSpec.from_dict(json.loads(json.dumps(c.to_dict()))) == c


@pytest.mark.parametrize("build,message", [
    (lambda: QuantSpec(fmt="rot", bits=5), "rot bits must be a number in \\[1, 4\\]"),
    (lambda: QuantSpec(fmt="rot", bits=3, axis="channel"), "axis='token', group=None"),
    (lambda: QuantSpec(fmt="rot", bits=3, group=32), "axis='channel', group=G >= 1"),
    (lambda: QuantSpec(fmt="rot-qjl", bits=3, axis="channel", group=32), "axis='token', group=None"),
    (lambda: preset("k3rc0-v2r"), "group=G >= 1"),
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


@pytest.mark.parametrize("kv", ["rot-3", "rot-3.5", "k2.75rq-v2.5r-w128-s4", "k2.875rc32-v2.375rc32-w64-s4"])
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
    assert q == 2 * 3 * 64 * spec.quantized_count(359) * 2 and spec.quantized_count(359) >= 128
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


def test_centred_codec_stores_group_means_and_least_squares_scales():
    """Centred codes: one row per group (its rotated mean, then its tokens' scales); the decode removes a shared
    per-channel offset exactly (the mean) and codes only the rest, so an offset larger than the rest costs
    nothing, where the plain format spends its codes on it."""
    from kvsqueeze.quant.codebook import ROTATION_SEED, codebook_values, split_bits, unpack_split
    from kvsqueeze.quant.rotation import rotation_matrix

    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 2, 64, 64, generator=g) + 8 * torch.randn(64, generator=g)  # a large per-channel offset
    centred = make_codec(QuantSpec(fmt="rot", bits=3, axis="channel", group=32), 64, torch.float32)
    parts = centred.encode(x)
    assert set(parts) == {"codes", "stats"} and parts["stats"].shape == (1, 2, 2, 64 + 32)
    r = rotation_matrix(64, ROTATION_SEED)
    y = x @ r
    torch.testing.assert_close(parts["stats"][..., :64].float(), y.reshape(1, 2, 2, 32, 64).mean(3),
                               atol=1e-2, rtol=1e-3)
    # the scale is the least-squares one for the stored codes
    resid = y - parts["stats"][..., :64].float().repeat_interleave(32, dim=2)
    sp = split_bits(3, 64)
    c = codebook_values(unpack_split(parts["codes"], sp), sp)
    ls = (resid * c).sum(-1) / (c * c).sum(-1)
    torch.testing.assert_close(parts["stats"][..., 64:].float().reshape(1, 2, 64), ls, atol=1e-3, rtol=1e-3)
    err_c = float(((centred.decode(parts) - x) ** 2).sum())
    plain = make_codec(QuantSpec(fmt="rot", bits=3), 64, torch.float32)
    err_p = float(((plain.decode(plain.encode(x)) - x) ** 2).sum())
    assert err_c < err_p / 10
    rel = err_c / float(((x - x.mean(2, keepdim=True)) ** 2).sum())
    assert rel < 1.1 * 64 * lloyd_max(3, 64).mse  # the codebook's distortion of the centred part
