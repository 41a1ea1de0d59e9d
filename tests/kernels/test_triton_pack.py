"""Triton quantize-and-pack against the torch encoders of IntTokenCodec / IntChannelCodec: identical parts.

The reference is the torch encoder on the CPU (IEEE division, as the kernel's ``div_rn``): on CUDA, torch divides
a tensor by a Python scalar through the scalar's reciprocal, which differs from IEEE division in the last bit.

Runs under TRITON_INTERPRET=1 on CPU (tests/kernels/conftest.py) and on CUDA when present.  Codes and scales
must be bit-identical; zero offsets equal in value (the sign of a 0.0 minimum depends on reduction order).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvsqueeze.adapter import fast_encoder
from kvsqueeze.cache.codecs import IntChannelCodec, IntTokenCodec
from kvsqueeze.spec import QuantSpec

from ._helpers import HAS_TRITON, TRITON_DEVICE, bits_view, filled_layer, require_triton_runtime, wild_rows

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


@pytest.fixture
def tp():
    from kvsqueeze.kernels import triton_pack

    require_triton_runtime()
    return triton_pack


def _assert_same(got: dict, ref: dict) -> None:
    assert got is not None and set(got) == set(ref)
    for name, r in ref.items():
        g, r = got[name].cpu(), r.cpu()
        assert g.shape == r.shape and g.dtype == r.dtype, name
        if name == "zero":
            assert torch.equal(g, r), name
        else:
            assert torch.equal(bits_view(g), bits_view(r)), f"{name}: {(g != r).sum().item()} differ"


@pytest.mark.parametrize("axis", ["token", "channel"])
@pytest.mark.parametrize("bits,symmetric", [(1, False), (2, False), (2, True), (3, False), (3, True), (4, False),
                                            (4, True), (8, False), (8, True)])  # 1-bit symmetric: torch only
def test_pack_matches_torch_encoder(tp, axis, bits, symmetric):
    gen = torch.Generator().manual_seed(bits * 10 + symmetric + (axis == "channel") * 100)
    for pdtype, xdtype in (("fp32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16)):
        d = (16, 32, 64)[int(torch.randint(3, (1,), generator=gen))]
        group = (4, 8, 16)[int(torch.randint(3, (1,), generator=gen))]
        b, h = (int(v) for v in torch.randint(1, 3, (2,), generator=gen))
        t = group * int(torch.randint(1, 4, (1,), generator=gen)) + (int(torch.randint(0, 5, (1,), generator=gen))
                                                                      if axis == "token" else 0)
        clip = 1.0 if pdtype == "fp32" else 0.85
        spec = QuantSpec(fmt="int", bits=bits, axis=axis, group=group, symmetric=symmetric, clip=clip,
                         param_dtype=pdtype)
        codec = (IntChannelCodec if axis == "channel" else IntTokenCodec)(spec, d)
        x = (torch.randn(b, h, t, d, generator=gen) * 2 + 0.3).to(TRITON_DEVICE, xdtype)
        _assert_same(tp.encode(codec.fmt, x), codec.encode(x.cpu()))


@pytest.mark.parametrize("pdtype", ["fp32", "fp16", "bf16"])
def test_pack_extreme_values_and_ties(tp, pdtype):
    gen = torch.Generator().manual_seed(7)
    for axis, bits, sym in (("token", 4, False), ("channel", 2, False), ("token", 8, True), ("channel", 3, True)):
        spec = QuantSpec(fmt="int", bits=bits, axis=axis, group=8, symmetric=sym, param_dtype=pdtype)
        codec = (IntChannelCodec if axis == "channel" else IntTokenCodec)(spec, 16)
        x = wild_rows(gen, (1, 2, 32, 16)).to(TRITON_DEVICE)
        _assert_same(tp.encode(codec.fmt, x), codec.encode(x.cpu()))


def test_unsupported_returns_none(tp):
    x = torch.randn(1, 1, 8, 32, device=TRITON_DEVICE)
    assert tp.encode(IntTokenCodec(QuantSpec(fmt="int", bits=1, symmetric=True), 32).fmt, x) is None
    assert tp.encode(IntTokenCodec(QuantSpec(fmt="int", bits=4, param_dtype="fp8-e4m3"), 32).fmt, x) is None
    assert tp.encode(IntTokenCodec(QuantSpec(fmt="int", bits=4, group=None), 48).fmt, torch.randn(1, 1, 8, 48)) is None
    ragged = IntChannelCodec(QuantSpec(fmt="int", bits=4, axis="channel", group=16), 32)
    assert tp.encode(ragged.fmt, x) is None
    with pytest.raises(ValueError, match="multiple of 16"):
        ragged.encode(x)  # the torch path still reports the error

    permuted = dataclasses.replace(IntTokenCodec(QuantSpec(fmt="int", bits=4), 32).fmt, permuted=True)
    assert tp.encode(permuted, x) is None  # a calibrated (non-plain) format is never taken over
    # supported ones do come back (the tests above would pass vacuously otherwise)
    assert tp.encode(IntTokenCodec(QuantSpec(fmt="int", bits=4, group=16), 32).fmt, x) is not None


def test_codecs_route_to_triton_when_forced(tp, monkeypatch):
    """The adapter's encoder sends the block store's tokens through the kernel (on CUDA by default, on CPU tensors
    with KVSQUEEZE_TRITON_ENCODE=1); the stored blocks equal those of the torch encoder on the CPU."""
    calls = []
    real = tp.encode

    def spy(fmt, x, into=None):
        out = real(fmt, x, into)
        calls.append(out is not None)
        return out

    def stored(spec: str, device: str):
        layer = filled_layer(spec, batch=2, kv_heads=2, head_dim=32, stored=70, new=1, steps=3,
                             fast_encode=fast_encoder, device=device)
        rows = {k: lay.tokens_per_row for k, lay in layer.store._layouts()}
        return {f"{i}.{k}": t[:, :, :blk.used // rows[k]].cpu()  # rows past `used` are uninitialised
                for i, blk in enumerate(layer.store.blocks) for k, t in blk.parts.items()}

    spec = "k2c16-v4t16-w16-s2"
    monkeypatch.setenv("KVSQUEEZE_TRITON_ENCODE", "0")
    monkeypatch.setenv("KVSQUEEZE_CPU_ENCODE", "0")  # the torch encoder itself (not the C++ one) as reference
    ref = stored(spec, "cpu")
    monkeypatch.setattr(tp, "encode", spy)
    assert not calls
    monkeypatch.setenv("KVSQUEEZE_TRITON_ENCODE", "1")
    got = stored(spec, TRITON_DEVICE)
    assert calls and all(calls)
    assert set(got) == set(ref)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("axis,bits,sym,pdtype", [("channel", 2, False, "fp16"), ("token", 4, False, "fp16"),
                                                  ("token", 8, True, "bf16"), ("channel", 3, False, "fp32")])
def test_pack_on_gpu(axis, bits, sym, pdtype, monkeypatch):
    from kvsqueeze.kernels import triton_pack

    spec = QuantSpec(fmt="int", bits=bits, axis=axis, group=32, symmetric=sym, param_dtype=pdtype)
    codec = (IntChannelCodec if axis == "channel" else IntTokenCodec)(spec, 128)
    x = torch.randn(4, 8, 256, 128, device="cuda", dtype=torch.float16) * 3
    monkeypatch.setenv("KVSQUEEZE_TRITON_ENCODE", "0")
    ref = codec.encode(x.cpu())  # the reference: torch on CUDA divides by a scalar through its reciprocal
    _assert_same(triton_pack.encode(codec.fmt, x), ref)
    monkeypatch.delenv("KVSQUEEZE_TRITON_ENCODE")
    _assert_same(fast_encoder(codec.fmt, x), ref)  # the block stores' default on CUDA is the kernel
