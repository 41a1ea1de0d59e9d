"""Scaled fp8: relative error per format, scale shapes, zeros and saturation."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsqueeze.quant import FP8_DTYPES, FP8_MAX, fake_quantize, fp8_dequantize, fp8_quantize, fp8_reduce_dims
from kvsqueeze.spec import QuantSpec

# (relative rounding error of normal numbers, half the subnormal spacing in units of the scale)
BOUNDS = {"fp8-e4m3": (2.0**-4, 2.0**-10), "fp8-e5m2": (2.0**-3, 2.0**-17)}
REDUCE = [(-1,), (-2, -1), (1, 2, 3)]


def test_tables() -> None:
    assert FP8_DTYPES == {"fp8-e4m3": torch.float8_e4m3fn, "fp8-e5m2": torch.float8_e5m2}
    assert FP8_MAX == {"fp8-e4m3": 448.0, "fp8-e5m2": 57344.0}
    for fmt, dt in FP8_DTYPES.items():
        assert torch.finfo(dt).max == FP8_MAX[fmt]


@settings(max_examples=150, deadline=None)
@given(
    fmt=st.sampled_from(list(FP8_DTYPES)),
    dims=st.sampled_from(REDUCE),
    pd=st.sampled_from(["fp32", "fp16", "bf16", "fp8-e4m3"]),
    seed=st.integers(0, 2**31 - 1),
    logmag=st.integers(-12, 6),
)
def test_round_trip_relative_error(fmt: str, dims: tuple[int, ...], pd: str, seed: int, logmag: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 3, 5, 16, generator=gen) * 2.0**logmag
    x[0, 0, 0, 0] *= 30.0  # an outlier, so the smallest values go subnormal under per-tensor scales
    codes, scale = fp8_quantize(x, fmt, dims, param_dtype=pd)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    keep = [1 if (i in dims or i - 4 in dims) else n for i, n in enumerate(x.shape)]
    assert list(scale.shape) == keep
    s = scale.float()
    assert (s > 0).all() and torch.isfinite(s).all()
    xh = fp8_dequantize(codes, scale, fmt)
    assert torch.isfinite(xh).all()
    rel, sub = BOUNDS[fmt]
    assert ((x - xh).abs() <= rel * x.abs() + sub * s + 1e-6 * x.abs()).all()


@pytest.mark.parametrize("fmt", list(FP8_DTYPES))
def test_absmax_does_not_saturate(fmt: str) -> None:
    x = torch.tensor([[3.0, -7.5, 0.1, 1e-3]])
    codes, scale = fp8_quantize(x, fmt, (-1,))
    q = codes.view(FP8_DTYPES[fmt]).float()
    assert torch.isfinite(q).all() and q.abs().max() <= FP8_MAX[fmt]
    assert q[0, 1] == -FP8_MAX[fmt]  # the absmax lands on the format's max (float32 division may overshoot)
    assert abs(fp8_dequantize(codes, scale, fmt)[0, 1].item() + 7.5) < 1e-5


@pytest.mark.parametrize("fmt", list(FP8_DTYPES))
@pytest.mark.parametrize("pd", ["fp32", "fp16", "bf16", "fp8-e4m3"])
def test_zeros(fmt: str, pd: str) -> None:
    x = torch.zeros(1, 2, 4, 8)
    codes, scale = fp8_quantize(x, fmt, (-1,), param_dtype=pd)
    assert (scale.float() > 0).all()
    assert torch.equal(fp8_dequantize(codes, scale, fmt), x)


def test_reduce_dims_and_fake_quantize() -> None:
    assert fp8_reduce_dims("token", 4) == (-1,)
    assert fp8_reduce_dims("head", 4) == (-2, -1)
    assert fp8_reduce_dims("tensor", 4) == (-3, -2, -1)
    assert fp8_reduce_dims("tensor", 2) == (-2, -1)
    with pytest.raises(ValueError, match="allowed"):
        fp8_reduce_dims("block", 4)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 2, 8, 16, generator=gen, dtype=torch.bfloat16)
    for scale_kind in ("token", "head", "tensor"):
        spec = QuantSpec(fmt="fp8-e5m2", fp8_scale=scale_kind, param_dtype="fp32")
        codes, scale = fp8_quantize(x, "fp8-e5m2", fp8_reduce_dims(scale_kind, 4), "fp32")
        y = fake_quantize(x, spec)
        assert y.dtype == torch.bfloat16
        assert torch.equal(y, fp8_dequantize(codes, scale, "fp8-e5m2", dtype=torch.bfloat16))
    assert fp8_quantize(x, "fp8-e4m3", (1, 2, 3))[1].shape == (2, 1, 1, 1)


def test_unknown_format() -> None:
    with pytest.raises(ValueError, match="allowed"):
        fp8_quantize(torch.ones(4), "fp8-e3m4", (-1,))
