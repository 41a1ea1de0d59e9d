"""Group-wise integer quantization of [..., T, D] tensors: the pure-torch reference every backend must match.

Groups are always the LAST dim of the tensor handed to :func:`quantize_groups`; :func:`group_view` turns a
[..., T, D] key/value tensor into that layout for either grouping axis (per-token or per-channel, KIVI style).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..spec import AXES, QuantSpec
from .affine import absmax_scale, affine_codes, affine_values, minmax_params
from .fp8 import fp8_dequantize, fp8_quantize, fp8_reduce_dims
from .nonfinite import LIMIT, nan_to_zero
from .params import scale_floor, to_param


def _check_bits(bits: int) -> None:
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"unsupported bits {bits!r}; allowed: 1, 2, 3, 4, 5, 6, 7, 8")


def quantize_groups(
    x: Tensor, bits: int, symmetric: bool = False, clip: float = 1.0, param_dtype: str = "fp16"
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Quantize each group (the last dim of ``x``) to ``bits``-bit unsigned codes.

    Returns ``(codes, scale, zero)``: ``codes`` is uint8 shaped like ``x``; ``scale`` and ``zero`` have shape
    ``x.shape[:-1] + (1,)`` and are stored in ``param_dtype``.  Codes are computed from the stored (rounded)
    parameters, so :func:`dequantize_groups` reproduces exactly what was quantized.

    Asymmetric: the range is [clip*min, clip*max]; ``zero`` is that minimum (a float offset, KIVI style) rounded
    *down* and ``scale = (max - zero) / (2**bits - 1)`` rounded *up* in the param dtype, so in-range values are
    never clipped and ``|x - x_hat| <= scale / 2``.  Offsets and scales are clamped to the param dtype's finite
    range (+-448 for fp8-e4m3, +-65504 for fp16): values beyond it are clipped.  fp8-e4m3 offsets are coarse
    (3 mantissa bits), which widens the grid - and the error bound - of groups far from zero.

    Symmetric (``zero`` is None): ``scale = clip*absmax / qmax`` (rounded up), ``qmax = 2**(bits-1) - 1``,
    ``code = clamp(round(x / scale), -qmax, qmax) + 2**(bits-1)``.  For bits == 1 there is no zero level: codes
    {0, 1} mean {-s, +s} with ``s = clip * mean(|x|)`` over the group (the L2-optimal sign quantizer; x == 0
    maps to +s).

    The scale is never 0 (floored at :func:`~kvsqueeze.quant.params.scale_floor`), so zero or constant groups
    give no NaN/inf; a constant group (clip 1) decodes to exactly its value when the param dtype represents it.

    Non-finite input (quant/nonfinite.py): NaN is quantized as 0, +-inf take the group's end codes (the range is
    over the finite values), finite values beyond +-2**50 saturate; parameters and decoded values stay finite.
    """
    _check_bits(bits)
    if not 0.0 < clip <= 1.0:
        raise ValueError(f"clip ratio must be in (0, 1], got {clip!r}")
    xf = nan_to_zero(x)
    if symmetric and bits == 1:
        fin = torch.isfinite(xf)
        total = torch.where(fin, xf.abs().clamp_max(LIMIT), torch.zeros_like(xf)).sum(-1, keepdim=True)
        m = clip * (total / fin.sum(-1, keepdim=True).clamp_min(1))
        # an all-zero group keeps scale 0 (so it decodes to exactly 0); codes are signs, nothing divides by it
        scale = to_param(torch.where(m > 0, m.clamp_min(scale_floor(param_dtype)), m), param_dtype)
        return (xf >= 0).to(torch.uint8), scale, None
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        scale = absmax_scale(xf, qmax, clip, param_dtype)
        q = affine_codes(xf, scale, 2 ** (bits - 1), 1, 2**bits - 1, "code")
        return q.to(torch.uint8), scale, None
    scale, zero = minmax_params(xf, 2**bits, clip, param_dtype)
    q = affine_codes(xf, scale, zero, 0, 2**bits - 1, "float")
    return q.to(torch.uint8), scale, zero


def dequantize_groups(
    codes: Tensor,
    scale: Tensor,
    zero: Tensor | None,
    bits: int,
    symmetric: bool = False,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Inverse of :func:`quantize_groups`; ``scale``/``zero`` broadcast over the last dim.  Computed in float32."""
    _check_bits(bits)
    if symmetric:
        out = (2 * codes.float() - 1) * scale.float() if bits == 1 else affine_values(codes, scale, 2 ** (bits - 1),
                                                                                      "code")
    else:
        if zero is None:
            raise ValueError("asymmetric dequantization needs the zero offsets (got None)")
        out = affine_values(codes, scale, zero, "float")
    return out.to(dtype)


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def group_view(x: Tensor, axis: str, group: int) -> Tensor:
    """View [..., T, D] as groups along the last dim.

    axis="token":   ``group`` consecutive channels of one token -> [..., T, D // group, group] (a view).
    axis="channel": ``group`` consecutive tokens of one channel -> [..., T // group, D, group] (a strided view).
    """
    if axis not in AXES:
        raise ValueError(f"unknown axis {axis!r}; allowed: {', '.join(AXES)}")
    if x.dim() < 2:
        raise ValueError(f"expected a [..., T, D] tensor, got shape {tuple(x.shape)}")
    *lead, t, d = x.shape
    n, what = (d, "channel (head_dim)") if axis == "token" else (t, "token")
    if not isinstance(group, int) or group < 1 or n % group:
        raise ValueError(f"group size {group!r} does not divide the {what} axis of length {n}; "
                         f"allowed: {_divisors(n)}")
    if axis == "token":
        return x.reshape(*lead, t, d // group, group)
    return x.reshape(*lead, t // group, group, d).transpose(-1, -2)


def ungroup_view(g: Tensor, axis: str, group: int, shape: torch.Size | tuple[int, ...]) -> Tensor:
    """Inverse of :func:`group_view`: back to ``shape`` ([..., T, D])."""
    if axis not in AXES:
        raise ValueError(f"unknown axis {axis!r}; allowed: {', '.join(AXES)}")
    if axis == "channel":
        g = g.transpose(-1, -2)
    return g.reshape(shape)


def fake_quantize(x: Tensor, spec: QuantSpec) -> Tensor:
    """Quantize then dequantize a [..., T, D] tensor as ``spec`` stores it; same dtype and shape as ``x``.

    int: groups from :func:`group_view` (axis="channel" needs T to be a multiple of ``spec.group``).
    fp8: scales over :func:`~kvsqueeze.quant.fp8.fp8_reduce_dims` for ``spec.fp8_scale``, stored in
    ``spec.param_dtype``.  "none": ``x`` itself.
    """
    if spec.fmt == "none":
        return x
    if spec.fmt != "int":
        codes, scale = fp8_quantize(x, spec.fmt, fp8_reduce_dims(spec.fp8_scale, x.dim()), spec.param_dtype)
        return fp8_dequantize(codes, scale, spec.fmt, dtype=x.dtype)
    group = spec.channel_group(x.shape[-1]) if spec.axis == "token" else spec.group
    assert group is not None  # QuantSpec guarantees a group for axis="channel"
    g = group_view(x, spec.axis, group)
    codes, scale, zero = quantize_groups(g, spec.bits, spec.symmetric, spec.clip, spec.param_dtype)
    xh = dequantize_groups(codes, scale, zero, spec.bits, spec.symmetric, dtype=x.dtype)
    return ungroup_view(xh, spec.axis, group, x.shape)


__all__ = ["quantize_groups", "dequantize_groups", "group_view", "ungroup_view", "fake_quantize"]
