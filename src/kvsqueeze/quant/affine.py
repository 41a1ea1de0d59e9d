"""The one affine quantizer: codes from a scale and an offset, back to values, and its straight-through twin.

Every integer format in kvsqueeze is affine, ``x ~ decode(code)``, in one of two zero-point domains:

* ``"float"`` (KIVI, SKVQ, the cache's asymmetric groups): the offset is a float minimum,
  ``code = clamp(round((x - offset) / scale), qmin, qmax)`` and ``x_hat = code * scale + offset``;
* ``"code"`` (symmetric groups, the static engines' integer zero-points): the offset is a code,
  ``code = clamp(round(x / scale) + offset, qmin, qmax)`` and ``x_hat = (code - offset) * scale``.

Where the parameters come from (min/max of a group, calibrated ranges, fixed engine parameters) is the caller's
business; :func:`minmax_params` is the cache's rule.  Everything is float32 arithmetic on torch tensors, so the
same function serves the cache, calibration objectives and traced static graphs (ONNX export).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .nonfinite import finite_minmax
from .params import scale_floor, to_param

ZERO_DOMAINS = ("float", "code")


def _check_domain(domain: str) -> None:
    if domain not in ZERO_DOMAINS:
        raise ValueError(f"unknown zero-point domain {domain!r}; allowed: {', '.join(ZERO_DOMAINS)}")


def affine_codes(x: Tensor, scale: Tensor, offset: Tensor | float, qmin: int, qmax: int,
                 domain: str = "float") -> Tensor:
    """Integer-valued float32 codes of ``x`` (not yet cast or packed)."""
    _check_domain(domain)
    xf = x.float()
    s = scale.float()
    o = offset.float() if isinstance(offset, Tensor) else offset
    if domain == "float":
        return torch.round((xf - o) / s).clamp_(qmin, qmax)
    return (torch.round(xf / s) + o).clamp_(qmin, qmax)


def affine_values(codes: Tensor, scale: Tensor, offset: Tensor | float, domain: str = "float") -> Tensor:
    """float32 values of ``codes`` (any integer or float dtype); parameters broadcast against them."""
    _check_domain(domain)
    c = codes.float()
    o = offset.float() if isinstance(offset, Tensor) else offset
    if domain == "float":
        return c * scale.float() + o
    return (c - o) * scale.float()


def affine_ste(x: Tensor, scale: Tensor, offset: Tensor | float, qmin: int, qmax: int,
               domain: str = "float") -> Tensor:
    """Quantize-dequantize with a straight-through rounding: the forward value is exactly
    ``affine_values(affine_codes(x))``; gradients flow to ``x``, ``scale`` and ``offset`` as if rounding were the
    identity (clamping still cuts them), which is what learned transforms and clip searches optimise."""
    _check_domain(domain)
    s = scale.float()
    if domain == "float":
        t = (x.float() - offset) / s
        t = t + (torch.round(t) - t).detach()
        return t.clamp(qmin, qmax) * s + offset
    t = x.float() / s
    t = t + (torch.round(t) - t).detach()
    return ((t + offset).clamp(qmin, qmax) - offset) * s


def ieee_quotient(t: Tensor, divisor: float) -> Tensor:
    """float32 ``t / divisor`` correctly rounded on every device.  PyTorch's CUDA division by a Python number
    multiplies by its reciprocal (off by an ulp now and then), so a GPU's codes would differ from a CPU's and from
    the Triton pack's IEEE division; in float64 the quotient rounds to the same float32 (53 >= 2 * 24 + 2 bits:
    the double rounding is innocuous for a division)."""
    return (t.double() / divisor).float()


def minmax_params(xf: Tensor, levels: int, clip: Tensor | float, param_dtype: str) -> tuple[Tensor, Tensor]:
    """The cache's asymmetric rule for groups on the last dim of ``xf``: range [clip*min, clip*max] (``clip`` a
    scalar or a tensor broadcasting to ``xf.shape[:-1] + (1,)``), offset rounded *down* and scale rounded *up* in
    the parameter dtype, so in-range values are never clipped.  Returns (scale, offset) in ``param_dtype``.

    The range is over the group's finite values, clamped to +-LIMIT (quant/nonfinite.py): infinities then take
    the end codes and a huge finite value cannot overflow the scale."""
    mn, mx = finite_minmax(xf)
    mn, mx = mn * clip, mx * clip
    zero = to_param(mn, param_dtype, "down")
    scale = to_param(ieee_quotient(mx - zero.float(), levels - 1).clamp_min(scale_floor(param_dtype)), param_dtype,
                     "up")
    return scale, zero


def absmax_scale(xf: Tensor, qmax: int, clip: float, param_dtype: str) -> Tensor:
    """The symmetric rule: ``clip * absmax / qmax`` rounded up in the parameter dtype (never zero), absmax over the
    finite values.  A zero-range group (all values equal to c) takes ``clip * |c|``: c is then code +-1 and decodes
    to exactly c when c is representable in the parameter dtype."""
    mn, mx = finite_minmax(xf)
    return symmetric_scale(mn, mx, qmax, clip, param_dtype)


def symmetric_scale(mn: Tensor, mx: Tensor, qmax: float, clip: float, param_dtype: str) -> Tensor:
    """``clip * max(|mn|, |mx|) / qmax`` rounded up in the parameter dtype and floored above 0, from a group's
    finite min and max; a zero-range group (mn == mx == c) takes ``clip * |c|``, so c is code +-1 (integer and fp8
    codes alike)."""
    amax = torch.maximum(-mn, mx) * clip
    raw = torch.where(mn == mx, amax, ieee_quotient(amax, qmax))
    return to_param(raw.clamp_min(scale_floor(param_dtype)), param_dtype, "up")


__all__ = ["ZERO_DOMAINS", "affine_codes", "affine_values", "affine_ste", "minmax_params", "absmax_scale",
           "symmetric_scale"]
