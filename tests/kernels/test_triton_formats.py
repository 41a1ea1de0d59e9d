"""Every storage format the Triton kernels serve, against the reference: integer codes of 1-8 bits per token or
per channel (symmetric or not, fp32/fp16/bf16 parameters) and fp8 e4m3/e5m2 with per-token, per-head or
per-tensor scales and rotated codebooks (plain or centred, fractional widths), through the decode (a pool walked in one launch, or block by block) and the prefill.
Under TRITON_INTERPRET=1 on CPU (small shapes), on CUDA when there is one."""

from __future__ import annotations

import dataclasses

import pytest

from kvsqueeze.kernels import reference
from kvsqueeze.spec import CacheSpec, QuantSpec

from ._helpers import (
    HAS_TRITON,
    TRITON_DEVICE,
    assert_matches_reference,
    filled_layer,
    padding_mask,
    query_for,
    require_triton_runtime,
)

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


def _int(bits: int, axis: str, group: int, sym: bool = False, pdt: str = "fp16") -> QuantSpec:
    return QuantSpec(fmt="int", bits=bits, axis=axis, group=group, symmetric=sym, param_dtype=pdt)


def _rot(bits: float, centred: bool = False, pdt: str = "fp16") -> QuantSpec:
    return QuantSpec(fmt="rot", bits=bits, param_dtype=pdt, **({"axis": "channel", "group": 32} if centred else {}))


def _fp8(variant: str, scale: str, pdt: str = "fp32") -> QuantSpec:
    return QuantSpec(fmt=f"fp8-{variant}", fp8_scale=scale, param_dtype=pdt)


CASES = {
    "1-bit t / 1-bit c": (_int(1, "token", 32), _int(1, "channel", 16)),
    "3-bit t / 3-bit c": (_int(3, "token", 16), _int(3, "channel", 16)),
    "5-bit c / 7-bit t": (_int(5, "channel", 16), _int(7, "token", 32)),
    "6-bit t sym / 8-bit c": (_int(6, "token", 32, sym=True), _int(8, "channel", 16, pdt="bf16")),
    "1-bit t sym / 2-bit t sym": (_int(1, "token", 16, sym=True), _int(2, "token", 32, sym=True, pdt="fp32")),
    "4-bit c sym bf16 / 3-bit t sym": (_int(4, "channel", 32, sym=True, pdt="bf16"), _int(3, "token", 8, sym=True)),
    "fp8 e4m3 token / e5m2 token": (_fp8("e4m3", "token", "fp16"), _fp8("e5m2", "token")),
    "fp8 e4m3 head / e5m2 tensor": (_fp8("e4m3", "head"), _fp8("e5m2", "tensor")),
    # rotated codebooks: scores against the rotated query, values un-rotated after the stored tokens
    "rot 2.75 centred / rot 2.5": (_rot(2.75, centred=True), _rot(2.5)),
    "rot 3.25 / int 4-bit t": (_rot(3.25), _int(4, "token", 32)),
    "int 3-bit c / rot 1.5 centred bf16": (_int(3, "channel", 32), _rot(1.5, centred=True, pdt="bf16")),
    "rot 4 / rot 2": (_rot(4), _rot(2)),
}


def _layer(case: str, pooled: bool, new: int):
    key, value = CASES[case]
    spec = CacheSpec(key=key, value=value, window=32, sinks=1, block_tokens=32, name=case)
    return filled_layer(spec, batch=2, kv_heads=1, head_dim=32, stored=150, steps=3, new=new, pooled=pooled,
                        device=TRITON_DEVICE)


@pytest.fixture
def td(monkeypatch):
    from kvsqueeze.kernels import triton_decode, triton_prefill

    require_triton_runtime()
    monkeypatch.setattr(triton_decode, "CHUNK", 64)
    monkeypatch.setattr(triton_decode, "BLOCK_T", 32)
    monkeypatch.setattr(triton_prefill, "BLOCK_M", 32)
    monkeypatch.setattr(triton_prefill, "BLOCK_N", 32)
    return triton_decode


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("pooled", [True, False], ids=["pool", "blocks"])
def test_decode_serves_the_format(td, case, pooled):
    layer = _layer(case, pooled, new=1)
    assert td.path(query_for(layer, 2, 1), layer.plan()) == "triton"
    assert_matches_reference(td.attend, layer, 2, 1, padding_mask(layer, 1, [0, 11]), atol=1e-4)


@pytest.mark.parametrize("route", ["0", "1"], ids=["tiled", "dense"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_prefill_serves_the_format(td, case, route, monkeypatch):
    monkeypatch.setenv("KVSQUEEZE_TRITON_PREFILL_DENSE", route)
    layer = _layer(case, True, new=17)
    want = "triton-prefill-dense" if route == "1" else "triton-prefill"
    assert td.path(query_for(layer, 2, 17), layer.plan()) == want
    assert_matches_reference(td.attend, layer, 2, 17, atol=1e-4)


def test_formats_it_does_not_serve_take_the_reference_and_say_so(td):
    spec = dataclasses.replace(CacheSpec(key=QuantSpec(fmt="rot-qjl", bits=3), value=_int(4, "token", 32),
                                         window=8), block_tokens=32)
    layer = filled_layer(spec, batch=1, kv_heads=1, head_dim=32, stored=80, pooled=True, device=TRITON_DEVICE)
    q = query_for(layer, 2, 1)
    assert td.path(q, layer.plan()) == "reference"
    assert td.attend(q, layer.plan(), None, 0.125).equal(reference.attend(q, layer.plan(), None, 0.125))
