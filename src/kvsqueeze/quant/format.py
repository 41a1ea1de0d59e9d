"""The storage-format layer: one frozen description of how a tensor of keys or values is stored.

A :class:`StorageFormat` is what every layer above reads: codecs adapt a format to tensors (encode/decode),
the block store allocates its :meth:`~StorageFormat.parts`, kernels read the stored parts by the format's fields
and nothing else.  It is derived from a :class:`~kvsqueeze.spec.QuantSpec` (the user-facing setting) and the
model's head_dim and dtype by :func:`storage_format`; calibrated extras only set the flags saying what the
kernels' plain layouts cannot express (a channel permutation, per-group clip ratios, a transform, pre-RoPE keys).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..spec import ROT_FORMATS, QuantSpec
from .extras import GroupExtras, PreRopeExtras, TransformExtras
from .packing import packed_nbytes, ternary_nbytes
from .params import param_torch_dtype

KINDS = ("fp", "int", "fp8", "ternary", "rot", "rot-qjl")
ZERO_DOMAINS = ("float", "code")  # value = code * scale + zero (float zero) or (code - zero) * scale (code zero)


@dataclass(frozen=True)
class PartLayout:
    """One stored tensor of a format: shape after [B, H, rows], dtype, tokens per row, and its byte kind."""

    tail: tuple[int, ...]
    dtype: torch.dtype
    tokens_per_row: int  # 1 for per-token data, G for per-channel parameters of G-token groups
    kind: str  # "codes" | "params" | "fp"


@dataclass(frozen=True)
class StorageFormat:
    """How one of keys or values is stored.

    kind:         "fp" (the model's dtype as is), "int" (affine integer codes), "fp8" (scaled float8), "ternary",
                  "rot" / "rot-qjl" (rotated Lloyd-Max codebook codes and one scale per token; docs/rotated.md;
                  axis "channel": centred by a per-channel mean per ``group`` tokens).
    bits:         code width (the dtype's width for "fp", 8 for "fp8", 1.6 packed for "ternary" -> reported as 2;
                  fractional for "rot": a split of whole widths over the rotated coordinates).
    axis / group: "token" - parameters per token over ``group`` channels; "channel" - per channel over ``group``
                  tokens (tokens are then stored ``group`` at a time).
    symmetric:    absmax codes centred on zero, no zero-point stored.
    zero_domain:  how a stored zero-point enters the value (see :data:`ZERO_DOMAINS`); the cache stores float zeros.
    fp8_variant / fp8_scale: "e4m3"/"e5m2" and the scale granularity ("token", "head", "tensor").
    clip:         the scalar clip ratio the encoder applies to each group's range (decoding does not depend on it).
    permuted, calibrated_clip, transformed, pre_rope: what calibrated extras add (a channel permutation undone on
                  decode; codes from the calibrated clipped quantizer with per-group ratios; an invertible transform;
                  keys stored before RoPE); the fast kernels read only plain formats, the rest take the reference.
    """

    kind: str
    head_dim: int
    bits: int | float
    param_dtype: torch.dtype | None = None
    axis: str = "token"
    group: int = 1
    symmetric: bool = False
    zero_domain: str = "float"
    fp_dtype: torch.dtype = torch.float32
    fp8_variant: str = ""
    fp8_scale: str = "token"
    clip: float = 1.0
    permuted: bool = False
    calibrated_clip: bool = False
    transformed: bool = False
    pre_rope: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown storage kind {self.kind!r}; allowed: {', '.join(KINDS)}")
        if self.zero_domain not in ZERO_DOMAINS:
            raise ValueError(f"unknown zero-point domain {self.zero_domain!r}; allowed: {', '.join(ZERO_DOMAINS)}")

    @property
    def plain(self) -> bool:
        """True when the stored parts alone (codes, scale, zero) define the values: what fast kernels read."""
        return not (self.permuted or self.calibrated_clip or self.transformed or self.pre_rope)

    @property
    def token_group(self) -> int:
        """Tokens that must be present before they can be stored together (1 for per-token layouts)."""
        return self.group if (self.kind in ("int", "rot") and self.axis == "channel") else 1

    @property
    def fixed_scale(self) -> bool:
        """fp8 with one scale per head or per tensor, fixed by the first tokens stored (kept as shared state)."""
        return self.kind == "fp8" and self.fp8_scale != "token"

    def code_bytes(self) -> int:
        """Bytes of one token's codes."""
        if self.kind == "ternary":
            return ternary_nbytes(self.head_dim)
        if self.kind == "fp8":
            return self.head_dim
        return packed_nbytes(self.head_dim, self.bits)

    def parts(self) -> dict[str, PartLayout]:
        """The stored tensors of a plain layout, by part name (calibrated codecs may add their own)."""
        d, g = self.head_dim, self.group
        if self.kind == "fp":
            return {"x": PartLayout((d,), self.fp_dtype, 1, "fp")}
        out = {"codes": PartLayout((self.code_bytes(),), torch.uint8, 1, "codes")}
        if self.kind == "fp8":
            if not self.fixed_scale:
                out["scale"] = PartLayout((1,), self.param_dtype, 1, "params")
            return out
        per_channel = self.kind == "int" and self.axis == "channel"
        params = PartLayout((d,), self.param_dtype, g, "params") if per_channel else \
            PartLayout((d // g,), self.param_dtype, 1, "params")
        out["scale"] = params
        if not self.symmetric:
            out["zero"] = params
        return out


def storage_format(spec: QuantSpec, head_dim: int, dtype: torch.dtype) -> StorageFormat:
    """The storage format of ``spec`` for vectors of ``head_dim`` channels of a model in ``dtype``."""
    if spec.fmt == "none":
        return StorageFormat("fp", head_dim, torch.finfo(dtype).bits, fp_dtype=dtype)
    ex = spec.extras
    flags = {}
    while isinstance(ex, TransformExtras):
        flags["transformed"] = True
        ex = ex.inner
    if isinstance(ex, PreRopeExtras):
        kind = "int" if ex.bits else "fp"  # un-quantized pre-RoPE keys (an ablation) are stored in float32
        return StorageFormat(kind, head_dim, ex.bits or 32, None, axis="channel", pre_rope=True, **flags)
    if isinstance(ex, GroupExtras):
        flags["permuted"] = ex.perm is not None
    pdtype = param_torch_dtype(spec.param_dtype)
    if spec.fmt in ROT_FORMATS:
        if spec.axis == "channel":  # centred: a mean per channel per group of spec.group tokens
            return StorageFormat(spec.fmt, head_dim, spec.bits, pdtype, axis="channel", group=spec.group, **flags)
        return StorageFormat(spec.fmt, head_dim, spec.bits, pdtype, group=head_dim, **flags)
    if spec.fmt.startswith("fp8"):
        return StorageFormat("fp8", head_dim, 8, pdtype, fp8_variant=spec.fmt[4:], fp8_scale=spec.fp8_scale,
                             **flags)
    if spec.fmt == "ternary" or ex is not None:
        # SKVQ's group codec: the clipped quantizer (per-group ratios when calibrated), always a zero-point
        group = head_dim if spec.group is None else spec.group
        kind = "ternary" if spec.fmt == "ternary" else "int"
        return StorageFormat(kind, head_dim, 2 if kind == "ternary" else spec.bits, pdtype, group=group,
                             clip=spec.clip, calibrated_clip=True, **flags)
    group = spec.group if spec.axis == "channel" else spec.channel_group(head_dim)
    return StorageFormat("int", head_dim, spec.bits, pdtype, axis=spec.axis, group=group,
                         symmetric=spec.symmetric, clip=spec.clip, **flags)
