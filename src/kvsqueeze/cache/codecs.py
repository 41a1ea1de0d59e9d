"""Codecs: how a run of tokens of keys or values [B, H, T, D] becomes stored tensors, and back.

Every stored tensor ("part") keeps the token axis at dim 2, with ``tokens_per_row`` tokens per row along it
(1 for per-token data, G for per-channel parameters of G-token groups), so block storage can place any part
at a token offset without knowing what it holds.  Parts are tagged as codes, params or fp (full precision) for
the byte accounting.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..quant import (
    FP8_DTYPES,
    FP8_MAX,
    dequantize_groups,
    fp8_dequantize,
    fp8_quantize,
    pack_bits,
    packed_nbytes,
    param_torch_dtype,
    quantize_groups,
    unpack_bits,
)
from ..spec import ROT_FORMATS, QuantSpec


@dataclass(frozen=True)
class PartLayout:
    tail: tuple[int, ...]  # shape after [B, H, rows]
    dtype: torch.dtype
    tokens_per_row: int
    kind: str  # "codes" | "params" | "fp"


class Codec:
    """Base: encode [B,H,T,D] -> dict of parts; decode parts -> [B,H,T,D] in float32."""

    spec: QuantSpec
    head_dim: int

    def layout(self) -> dict[str, PartLayout]:
        raise NotImplementedError

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def decode(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    # Codecs with state shared by all tokens (fixed fp8 scales) override these.
    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def select_batch(self, index: torch.Tensor) -> None:
        pass


class FullCodec(Codec):
    """No quantization: the model's dtype, stored as is."""

    def __init__(self, head_dim: int, dtype: torch.dtype):
        self.spec = QuantSpec(fmt="none")
        self.head_dim, self.dtype = head_dim, dtype

    def layout(self):
        return {"x": PartLayout((self.head_dim,), self.dtype, 1, "fp")}

    def encode(self, x):
        return {"x": x.to(self.dtype)}

    def decode(self, parts):
        return parts["x"]


def _int_parts(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int) -> dict:
    """Stored parts of an integer codec: codes packed along channels, group parameters without their unit dim."""
    out = {"codes": pack_bits(codes, bits), "scale": scale.squeeze(-1)}
    if zero is not None:
        out["zero"] = zero.squeeze(-1)
    return out


def _triton_encode(codec: Codec, x: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """The Triton quantize-and-pack of ``x`` (same parts, bit for bit) for CUDA tensors, or None to use torch.

    ``KVSQUEEZE_TRITON_ENCODE=0`` switches it off; ``=1`` also uses it for CPU tensors (Triton's interpreter)."""
    flag = os.environ.get("KVSQUEEZE_TRITON_ENCODE", "")
    if flag == "0" or not (x.is_cuda or flag == "1"):
        return None
    from ..kernels.triton_pack import encode  # lazy: importing kvsqueeze never imports Triton

    return encode(codec, x)


class IntTokenCodec(Codec):
    """Integer codes with parameters per token, one scale (and zero) per ``group`` channels."""

    def __init__(self, spec: QuantSpec, head_dim: int):
        self.spec, self.head_dim = spec, head_dim
        self.group = spec.channel_group(head_dim)
        self.pdtype = param_torch_dtype(spec.param_dtype)

    def layout(self):
        d, g, s = self.head_dim, self.group, self.spec
        out = {"codes": PartLayout((packed_nbytes(d, s.bits),), torch.uint8, 1, "codes"),
               "scale": PartLayout((d // g,), self.pdtype, 1, "params")}
        if not s.symmetric:
            out["zero"] = PartLayout((d // g,), self.pdtype, 1, "params")
        return out

    def encode(self, x):
        fast = _triton_encode(self, x)
        if fast is not None:
            return fast
        b, h, t, d = x.shape
        s = self.spec
        codes, scale, zero = quantize_groups(x.float().reshape(b, h, t, d // self.group, self.group), s.bits,
                                             s.symmetric, s.clip, s.param_dtype)
        return _int_parts(codes.reshape(b, h, t, d), scale, zero, s.bits)

    def decode(self, parts):
        codes = parts["codes"]
        b, h, t, _ = codes.shape
        d, g, s = self.head_dim, self.group, self.spec
        c = unpack_bits(codes, s.bits, d).reshape(b, h, t, d // g, g)
        zero = parts.get("zero")
        x = dequantize_groups(c, parts["scale"].unsqueeze(-1), None if zero is None else zero.unsqueeze(-1),
                              s.bits, s.symmetric)
        return x.reshape(b, h, t, d)


class IntChannelCodec(Codec):
    """Integer codes with parameters per channel over groups of ``group`` tokens (KIVI's keys)."""

    def __init__(self, spec: QuantSpec, head_dim: int):
        self.spec, self.head_dim = spec, head_dim
        self.group = spec.group
        self.pdtype = param_torch_dtype(spec.param_dtype)

    def layout(self):
        d, g, s = self.head_dim, self.group, self.spec
        out = {"codes": PartLayout((packed_nbytes(d, s.bits),), torch.uint8, 1, "codes"),
               "scale": PartLayout((d,), self.pdtype, g, "params")}
        if not s.symmetric:
            out["zero"] = PartLayout((d,), self.pdtype, g, "params")
        return out

    def encode(self, x):
        fast = _triton_encode(self, x)
        if fast is not None:
            return fast
        b, h, t, d = x.shape
        g, s = self.group, self.spec
        if t % g:
            raise ValueError(f"per-channel groups need a multiple of {g} tokens, got {t}")
        grouped = x.float().reshape(b, h, t // g, g, d).transpose(-1, -2)  # [B,H,T/G,D,G]
        codes, scale, zero = quantize_groups(grouped, s.bits, s.symmetric, s.clip, s.param_dtype)
        return _int_parts(codes.transpose(-1, -2).reshape(b, h, t, d), scale, zero, s.bits)

    def decode(self, parts):
        codes = parts["codes"]
        b, h, t, _ = codes.shape
        d, g, s = self.head_dim, self.group, self.spec
        c = unpack_bits(codes, s.bits, d).reshape(b, h, t // g, g, d).transpose(-1, -2)
        zero = parts.get("zero")
        x = dequantize_groups(c, parts["scale"].unsqueeze(-1), None if zero is None else zero.unsqueeze(-1),
                              s.bits, s.symmetric)
        return x.transpose(-1, -2).reshape(b, h, t, d)


class Fp8Codec(Codec):
    """Scaled float8 codes.  Per-token scales are stored with each token; per-head and per-tensor scales are
    fixed by the first tokens quantized (the prompt) and reused afterwards, saturating at the fp8 range, so
    history is never re-quantized when a larger value arrives later."""

    def __init__(self, spec: QuantSpec, head_dim: int):
        self.spec, self.head_dim = spec, head_dim
        self.pdtype = param_torch_dtype(spec.param_dtype)
        self.fixed_scale: torch.Tensor | None = None

    def layout(self):
        out = {"codes": PartLayout((self.head_dim,), torch.uint8, 1, "codes")}
        if self.spec.fp8_scale == "token":
            out["scale"] = PartLayout((1,), self.pdtype, 1, "params")
        return out

    def encode(self, x):
        s = self.spec
        if s.fp8_scale == "token":
            codes, scale = fp8_quantize(x.float(), s.fmt, (-1,), s.param_dtype)
            return {"codes": codes, "scale": scale}
        if self.fixed_scale is None:
            dims = (-2, -1) if s.fp8_scale == "head" else (1, 2, 3)
            _, self.fixed_scale = fp8_quantize(x.float(), s.fmt, dims, s.param_dtype)
        scaled = (x.float() / self.fixed_scale.float()).clamp(-FP8_MAX[s.fmt], FP8_MAX[s.fmt])
        return {"codes": scaled.to(FP8_DTYPES[s.fmt]).view(torch.uint8)}

    def decode(self, parts):
        scale = parts["scale"] if self.spec.fp8_scale == "token" else self.fixed_scale
        return fp8_dequantize(parts["codes"], scale, self.spec.fmt)

    def state_tensors(self):
        return {} if self.fixed_scale is None else {"fixed_scale": self.fixed_scale}

    def select_batch(self, index):
        if self.fixed_scale is not None and self.spec.fp8_scale == "head":
            self.fixed_scale = self.fixed_scale.index_select(0, index)


def make_codec(spec: QuantSpec, head_dim: int, dtype: torch.dtype) -> Codec:
    if spec.extras is not None or spec.fmt == "ternary":  # calibrated methods (kvsqueeze.calibrate artifacts)
        from .codecs_calibrated import make_calibrated_codec

        return make_calibrated_codec(spec, head_dim, dtype)
    if spec.fmt == "none":
        return FullCodec(head_dim, dtype)
    if spec.fmt in ROT_FORMATS:
        from .codecs_rotated import RotatedCodec  # same layer; imported here because it subclasses Codec

        return RotatedCodec(spec, head_dim)
    if spec.fmt == "int":
        return IntChannelCodec(spec, head_dim) if spec.axis == "channel" else IntTokenCodec(spec, head_dim)
    return Fp8Codec(spec, head_dim)
