"""Codecs of the calibrated methods (SKVQ, KVQuant-style keys) and the 1.5-bit ternary format.

* :class:`PermutedGroupCodec` - per-token groups over a calibrated channel order (SKVQ's reordering, applied as a
  gather so RoPE pairs are never moved), with calibrated clip ratios per group, integer or ternary codes and
  fp8 group parameters.  Also serves plain ``fmt="ternary"`` specs (identity order, the spec's clip).
* :class:`PreRopeKeyCodec` - KVQuant-style keys: the post-RoPE key handed to the cache is rotated back to its
  pre-RoPE value, quantized per channel with static calibrated ranges (uniform or a per-layer codebook), the
  ``outliers`` worst-quantized channels of each token and head are kept exactly in a sparse side structure, and
  decoding re-applies RoPE at the token's position.

Positional codecs (``positional = True``) need the absolute position of the first token they encode/decode:
``encode_position`` / ``decode_position`` are set by the caller (the layer before each append and before it
walks the history, the emulation before its one encode/decode) and advance by the tokens processed, so the
append-only block store, which knows no positions, can stay unchanged.
"""

from __future__ import annotations

import torch

from ..quant import pack_bits, packed_nbytes, param_torch_dtype, unpack_bits
from ..quant.affine import affine_codes, minmax_params
from ..quant.extras import GroupExtras, PreRopeExtras
from ..rope import apply_rope, rope_cos_sin, undo_rope
from ..spec import QuantSpec
from .codecs import Codec, PartLayout

TRITS_PER_BYTE = 5  # 3**5 = 243 <= 256: five ternary codes per byte, 1.6 bits per code
_POW3 = (1, 3, 9, 27, 81)


# ------------------------------------------------------------------------------------------------ ternary packing
def ternary_nbytes(n: int) -> int:
    """Bytes that ``n`` ternary codes take: ceil(n / 5) (the last byte is zero-padded)."""
    return -(-n // TRITS_PER_BYTE)


def pack_ternary(codes: torch.Tensor) -> torch.Tensor:
    """Pack uint8 codes in {0, 1, 2} along the last dim, five per byte in base 3 (first code least significant)."""
    n = codes.shape[-1]
    pad = ternary_nbytes(n) * TRITS_PER_BYTE - n
    c = torch.nn.functional.pad(codes, (0, pad)).reshape(*codes.shape[:-1], -1, TRITS_PER_BYTE).to(torch.int32)
    w = torch.tensor(_POW3, dtype=torch.int32, device=codes.device)
    return (c * w).sum(-1).to(torch.uint8)


def unpack_ternary(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_ternary`: ``n`` codes along the last dim."""
    if packed.shape[-1] != ternary_nbytes(n):
        raise ValueError(f"{n} ternary codes take {ternary_nbytes(n)} bytes, got {packed.shape[-1]}")
    w = torch.tensor(_POW3, dtype=torch.int32, device=packed.device)
    c = (packed.to(torch.int32).unsqueeze(-1) // w) % 3
    return c.reshape(*packed.shape[:-1], -1)[..., :n].to(torch.uint8)


# ------------------------------------------------------------------------------------------------ quantizer
def quantize_clipped(xg: torch.Tensor, levels: int, clip: torch.Tensor | float, param_dtype: str
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max quantization of groups (last dim) to ``levels`` levels with a clip ratio that may
    differ per group (a tensor broadcasting to ``xg.shape[:-1] + (1,)``): the range is [clip*min, clip*max],
    as :func:`kvsqueeze.quant.quantize_groups` does for one scalar ratio.  Returns (codes, scale, zero)."""
    scale, zero = minmax_params(xg.float(), levels, clip, param_dtype)
    q = affine_codes(xg, scale, zero, 0, levels - 1, "float")
    return q.to(torch.uint8), scale, zero


class PermutedGroupCodec(Codec):
    """Per-token groups over calibrated channel order with per-group clip ratios; int (1-8 bit) or ternary."""

    def __init__(self, spec: QuantSpec, head_dim: int, extras: GroupExtras | None = None):
        self.spec, self.head_dim = spec, head_dim
        self.group = head_dim if spec.group is None else spec.group
        if head_dim % self.group:
            raise ValueError(f"group size {self.group} does not divide head_dim {head_dim}")
        self.levels = 3 if spec.fmt == "ternary" else 2 ** spec.bits
        self.pdtype = param_torch_dtype(spec.param_dtype)
        self.extras = extras or GroupExtras()

    def _nbytes(self) -> int:
        d = self.head_dim
        return ternary_nbytes(d) if self.spec.fmt == "ternary" else packed_nbytes(d, self.spec.bits)

    def layout(self):
        n = self.head_dim // self.group
        return {"codes": PartLayout((self._nbytes(),), torch.uint8, 1, "codes"),
                "scale": PartLayout((n,), self.pdtype, 1, "params"),
                "zero": PartLayout((n,), self.pdtype, 1, "params")}

    def _clip(self, heads: int, device: torch.device) -> torch.Tensor | float:
        c = self.extras.clip
        if c is None:
            return self.spec.clip
        return c.to(device)[:heads].view(1, heads, 1, -1, 1)

    def encode(self, x):
        b, h, t, d = x.shape
        if self.extras.perm is not None:
            x = x.gather(-1, self.extras.perm.to(x.device).view(1, h, 1, d).expand(b, h, t, d))
        xg = x.float().reshape(b, h, t, d // self.group, self.group)
        codes, scale, zero = quantize_clipped(xg, self.levels, self._clip(h, x.device), self.spec.param_dtype)
        codes = codes.reshape(b, h, t, d)
        packed = pack_ternary(codes) if self.spec.fmt == "ternary" else pack_bits(codes, self.spec.bits)
        return {"codes": packed, "scale": scale.squeeze(-1), "zero": zero.squeeze(-1)}

    def decode(self, parts):
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

    positional = True

    def __init__(self, spec: QuantSpec, head_dim: int, extras: PreRopeExtras):
        self.spec, self.head_dim, self.x = spec, head_dim, extras
        self.encode_position = 0
        self.decode_position = 0

    def layout(self):
        d, x = self.head_dim, self.x
        if x.bits is None:
            return {"x": PartLayout((d,), torch.float32, 1, "fp")}
        out = {"codes": PartLayout((packed_nbytes(d, x.bits),), torch.uint8, 1, "codes")}
        if x.outliers:  # the sparse side structure is part of the quantized representation: counted as codes
            out["oidx"] = PartLayout((x.outliers,), torch.uint8, 1, "codes")
            out["oval"] = PartLayout((x.outliers,), torch.float16, 1, "codes")
        return out

    def state_tensors(self):
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

    def encode(self, k):
        b, h, t, d = k.shape
        cos, sin = self._rope(self.encode_position, t, k.device)
        self.encode_position += t
        pre = undo_rope(k.float(), cos, sin, self.x.rope_scaling)
        if self.x.bits is None:
            return {"x": pre}
        codes, recon = self.quantize_pre(pre)
        out = {"codes": pack_bits(codes, self.x.bits)}
        if self.x.outliers:
            out.update(encode_outliers(pre, recon, self.x.outliers))
        return out

    def decode(self, parts):
        if self.x.bits is None:
            pre = parts["x"].float()
        else:
            packed = parts["codes"]
            pre = self.dequantize_pre(unpack_bits(packed, self.x.bits, self.head_dim))
            if self.x.outliers:
                pre = decode_outliers(pre, parts["oidx"], parts["oval"])
        cos, sin = self._rope(self.decode_position, pre.shape[2], pre.device)
        self.decode_position += pre.shape[2]
        return apply_rope(pre, cos, sin)


def encode_outliers(x: torch.Tensor, recon: torch.Tensor, n: int) -> dict[str, torch.Tensor]:
    """The sparse side structure: per token and head, the ``n`` channels with the largest quantization error,
    as (uint8 channel index, fp16 value)."""
    idx = (x.float() - recon).abs().topk(n, dim=-1).indices
    return {"oidx": idx.to(torch.uint8), "oval": x.gather(-1, idx).to(torch.float16)}


def decode_outliers(dense: torch.Tensor, oidx: torch.Tensor, oval: torch.Tensor) -> torch.Tensor:
    """Write the sparse values over the dense reconstruction."""
    return dense.scatter(-1, oidx.long(), oval.float())


def make_calibrated_codec(spec: QuantSpec, head_dim: int, dtype: torch.dtype) -> Codec:
    import dataclasses

    from ..quant.extras import TransformExtras
    from .codecs_transform import TransformedCodec

    ex = spec.extras
    if isinstance(ex, TransformExtras):  # a transform around any codec (inner extras, or a plain spec)
        if isinstance(ex.inner, PreRopeExtras):
            raise ValueError("a transform cannot wrap pre-RoPE keys (the codec would see transformed keys)")
        from .codecs import make_codec

        return TransformedCodec(spec, head_dim, make_codec(dataclasses.replace(spec, extras=ex.inner), head_dim,
                                                           dtype))
    if isinstance(ex, PreRopeExtras):
        return PreRopeKeyCodec(spec, head_dim, ex)
    if ex is None or isinstance(ex, GroupExtras):
        if spec.fmt not in ("int", "ternary") or spec.axis != "token":
            raise ValueError("calibrated group codecs store per-token integer or ternary codes; "
                             f"got fmt={spec.fmt!r}, axis={spec.axis!r}")
        return PermutedGroupCodec(spec, head_dim, ex)
    raise ValueError(f"unknown calibrated extras {type(ex).__name__}; allowed: GroupExtras, PreRopeExtras, "
                     "TransformExtras")


def set_positions(codec: Codec, encode: int | None = None, decode: int | None = None) -> None:
    """Tell a positional codec the absolute position of the next token it encodes / decodes (no-op otherwise)."""
    if getattr(codec, "positional", False):
        if encode is not None:
            codec.encode_position = encode
        if decode is not None:
            codec.decode_position = decode
