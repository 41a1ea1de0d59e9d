"""bits_per_element: codes plus scales and zero offsets."""

from __future__ import annotations

import pytest

from kvsqueeze.quant import bits_per_element, param_nbytes
from kvsqueeze.spec import PRESETS, QuantSpec


def test_param_nbytes() -> None:
    assert [param_nbytes(p) for p in ("fp32", "fp16", "bf16", "fp8-e4m3")] == [4, 2, 2, 1]
    with pytest.raises(ValueError, match="allowed"):
        param_nbytes("fp64")


def test_examples() -> None:
    int4 = QuantSpec(fmt="int", bits=4, axis="token", group=64, param_dtype="fp16")
    assert bits_per_element(int4, 64) == 4.5
    kivi2_keys = QuantSpec(fmt="int", bits=2, axis="channel", group=32, param_dtype="fp16")
    assert bits_per_element(kivi2_keys, 128) == 3.0
    sym = QuantSpec(fmt="int", bits=4, axis="token", group=64, symmetric=True)
    assert bits_per_element(sym, 128) == 4 + 16 / 64
    whole_head = QuantSpec(fmt="int", bits=8, group=None, param_dtype="fp32")
    assert bits_per_element(whole_head, 128) == 8 + 64 / 128
    assert bits_per_element(QuantSpec(fmt="int", bits=3, axis="token", group=32), 128) == 3 + 32 / 32
    assert bits_per_element(QuantSpec(fmt="int", bits=2, group=32, param_dtype="fp8-e4m3"), 64) == 2 + 16 / 32


def test_unpacked_widths_cost_a_byte() -> None:
    for bits in (5, 6, 7):
        assert bits_per_element(QuantSpec(fmt="int", bits=bits, group=64), 64) == 8 + 32 / 64


def test_fp8() -> None:
    tok32 = QuantSpec(fmt="fp8-e4m3", fp8_scale="token", param_dtype="fp32")
    assert bits_per_element(tok32, 128) == 8 + 32 / 128
    assert bits_per_element(PRESETS["fp8-e5m2"].key, 64) == 8 + 16 / 64  # preset keeps the fp16 default
    assert bits_per_element(QuantSpec(fmt="fp8-e4m3", fp8_scale="head"), 64) == 8.0
    assert bits_per_element(QuantSpec(fmt="fp8-e4m3", fp8_scale="tensor"), 64) == 8.0


def test_none_raises_and_bad_head_dim() -> None:
    with pytest.raises(ValueError, match="none"):
        bits_per_element(QuantSpec(fmt="none"), 64)
    with pytest.raises(ValueError):
        bits_per_element(QuantSpec(fmt="int", bits=4, group=48), 64)
