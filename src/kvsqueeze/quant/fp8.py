"""Scaled float8 storage: x is divided by a scale (absmax / fp8 max) and cast to e4m3 or e5m2.

Codes are returned viewed as uint8 so every storage format of the cache is a plain byte tensor.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .affine import symmetric_scale
from .nonfinite import LIMIT, finite_minmax, nan_to_zero

FP8_DTYPES: dict[str, torch.dtype] = {"fp8-e4m3": torch.float8_e4m3fn, "fp8-e5m2": torch.float8_e5m2}
FP8_MAX: dict[str, float] = {"fp8-e4m3": 448.0, "fp8-e5m2": 57344.0}


def _fp8_dtype(fmt: str) -> torch.dtype:
    try:
        return FP8_DTYPES[fmt]
    except KeyError:
        raise ValueError(f"unknown fp8 format {fmt!r}; allowed: {', '.join(FP8_DTYPES)}") from None


def fp8_reduce_dims(fp8_scale: str, ndim: int) -> tuple[int, ...]:
    """Dims to reduce for a QuantSpec.fp8_scale on a [..., H, T, D] tensor with ``ndim`` dims.

    "token": (-1,) - one scale per token and head; "head": (-2, -1) - one per head over the tokens given;
    "tensor": (-3, -2, -1) - one per sequence over all heads ((1, 2, 3) for [B, H, T, D]), so sequences of a
    batch never share a scale.
    """
    dims = {"token": (-1,), "head": (-2, -1), "tensor": (-3, -2, -1)}
    if fp8_scale not in dims:
        raise ValueError(f"unknown fp8_scale {fp8_scale!r}; allowed: {', '.join(dims)}")
    return tuple(d for d in dims[fp8_scale] if -d <= ndim)


def fp8_quantize(
    x: Tensor, fmt: str, reduce_dims: tuple[int, ...], param_dtype: str = "fp32"
) -> tuple[Tensor, Tensor]:
    """Scale and cast ``x`` to float8; returns ``(codes, scale)``.

    ``codes`` are uint8 (the fp8 bits) shaped like ``x``; ``scale`` has ``x``'s shape with size 1 over
    ``reduce_dims`` (keepdim) and is stored in ``param_dtype``.  ``scale = absmax / fp8_max`` rounded *up* in
    the param dtype, so ``|x / scale| <= fp8_max`` and nothing saturates; it is floored above 0 so all-zero
    slices give zero codes, not NaN.  For [B, H, T, D]: per-token = (-1,), per-head = (-2, -1) over the given
    tokens, per-tensor = (1, 2, 3) (see :func:`fp8_reduce_dims`).

    Non-finite input (quant/nonfinite.py): the absmax is over finite values (clamped to +-2**50), NaN is stored
    as 0 and +-inf saturate to +-fp8 max.  A zero-range slice (all values equal to c) takes the scale ``|c|``, so
    c is code +-1 and decodes to exactly c when the param dtype represents it.
    """
    dt = _fp8_dtype(fmt)
    fmax = FP8_MAX[fmt]
    xf = nan_to_zero(x)
    if reduce_dims:
        mn, mx = finite_minmax(xf, reduce_dims)
    else:  # one scale per element: each is its own zero-range slice
        mn = mx = torch.where(torch.isfinite(xf), xf.clamp(-LIMIT, LIMIT), torch.zeros_like(xf))
    scale = symmetric_scale(mn, mx, fmax, 1.0, param_dtype)
    # the clamp is a guard against float32 rounding in the division: e5m2 overflows to inf, not to its max
    q = (xf / scale.float()).clamp_(-fmax, fmax).to(dt)
    return q.view(torch.uint8), scale


def fp8_dequantize(codes: Tensor, scale: Tensor, fmt: str, dtype: torch.dtype = torch.float32) -> Tensor:
    """Inverse of :func:`fp8_quantize`: reinterpret the uint8 codes as ``fmt`` and multiply by ``scale``."""
    return (codes.view(_fp8_dtype(fmt)).float() * scale.float()).to(dtype)
