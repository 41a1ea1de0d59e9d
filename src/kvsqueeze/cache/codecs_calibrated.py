"""Codecs of the calibrated methods (SKVQ, KVQuant-style keys) and the 1.5-bit ternary format.

* :class:`PermutedGroupCodec` - per-token groups over a calibrated channel order (SKVQ's reordering, applied as a
  gather so RoPE pairs are never moved), with calibrated clip ratios per group, integer or ternary codes and
  fp8 group parameters.  Also serves plain ``fmt="ternary"`` specs (identity order, the spec's clip).
* :class:`PreRopeKeyCodec` - KVQuant-style keys: the post-RoPE key handed to the cache is rotated back to its
  pre-RoPE value, quantized per channel with static calibrated ranges (uniform or a per-layer codebook), the
  ``outliers`` worst-quantized channels of each token and head are kept exactly in a sparse side structure, and
  decoding re-applies RoPE at the token's position (``start``, passed in by the caller like every codec's).
"""

from __future__ import annotations

import torch

from ..quant import pack_bits, packed_nbytes, unpack_bits
from ..quant.affine import affine_codes, minmax_params
from ..quant.extras import GroupExtras, PreRopeExtras
from ..quant.format import PartLayout, storage_format
from ..quant.nonfinite import finite_vectors, nan_to_zero, saturate
from ..quant.packing import pack_ternary, ternary_nbytes, unpack_ternary
from ..rope import apply_rope, rope_cos_sin, undo_rope
from ..spec import QuantSpec
from .codecs import Codec

__all__ = ["PermutedGroupCodec", "PreRopeKeyCodec", "decode_outliers", "encode_outliers", "pack_ternary",
           "quantize_clipped", "ternary_nbytes", "unpack_ternary"]


def quantize_clipped(xg: torch.Tensor, levels: int, clip: torch.Tensor | float, param_dtype: str
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max quantization of groups (last dim) to ``levels`` levels with a clip ratio that may
    differ per group (a tensor broadcasting to ``xg.shape[:-1] + (1,)``): the range is [clip*min, clip*max],
    as :func:`kvsqueeze.quant.quantize_groups` does for one scalar ratio.  Returns (codes, scale, zero)."""
    xg = nan_to_zero(xg)  # NaN quantized as 0; the range is over finite values, so +-inf take the end codes
    scale, zero = minmax_params(xg, levels, clip, param_dtype)
    q = affine_codes(xg, scale, zero, 0, levels - 1, "float")
    return q.to(torch.uint8), scale, zero


class PermutedGroupCodec(Codec):
    """Per-token groups over calibrated channel order with per-group clip ratios; int (1-8 bit) or ternary."""

    def __init__(self, spec: QuantSpec, head_dim: int, extras: GroupExtras | None = None):
        self.spec = spec
        self.fmt = storage_format(spec, head_dim, torch.float32)
        self.group = self.fmt.group
        if head_dim % self.group:
            raise ValueError(f"group size {self.group} does not divide head_dim {head_dim}")
        self.levels = 3 if spec.fmt == "ternary" else 2 ** spec.bits
        self.extras = extras or GroupExtras()

    def _clip(self, heads: int, device: torch.device) -> torch.Tensor | float:
        c = self.extras.clip
        if c is None:
            return self.spec.clip
        return c.to(device)[:heads].view(1, heads, 1, -1, 1)

    def encode(self, x, start=0, shared=None):
        b, h, t, d = x.shape
        if self.extras.perm is not None:
            x = x.gather(-1, self.extras.perm.to(x.device).view(1, h, 1, d).expand(b, h, t, d))
        xg = x.float().reshape(b, h, t, d // self.group, self.group)
        codes, scale, zero = quantize_clipped(xg, self.levels, self._clip(h, x.device), self.spec.param_dtype)
        codes = codes.reshape(b, h, t, d)
        packed = pack_ternary(codes) if self.spec.fmt == "ternary" else pack_bits(codes, self.spec.bits)
        return {"codes": packed, "scale": scale.squeeze(-1), "zero": zero.squeeze(-1)}

    def decode(self, parts, start=0, shared=None):
        packed = parts["codes"]
        b, h, t, _ = packed.shape
        d, g = self.head_dim, self.group
        c = unpack_ternary(packed, d) if self.spec.fmt == "ternary" else unpack_bits(packed, self.spec.bits, d)
        x = c.float().reshape(b, h, t, d // g, g) * parts["scale"].float().unsqueeze(-1) \
            + parts["zero"].float().unsqueeze(-1)
        x = x.reshape(b, h, t, d)
        if self.extras.inv is not None:
            x = x.gather(-1, self.extras.inv.to(x.device).view(1, h, 1, d).expand(b, h, t, d))
        return x


class PreRopeKeyCodec(Codec):
    """KVQuant-style keys: quantized before RoPE with static per-channel ranges, dense-and-sparse outliers."""

    def __init__(self, spec: QuantSpec, head_dim: int, extras: PreRopeExtras):
        self.spec, self.x = spec, extras
        self.fmt = storage_format(spec, head_dim, torch.float32)

    def layout(self):
        d, x = self.head_dim, self.x
        if x.bits is None:
            return {"x": PartLayout((d,), torch.float32, 1, "fp")}
        out = {"codes": PartLayout((packed_nbytes(d, x.bits),), torch.uint8, 1, "codes")}
        if x.outliers:  # the sparse side structure is part of the quantized representation: counted as codes
            out["oidx"] = PartLayout((x.outliers,), torch.uint8, 1, "codes")
            out["oval"] = PartLayout((x.outliers,), torch.float16, 1, "codes")
        return out

    def constants(self):
        return {"lo": self.x.lo, "hi": self.x.hi} if self.x.bits is not None else {}

    def _rope(self, start: int, t: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, start + t, device=device)
        return rope_cos_sin(pos, self.x.inv_freq.to(device), self.x.rope_scaling)

    def _grid(self, h: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        lo = self.x.lo.to(device).float()[:h].view(1, h, 1, -1)
        return lo, (self.x.hi.to(device).float()[:h].view(1, h, 1, -1) - lo).clamp_min(1e-8)

    def quantize_pre(self, pre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Codes and their reconstruction for pre-RoPE keys [B, H, T, D] (no outliers)."""
        x = self.x
        lo, width = self._grid(pre.shape[1], pre.device)
        u = ((pre.float() - lo) / width).clamp_(0, 1)
        if x.codebook is None:
            top = 2 ** x.bits - 1
            codes = torch.round(u * top)
            return codes.to(torch.uint8), lo + width * codes / top
        cb = x.codebook.to(pre.device)
        # nearest level: the codebook is sorted, so searchsorted on the midpoints gives it directly
        codes = torch.searchsorted((cb[1:] + cb[:-1]) / 2, u.contiguous())
        return codes.to(torch.uint8), lo + width * cb[codes]

    def dequantize_pre(self, codes: torch.Tensor) -> torch.Tensor:
        x = self.x
        lo, width = self._grid(codes.shape[1], codes.device)
        if x.codebook is None:
            return lo + width * codes.float() / (2 ** x.bits - 1)
        return lo + width * x.codebook.to(codes.device)[codes.long()]

    def encode(self, k, start=0, shared=None):
        cos, sin = self._rope(start, k.shape[2], k.device)
        # before un-rotating, which would mix an inf with its pair's channel into NaN: see quant/nonfinite.py
        pre = undo_rope(finite_vectors(k), cos, sin, self.x.rope_scaling)
        if self.x.bits is None:
            return {"x": pre}
        codes, recon = self.quantize_pre(pre)
        out = {"codes": pack_bits(codes, self.x.bits)}
        if self.x.outliers:
            out.update(encode_outliers(pre, recon, self.x.outliers))
        return out

    def decode(self, parts, start=0, shared=None):
        if self.x.bits is None:
            pre = parts["x"].float()
        else:
            pre = self.dequantize_pre(unpack_bits(parts["codes"], self.x.bits, self.head_dim))
            if self.x.outliers:
                pre = decode_outliers(pre, parts["oidx"], parts["oval"])
        cos, sin = self._rope(start, pre.shape[2], pre.device)
        return apply_rope(pre, cos, sin)


def encode_outliers(x: torch.Tensor, recon: torch.Tensor, n: int) -> dict[str, torch.Tensor]:
    """The sparse side structure: per token and head, the ``n`` channels with the largest quantization error,
    as (uint8 channel index, fp16 value)."""
    idx = (x.float() - recon).abs().topk(n, dim=-1).indices
    return {"oidx": idx.to(torch.uint8), "oval": saturate(x.gather(-1, idx), torch.float16)}


def decode_outliers(dense: torch.Tensor, oidx: torch.Tensor, oval: torch.Tensor) -> torch.Tensor:
    """Write the sparse values over the dense reconstruction."""
    return dense.scatter(-1, oidx.long(), oval.float())
