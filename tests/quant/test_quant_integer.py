"""Group-wise integer quantization: error bounds, code ranges, degenerate groups, views, fake_quantize."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsqueeze.quant import (
    PARAM_TORCH_DTYPES,
    dequantize_groups,
    fake_quantize,
    group_view,
    quantize_groups,
    scale_floor,
    to_param,
    ungroup_view,
)
from kvsqueeze.spec import QuantSpec

PDS = ["fp32", "fp16", "bf16", "fp8-e4m3"]


@st.composite
def groups(draw: st.DrawFn) -> torch.Tensor:
    """Float32 tensors [..., g]; magnitudes/offsets kept below fp8-e4m3's 448 so no parameter saturates."""
    lead = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    g = draw(st.sampled_from([1, 2, 3, 8, 32, 64]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    mag = draw(st.sampled_from([0.0, 1e-6, 1e-3, 0.1, 1.0, 10.0]))
    offset = draw(st.sampled_from([0.0, 0.5, -3.0, 50.0]))
    x = torch.randn(*lead, g, generator=gen) * mag + offset
    kind = draw(st.sampled_from(["normal", "constant", "outlier", "zeros"]))
    if kind == "constant":
        x = x[..., :1].expand_as(x).clone()
    elif kind == "outlier":
        x[..., 0] *= 5.0
    elif kind == "zeros":
        x.zero_()
    return x


def _tol(*ts: torch.Tensor) -> torch.Tensor:
    # float32 arithmetic slack in (x - z) / s and c * s + z
    return 1e-6 * sum(t.abs() for t in ts)


@settings(max_examples=200, deadline=None)
@given(x=groups(), bits=st.integers(1, 8), pd=st.sampled_from(PDS))
def test_asymmetric_error_bound(x: torch.Tensor, bits: int, pd: str) -> None:
    codes, scale, zero = quantize_groups(x, bits, symmetric=False, param_dtype=pd)
    qmax = 2**bits - 1
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    assert scale.shape == zero.shape == (*x.shape[:-1], 1)
    assert scale.dtype == zero.dtype == PARAM_TORCH_DTYPES[pd]
    s, z = scale.float(), zero.float()
    assert (s > 0).all() and torch.isfinite(s).all() and torch.isfinite(z).all()
    assert int(codes.max()) <= qmax
    # the grid covers the group: offset rounded down, scale rounded up
    assert (z <= x.amin(-1, keepdim=True)).all()
    assert (z + qmax * s >= x.amax(-1, keepdim=True) - _tol(x.amax(-1, keepdim=True), z, qmax * s)).all()
    xh = dequantize_groups(codes, scale, zero, bits)
    assert torch.isfinite(xh).all()
    assert ((x - xh).abs() <= s / 2 + _tol(x, z, qmax * s)).all()
    # codes come from the stored parameters
    assert torch.equal(codes, torch.round((x - z) / s).clamp(0, qmax).to(torch.uint8))


@settings(max_examples=200, deadline=None)
@given(x=groups(), bits=st.integers(2, 8), pd=st.sampled_from(PDS))
def test_symmetric_error_bound(x: torch.Tensor, bits: int, pd: str) -> None:
    codes, scale, zero = quantize_groups(x, bits, symmetric=True, param_dtype=pd)
    assert zero is None and scale.dtype == PARAM_TORCH_DTYPES[pd]
    s = scale.float()
    assert (s > 0).all() and torch.isfinite(s).all()
    assert 1 <= int(codes.min()) and int(codes.max()) <= 2**bits - 1
    xh = dequantize_groups(codes, scale, None, bits, symmetric=True)
    assert ((x - xh).abs() <= s / 2 + _tol(x, (2 ** (bits - 1)) * s)).all()


@settings(max_examples=100, deadline=None)
@given(x=groups(), pd=st.sampled_from(PDS), clip=st.sampled_from([1.0, 0.8, 0.5]))
def test_one_bit_symmetric_is_sign_times_mean_abs(x: torch.Tensor, pd: str, clip: float) -> None:
    codes, scale, zero = quantize_groups(x, 1, symmetric=True, clip=clip, param_dtype=pd)
    assert zero is None and set(codes.unique().tolist()) <= {0, 1}
    assert torch.equal(codes, (x >= 0).to(torch.uint8))
    m = clip * x.abs().mean(-1, keepdim=True)
    expect = to_param(torch.where(m > 0, m.clamp_min(scale_floor(pd)), m), pd)  # all-zero: exactly 0
    assert torch.equal(scale.float(), expect.float())
    xh = dequantize_groups(codes, scale, None, 1, symmetric=True)
    assert torch.equal(xh, torch.where(x >= 0, scale.float(), -scale.float()).expand_as(x))


@settings(max_examples=100, deadline=None)
@given(x=groups(), bits=st.integers(1, 8), sym=st.booleans(), pd=st.sampled_from(PDS),
       clip=st.sampled_from([0.9, 0.5, 0.1]))
def test_clipping_keeps_codes_in_range(x: torch.Tensor, bits: int, sym: bool, pd: str, clip: float) -> None:
    codes, scale, zero = quantize_groups(x, bits, symmetric=sym, clip=clip, param_dtype=pd)
    assert int(codes.max()) <= 2**bits - 1
    xh = dequantize_groups(codes, scale, zero, bits, symmetric=sym)
    assert torch.isfinite(xh).all()
    if not sym:  # values inside the clipped range keep the usual bound; the rest land on the range ends
        lo, hi = clip * x.amin(-1, keepdim=True), clip * x.amax(-1, keepdim=True)
        inside = (x >= lo) & (x <= hi)
        s, z = scale.float(), zero.float()
        err = (x - xh).abs()
        assert (err[inside] <= (s / 2 + _tol(x, z, (2**bits) * s)).expand_as(x)[inside]).all()


@pytest.mark.parametrize("pd", PDS)
@pytest.mark.parametrize("bits", range(1, 9))
@pytest.mark.parametrize("sym", [False, True])
def test_zeros_give_no_nan(pd: str, bits: int, sym: bool) -> None:
    x = torch.zeros(2, 3, 16)
    codes, scale, zero = quantize_groups(x, bits, symmetric=sym, param_dtype=pd)
    # 1-bit symmetric has no zero level: an all-zero group keeps scale 0 and decodes to +-0 (docs/robustness.md)
    assert (scale.float() > 0).all() or (sym and bits == 1 and (scale.float() == 0).all())
    xh = dequantize_groups(codes, scale, zero, bits, symmetric=sym)
    assert torch.isfinite(xh).all()
    assert torch.equal(xh, x)


@settings(max_examples=100, deadline=None)
@given(c=st.floats(-300, 300, allow_nan=False, width=32), bits=st.integers(1, 8), pd=st.sampled_from(PDS))
def test_constant_groups_round_trip(c: float, bits: int, pd: str) -> None:
    x = torch.full((3, 16), c)
    codes, scale, zero = quantize_groups(x, bits, param_dtype=pd)
    xh = dequantize_groups(codes, scale, zero, bits)
    assert torch.isfinite(xh).all()
    stored = to_param(x, pd, "nearest").float()
    if torch.equal(stored, x):  # representable in the param dtype: exact
        assert torch.equal(xh, x)
    else:  # otherwise within the param dtype's rounding of c
        gap = (to_param(x, pd, "up").float() - to_param(x, pd, "down").float()).abs()
        assert ((xh - x).abs() <= gap).all()


@settings(max_examples=100, deadline=None)
@given(
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    tg=st.sampled_from([(1, 1), (4, 2), (8, 4), (12, 3), (32, 32)]),
    dg=st.sampled_from([(4, 1), (8, 8), (64, 32), (12, 4)]),
)
def test_group_view_round_trip(lead: list[int], tg: tuple[int, int], dg: tuple[int, int]) -> None:
    (t, tgroup), (d, dgroup) = tg, dg
    x = torch.arange(float(torch.Size([*lead, t, d]).numel())).reshape(*lead, t, d)
    gt = group_view(x, "token", dgroup)
    assert gt.shape == (*lead, t, d // dgroup, dgroup)
    assert torch.equal(gt[..., 0, -1, :], x[..., 0, d - dgroup:])
    assert torch.equal(ungroup_view(gt, "token", dgroup, x.shape), x)
    gc = group_view(x, "channel", tgroup)
    assert gc.shape == (*lead, t // tgroup, d, tgroup)
    assert torch.equal(gc[..., -1, 1 % d, :], x[..., t - tgroup:, 1 % d])
    assert torch.equal(ungroup_view(gc, "channel", tgroup, x.shape), x)


def test_group_view_errors() -> None:
    x = torch.zeros(2, 10, 12)
    with pytest.raises(ValueError, match="1, 2, 3, 4, 6, 12"):
        group_view(x, "token", 5)
    with pytest.raises(ValueError, match="1, 2, 5, 10"):
        group_view(x, "channel", 4)
    with pytest.raises(ValueError, match="token, channel"):
        group_view(x, "head", 2)


def test_fake_quantize_matches_pipeline() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 64, 32, generator=gen)
    for spec in (QuantSpec(fmt="int", bits=4, axis="token", group=16),
                 QuantSpec(fmt="int", bits=2, axis="channel", group=32, param_dtype="bf16"),
                 QuantSpec(fmt="int", bits=3, axis="token", group=None, symmetric=True, clip=0.9)):
        group = spec.group or x.shape[-1]
        g = group_view(x, spec.axis, group)
        c, s, z = quantize_groups(g, spec.bits, spec.symmetric, spec.clip, spec.param_dtype)
        ref = ungroup_view(dequantize_groups(c, s, z, spec.bits, spec.symmetric), spec.axis, group, x.shape)
        assert torch.equal(fake_quantize(x, spec), ref)


def test_fake_quantize_dtype_none_and_errors() -> None:
    x = torch.randn(1, 2, 32, 64, dtype=torch.float16)
    assert fake_quantize(x, QuantSpec(fmt="none")) is x
    y = fake_quantize(x, QuantSpec(fmt="int", bits=8, group=64))
    assert y.dtype == torch.float16 and y.shape == x.shape
    assert (y.float() - x.float()).abs().max() < 0.05
    with pytest.raises(ValueError, match="token axis"):
        fake_quantize(x[:, :, :30], QuantSpec(fmt="int", bits=2, axis="channel", group=32))
    with pytest.raises(ValueError, match="does not divide"):
        fake_quantize(x, QuantSpec(fmt="int", bits=2, axis="token", group=48))


def test_groups_are_local() -> None:
    """Quantizing token-groups separately gives the same result as all at once (what the cache relies on)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 2, 96, 64, generator=gen)
    for spec in (QuantSpec(fmt="int", bits=2, axis="channel", group=32),
                 QuantSpec(fmt="int", bits=4, axis="token", group=32),
                 QuantSpec(fmt="fp8-e4m3", fp8_scale="token")):
        whole = fake_quantize(x, spec)
        parts = torch.cat([fake_quantize(x[:, :, i:i + 32], spec) for i in range(0, 96, 32)], dim=2)
        assert torch.equal(whole, parts)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="allowed"):
        quantize_groups(torch.zeros(4), 9)
    with pytest.raises(ValueError, match="clip"):
        quantize_groups(torch.zeros(4), 4, clip=0.0)
    with pytest.raises(ValueError, match="allowed"):
        quantize_groups(torch.zeros(4), 4, param_dtype="fp64")
    with pytest.raises(ValueError, match="zero"):
        dequantize_groups(torch.zeros(4, dtype=torch.uint8), torch.ones(1), None, 4)
