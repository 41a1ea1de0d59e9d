"""Exact storage cost of a QuantSpec, parameters included (what memory tables and plots report)."""

from __future__ import annotations

from ..spec import PACKABLE_BITS, ROT_FORMATS, QuantSpec

_PARAM_NBYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8-e4m3": 1}


def param_nbytes(param_dtype: str) -> int:
    """Bytes per stored scale or zero offset: 4 (fp32), 2 (fp16, bf16), 1 (fp8-e4m3)."""
    try:
        return _PARAM_NBYTES[param_dtype]
    except KeyError:
        raise ValueError(f"unknown param_dtype {param_dtype!r}; allowed: {', '.join(_PARAM_NBYTES)}") from None


def bits_per_element(spec: QuantSpec, head_dim: int) -> float:
    """Bits of storage per key/value element, codes plus scales and zero offsets.

    int: code bits (1, 2, 3, 4, 8 are densely packed; 5-7-bit codes are stored one per byte, so they count 8)
    plus ``n_params * param_bits / group`` - one scale, plus one zero offset when asymmetric, per group of
    ``group`` elements (channels for axis="token", tokens for axis="channel").  E.g. int4 asymmetric, token
    groups of 64, fp16 params: 4 + 32/64 = 4.5; KIVI 2-bit keys, channel groups of 32, fp16: 2 + 32/32 = 3.0.

    fp8: 8 bits plus, for fp8_scale="token", one scale in ``spec.param_dtype`` per token and head
    (8 + 32/head_dim with fp32 scales, 8 + 16/head_dim with the QuantSpec default fp16).  "head" and "tensor"
    scales are shared by a whole sequence, so their per-element cost is counted as 0 (returns 8.0).

    rot / rot-qjl: ``bits`` (exact for fractional widths: a split of whole widths over rotated coordinates) plus
    one scale per token and head (+ 16/head_dim with fp16), for rot-qjl one more bit and one more norm, and for
    centred rot (axis "channel") one mean per channel per ``group`` tokens (+ 16/group with fp16).

    "none" raises ValueError: full-precision storage is the model dtype's business (16 or 32 bits).
    """
    if not spec.quantized:
        raise ValueError("bits_per_element is undefined for fmt='none': full precision costs the model dtype's bits")
    pbits = 8 * param_nbytes(spec.param_dtype)
    if spec.fmt in ROT_FORMATS:
        spec.check_head_dim(head_dim)
        # code bits, one norm per token and head; rot-qjl: one sign bit per coordinate and the residual norm
        sketch = (1 + pbits / head_dim) if spec.fmt == "rot-qjl" else 0.0
        centre = pbits / spec.group if spec.axis == "channel" else 0.0
        return float(spec.bits) + pbits / head_dim + sketch + centre
    if spec.fmt != "int":
        return 8.0 + (pbits / head_dim if spec.fp8_scale == "token" else 0.0)
    spec.check_head_dim(head_dim)
    code_bits = spec.bits if spec.bits in PACKABLE_BITS else 8
    group = spec.channel_group(head_dim) if spec.axis == "token" else spec.group
    assert group is not None  # QuantSpec guarantees a group for axis="channel"
    n_params = 1 if spec.symmetric else 2
    return code_bits + n_params * pbits / group
