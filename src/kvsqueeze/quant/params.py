"""Storage of quantization parameters (scales, zero offsets) in a narrow dtype, with directed rounding.

Scales and offsets are rounded to their storage dtype *before* codes are computed, so the dequantizer sees exactly
the numbers the quantizer used.  Rounding is directed (offsets down, scales up) so that the rounded grid still
covers the whole [min, max] range of the group: with round-to-nearest an fp8 scale can come out ~6 % short and
clip the top of the range by many quantization steps.
"""

from __future__ import annotations

import torch
from torch import Tensor

PARAM_TORCH_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp8-e4m3": torch.float8_e4m3fn,
}

PARAM_DTYPE_NAMES: dict[torch.dtype, str] = {dt: name for name, dt in PARAM_TORCH_DTYPES.items()}

# Same-width integer views, used to step to the neighbouring representable value (all are sign-magnitude).
_INT_VIEWS: dict[torch.dtype, tuple[torch.dtype, int]] = {
    torch.float16: (torch.int16, 16),
    torch.bfloat16: (torch.int16, 16),
    torch.float8_e4m3fn: (torch.uint8, 8),
}


def param_torch_dtype(param_dtype: str) -> torch.dtype:
    """The torch dtype that stores parameters named ``param_dtype`` ("fp32", "fp16", "bf16", "fp8-e4m3")."""
    try:
        return PARAM_TORCH_DTYPES[param_dtype]
    except KeyError:
        raise ValueError(
            f"unknown param_dtype {param_dtype!r}; allowed: {', '.join(PARAM_TORCH_DTYPES)}"
        ) from None


def param_max(param_dtype: str) -> float:
    """Largest finite value of the parameter dtype (448 for fp8-e4m3)."""
    return float(torch.finfo(param_torch_dtype(param_dtype)).max)


def scale_floor(param_dtype: str) -> float:
    """Smallest positive scale stored: keeps constant groups free of 0/0 without leaving the dtype's range.

    fp16 and fp8 use their smallest subnormal (fine resolution for near-constant groups); fp32 and bf16 use the
    smallest normal number, ~1e-38, to stay clear of float32 denormals.
    """
    dt = param_torch_dtype(param_dtype)
    fi = torch.finfo(dt)
    if dt in (torch.float16, torch.float8_e4m3fn):
        return fi.smallest_normal * fi.eps  # smallest subnormal: 2**-24 (fp16), 2**-9 (fp8-e4m3)
    return fi.smallest_normal


def _step_up(r: Tensor, down: bool = False) -> Tensor:
    """Next representable value above ``r`` (below it when ``down``), by integer arithmetic on its bits.

    ``r`` must be finite and not the dtype's max (min when ``down``); callers guarantee it by clamping first.
    """
    view, width = _INT_VIEWS[r.dtype]
    sign_bit = 1 << (width - 1)
    b = r.view(view).to(torch.int32) & ((1 << width) - 1)
    if down:  # stepping down is stepping up the negation; negate by flipping the sign bit (fp8 has no neg op)
        b = b ^ sign_bit
    neg = (b & sign_bit) != 0
    mag = b & (sign_bit - 1)
    # positive (or +0): magnitude + 1; negative non-zero: magnitude - 1; -0: smallest positive subnormal
    out = torch.where(neg, torch.where(mag == 0, torch.ones_like(b), b - 1), b + 1)
    if down:
        out = out ^ sign_bit
    if view == torch.int16:
        out = out - ((out & sign_bit) << 1)  # back to a signed 16-bit value before narrowing
    return out.to(view).view(r.dtype)


def to_param(t: Tensor, param_dtype: str, mode: str = "nearest") -> Tensor:
    """Round float32 ``t`` to the parameter dtype: ``mode`` is "nearest", "up" (result >= t) or "down" (<= t).

    Values are first clamped to the dtype's finite range (+-448 for fp8-e4m3), so nothing becomes inf or NaN.
    """
    dt = param_torch_dtype(param_dtype)
    if mode not in ("nearest", "up", "down"):
        raise ValueError(f"unknown rounding mode {mode!r}; allowed: nearest, up, down")
    t = t.float()
    lim = float(torch.finfo(dt).max)
    t = t.clamp(-lim, lim)
    if dt == torch.float32:
        return t
    r = t.to(dt)
    if mode == "up":
        r = torch.where(r.float() < t, _step_up(r), r)
    elif mode == "down":
        r = torch.where(r.float() > t, _step_up(r, down=True), r)
    return r
