"""Codecs: stateless adapters from a storage format to tensors: a run of tokens [B, H, T, D] <-> stored parts.

A codec is built from a :class:`~kvsqueeze.quant.format.StorageFormat` (what is stored) and holds no state of a
cache: ``encode(x, start, shared)`` / ``decode(parts, start, shared)`` take the absolute position of the first
token (positional codecs such as pre-RoPE keys need it) and the side's shared tensors (fp8 per-head / per-tensor
scales, owned by the block store and filled by the first encode).  Every stored part keeps the token axis at dim
2 with ``tokens_per_row`` tokens per row (see :class:`~kvsqueeze.quant.format.PartLayout`), so block storage can
place any part at a token offset without knowing what it holds.
"""

from __future__ import annotations

import torch

from ..quant import (
    FP8_DTYPES,
    FP8_MAX,
    dequantize_groups,
    fp8_dequantize,
    fp8_quantize,
    pack_bits,
    quantize_groups,
    unpack_bits,
)
from ..quant.format import PartLayout, StorageFormat, storage_format
from ..quant.nonfinite import nan_to_zero
from ..spec import QuantSpec

Shared = dict[str, torch.Tensor]


class Codec:
    """Base: ``encode`` [B,H,T,D] -> dict of parts; ``decode`` parts -> [B,H,T,D] in float32."""

    spec: QuantSpec
    fmt: StorageFormat

    @property
    def head_dim(self) -> int:
        return self.fmt.head_dim

    def layout(self) -> dict[str, PartLayout]:
        return self.fmt.parts()

    def encode(self, x: torch.Tensor, start: int = 0, shared: Shared | None = None) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def decode(self, parts: dict[str, torch.Tensor], start: int = 0, shared: Shared | None = None) -> torch.Tensor:
        raise NotImplementedError

    def constants(self) -> dict[str, torch.Tensor]:
        """Calibrated tensors the stored codes depend on (counted as parameters in the cache's bytes)."""
        return {}


class FullCodec(Codec):
    """No quantization: the model's dtype, stored as is."""

    def __init__(self, head_dim: int, dtype: torch.dtype):
        self.spec = QuantSpec(fmt="none")
        self.fmt = storage_format(self.spec, head_dim, dtype)

    def encode(self, x, start=0, shared=None):
        return {"x": x.to(self.fmt.fp_dtype)}

    def decode(self, parts, start=0, shared=None):
        return parts["x"]


def _int_parts(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int) -> dict:
    """Stored parts of an integer codec: codes packed along channels, group parameters without their unit dim."""
    out = {"codes": pack_bits(codes, bits), "scale": scale.squeeze(-1)}
    if zero is not None:
        out["zero"] = zero.squeeze(-1)
    return out


class IntTokenCodec(Codec):
    """Integer codes with parameters per token, one scale (and zero) per ``group`` channels."""

    def __init__(self, spec: QuantSpec, head_dim: int):
        self.spec, self.fmt = spec, storage_format(spec, head_dim, torch.float32)
        self.group = self.fmt.group

    def encode(self, x, start=0, shared=None):
        b, h, t, d = x.shape
        s = self.spec
        codes, scale, zero = quantize_groups(x.float().reshape(b, h, t, d // self.group, self.group), s.bits,
                                             s.symmetric, s.clip, s.param_dtype)
        return _int_parts(codes.reshape(b, h, t, d), scale, zero, s.bits)

    def decode(self, parts, start=0, shared=None):
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
        self.spec, self.fmt = spec, storage_format(spec, head_dim, torch.float32)
        self.group = self.fmt.group

    def encode(self, x, start=0, shared=None):
        b, h, t, d = x.shape
        g, s = self.group, self.spec
        if t % g:
            raise ValueError(f"per-channel groups need a multiple of {g} tokens, got {t}")
        grouped = x.float().reshape(b, h, t // g, g, d).transpose(-1, -2)  # [B,H,T/G,D,G]
        codes, scale, zero = quantize_groups(grouped, s.bits, s.symmetric, s.clip, s.param_dtype)
        return _int_parts(codes.transpose(-1, -2).reshape(b, h, t, d), scale, zero, s.bits)

    def decode(self, parts, start=0, shared=None):
        codes = parts["codes"]
        b, h, t, _ = codes.shape
        d, g, s = self.head_dim, self.group, self.spec
        c = unpack_bits(codes, s.bits, d).reshape(b, h, t // g, g, d).transpose(-1, -2)
        zero = parts.get("zero")
        x = dequantize_groups(c, parts["scale"].unsqueeze(-1), None if zero is None else zero.unsqueeze(-1),
                              s.bits, s.symmetric)
        return x.transpose(-1, -2).reshape(b, h, t, d)


class Fp8Codec(Codec):
    """Scaled float8 codes.  Per-token scales are stored with each token; a per-head or per-tensor scale is
    fixed by the first tokens quantized (the prompt) and kept in the side's shared tensors ("scale"), saturating
    at the fp8 range afterwards, so history is never re-quantized when a larger value arrives later."""

    def __init__(self, spec: QuantSpec, head_dim: int):
        self.spec, self.fmt = spec, storage_format(spec, head_dim, torch.float32)

    def encode(self, x, start=0, shared=None):
        s = self.spec
        if s.fp8_scale == "token":
            codes, scale = fp8_quantize(x.float(), s.fmt, (-1,), s.param_dtype)
            return {"codes": codes, "scale": scale}
        if shared is None:
            raise ValueError("fp8 with a per-head or per-tensor scale needs the store's shared tensors")
        if "scale" not in shared:
            dims = (-2, -1) if s.fp8_scale == "head" else (1, 2, 3)
            _, shared["scale"] = fp8_quantize(x.float(), s.fmt, dims, s.param_dtype)
        fixed = shared["scale"]
        # NaN stored as 0; +-inf and values beyond the fixed scale's reach saturate at +-fp8 max
        scaled = (nan_to_zero(x) / fixed.float()).clamp(-FP8_MAX[s.fmt], FP8_MAX[s.fmt])
        return {"codes": scaled.to(FP8_DTYPES[s.fmt]).view(torch.uint8)}

    def decode(self, parts, start=0, shared=None):
        scale = parts["scale"] if self.spec.fp8_scale == "token" else shared["scale"]
        return fp8_dequantize(parts["codes"], scale, self.spec.fmt)
