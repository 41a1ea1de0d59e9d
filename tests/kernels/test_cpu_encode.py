"""The C++ quantize-and-pack (kernels/cpu.py encode, _csrc/encode.h) against the torch encoders of IntTokenCodec /
IntChannelCodec: identical parts, bit for bit, on every instruction-set build; and the cache routes its CPU tokens
through it."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvsqueeze.adapter import fast_encoder
from kvsqueeze.cache.codecs import IntChannelCodec, IntTokenCodec
from kvsqueeze.kernels import cpu
from kvsqueeze.spec import QuantSpec

from ._helpers import bits_view, filled_layer, wild_rows


def _assert_same(got: dict | None, ref: dict) -> None:
    assert got is not None and set(got) == set(ref)
    for name, r in ref.items():
        g = got[name]
        assert g.shape == r.shape and g.dtype == r.dtype, name
        assert torch.equal(bits_view(g), bits_view(r)), f"{name}: {(g != r).sum().item()} differ"


def _codec(axis: str, bits: int, symmetric: bool, group: int, d: int, pdtype: str, clip: float = 1.0):
    spec = QuantSpec(fmt="int", bits=bits, axis=axis, group=group, symmetric=symmetric, clip=clip,
                     param_dtype=pdtype)
    return (IntChannelCodec if axis == "channel" else IntTokenCodec)(spec, d)


@pytest.mark.parametrize("axis", ["token", "channel"])
@pytest.mark.parametrize("bits,symmetric", [(1, False), (2, False), (2, True), (3, False), (3, True), (4, False),
                                            (4, True), (5, False), (8, False), (8, True)])
def test_encode_matches_torch_encoder(cpu_isa, axis, bits, symmetric):
    gen = torch.Generator().manual_seed(bits * 10 + symmetric + (axis == "channel") * 100)
    for pdtype, xdtype in (("fp32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16),
                           ("fp16", torch.float32)):
        d = (32, 64, 128)[int(torch.randint(3, (1,), generator=gen))]
        group = (4, 8, 16, 32)[int(torch.randint(4, (1,), generator=gen))]
        b, h = (int(v) for v in torch.randint(1, 3, (2,), generator=gen))
        t = group * int(torch.randint(1, 4, (1,), generator=gen)) + (int(torch.randint(0, 5, (1,), generator=gen))
                                                                      if axis == "token" else 0)
        codec = _codec(axis, bits, symmetric, group, d, pdtype, 1.0 if pdtype == "fp32" else 0.85)
        x = (torch.randn(b, h, t, d, generator=gen) * 2 + 0.3).to(xdtype)
        _assert_same(cpu.encode(codec.fmt, x), codec.encode(x))


@pytest.mark.parametrize("pdtype", ["fp32", "fp16", "bf16"])
def test_encode_extreme_values_and_ties(cpu_isa, pdtype):
    gen = torch.Generator().manual_seed(7)
    for axis, bits, sym in (("token", 4, False), ("channel", 2, False), ("token", 8, True), ("channel", 3, True),
                            ("token", 1, False), ("channel", 8, False)):
        for clip in (1.0, 0.7):
            codec = _codec(axis, bits, sym, 8, 16, pdtype, clip)
            x = wild_rows(gen, (1, 2, 32, 16), nonfinite=True)
            _assert_same(cpu.encode(codec.fmt, x), codec.encode(x))


def test_one_token_of_a_decode_step(cpu_isa):
    """What a decode step stores: one token per (sequence, head), SmolLM2's shape, every preset format."""
    gen = torch.Generator().manual_seed(3)
    for axis, bits, group, sym in (("token", 8, 64, False), ("token", 4, 32, False), ("token", 2, 32, False),
                                   ("token", 3, 32, False), ("token", 4, 64, True)):
        codec = _codec(axis, bits, sym, group, 64, "fp16")
        x = torch.randn(2, 3, 1, 64, generator=gen) * 3
        _assert_same(cpu.encode(codec.fmt, x), codec.encode(x))


def test_unsupported_returns_none():
    x = torch.randn(1, 1, 8, 32)
    assert cpu.encode(_codec("token", 1, True, 32, 32, "fp16").fmt, x) is None  # 1-bit symmetric: a mean
    assert cpu.encode(_codec("token", 4, False, 32, 32, "fp8-e4m3").fmt, x) is None
    ragged = _codec("channel", 4, False, 16, 32, "fp16")
    assert cpu.encode(ragged.fmt, x) is None
    with pytest.raises(ValueError, match="multiple of 16"):
        ragged.encode(x)  # the torch path still reports the error
    permuted = dataclasses.replace(_codec("token", 4, False, 32, 32, "fp16").fmt, permuted=True)
    assert cpu.encode(permuted, x) is None  # a calibrated (non-plain) format is never taken over
    assert cpu.encode(dataclasses.replace(permuted, permuted=False, zero_domain="code"), x) is None
    assert cpu.encode(_codec("token", 4, False, 32, 32, "fp16").fmt, x.double()) is None
    if cpu.available():  # supported ones do come back (the tests above would pass vacuously otherwise)
        assert cpu.encode(_codec("token", 4, False, 16, 32, "fp16").fmt, x) is not None


def test_the_cache_stores_cpu_tokens_through_it(monkeypatch):
    """The adapter's encoder sends a CPU block store's tokens through the C++ encoder; the stored blocks equal
    those of the torch encoder (KVSQUEEZE_CPU_ENCODE=0)."""
    if not cpu.available():
        pytest.skip("the C++ kernel could not be built here")
    calls = []
    real = cpu.encode

    def spy(fmt, x):
        out = real(fmt, x)
        calls.append(out is not None)
        return out

    def stored(spec: str):
        layer = filled_layer(spec, batch=2, kv_heads=2, head_dim=64, stored=70, new=1, steps=3,
                             fast_encode=fast_encoder)
        rows = {k: lay.tokens_per_row for k, lay in layer.store._layouts()}
        return {f"{i}.{k}": t[:, :, :blk.used // rows[k]].clone()  # rows past `used` are uninitialised
                for i, blk in enumerate(layer.store.blocks) for k, t in blk.parts.items()}

    monkeypatch.setattr(cpu, "encode", spy)
    for spec in ("k2c16-v4t16-w16-s2", "int8", "k3t-v8t32-w0"):
        monkeypatch.setenv("KVSQUEEZE_CPU_ENCODE", "0")
        ref = stored(spec)
        assert not calls
        monkeypatch.setenv("KVSQUEEZE_CPU_ENCODE", "1")
        got = stored(spec)
        assert calls and all(calls), spec
        calls.clear()
        assert set(got) == set(ref)
        for k in ref:
            assert torch.equal(bits_view(got[k]), bits_view(ref[k])), (spec, k)


@pytest.mark.parametrize("backend, uses_cpp", [("auto", True), ("cpu", True), ("torch", False)])
def test_a_model_cache_encodes_in_cpp_unless_its_backend_is_the_torch_reference(tiny_llama, monkeypatch, backend,
                                                                                uses_cpp):
    from kvsqueeze.adapter import QuantizedCache, cache_kwargs

    if not cpu.available():
        pytest.skip("the C++ kernel could not be built here")
    calls = []
    real = cpu.encode
    monkeypatch.setattr(cpu, "encode", lambda fmt, x: calls.append(1) or real(fmt, x))
    cache = QuantizedCache(tiny_llama.config, "int8", backend=backend)
    ids = torch.randint(2, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        tiny_llama(ids, **cache_kwargs(tiny_llama, cache), use_cache=True)
    assert bool(calls) == uses_cpp
