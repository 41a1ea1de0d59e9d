"""The one rule for NaN, infinities and huge values entering a quantized group (docs/robustness.md, "Overflow").

* NaN is quantized as 0.
* +inf / -inf take the group's top / bottom code: the group's range (or absmax) is computed over its finite values
  only, and the infinities are clamped to its ends.  A group with no finite value has the range [0, 0].
* Finite values are clamped to +-:data:`LIMIT` before anything is computed from them, so no range, scale, norm,
  square or code-times-scale product can overflow float32 (nor a kernel's sums of them); parameters are then
  stored saturating at their dtype's largest finite value (:func:`kvsqueeze.quant.params.to_param`).

Full-precision tokens (window, sinks) are stored as the model produced them and never pass through here.
"""

from __future__ import annotations

import torch
from torch import Tensor

# 2**50 (~1.1e15): squares of D <= 2**27 such values still sum below float32's max (~2**128), as do the products
# and sums the attention kernels form from decoded values and O(1)..O(1e4) queries and softmax weights.
LIMIT = 2.0 ** 50


def nan_to_zero(x: Tensor) -> Tensor:
    """float32 ``x`` with NaN replaced by 0 (infinities kept: the caller's clamps saturate them)."""
    xf = x.float()
    return torch.where(torch.isnan(xf), torch.zeros_like(xf), xf)


def finite_minmax(xf: Tensor, dim=-1) -> tuple[Tensor, Tensor]:
    """(min, max) over ``dim`` (keepdim) of the finite values of float32 ``xf`` (NaN already zeroed), clamped to
    +-LIMIT; (0, 0) for a group without finite values.  The Triton packer (kernels/triton_pack.py) computes the
    same numbers the same way, so its parameters stay bit-identical to these."""
    xc = xf.clamp(-LIMIT, LIMIT)
    fin = torch.isfinite(xf)
    mn = torch.where(fin, xc, torch.full_like(xc, LIMIT)).amin(dim, keepdim=True)
    mx = torch.where(fin, xc, torch.full_like(xc, -LIMIT)).amax(dim, keepdim=True)
    empty = mn > mx
    zero = torch.zeros_like(mn)
    return torch.where(empty, zero, mn), torch.where(empty, zero, mx)


def finite_vectors(x: Tensor, dim=-1) -> Tensor:
    """float32 ``x`` for codecs without a group range (rotated codebooks, pre-RoPE keys): NaN -> 0, +-inf -> +- the
    largest finite magnitude over ``dim`` (0 if none), everything clamped to +-LIMIT."""
    xf = nan_to_zero(x)
    mn, mx = finite_minmax(xf, dim)
    top = torch.maximum(-mn, mx)
    xf = torch.where(xf == float("inf"), top, torch.where(xf == float("-inf"), -top, xf))
    return xf.clamp(-LIMIT, LIMIT)


def saturate(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` cast to ``dtype`` with values beyond its finite range clamped to it (a plain cast gives inf)."""
    lim = float(torch.finfo(dtype).max)
    return t.float().clamp(-lim, lim).to(dtype)


__all__ = ["LIMIT", "finite_minmax", "finite_vectors", "nan_to_zero", "saturate"]
