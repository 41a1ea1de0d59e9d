"""The one place that picks a codec for a key or value spec: plain formats, then the calibrated ones."""

from __future__ import annotations

import dataclasses

import torch

from ..quant.extras import GroupExtras, PreRopeExtras, TransformExtras
from ..spec import ROT_FORMATS, QuantSpec
from .codecs import Codec, Fp8Codec, FullCodec, IntChannelCodec, IntTokenCodec
from .codecs_calibrated import PermutedGroupCodec, PreRopeKeyCodec
from .codecs_rotated import RotatedCodec
from .codecs_transform import TransformedCodec


def make_codec(spec: QuantSpec, head_dim: int, dtype: torch.dtype) -> Codec:
    """The codec storing ``spec`` for vectors of ``head_dim`` channels of a model in ``dtype``."""
    ex = spec.extras
    if isinstance(ex, TransformExtras):  # a transform around any codec (inner extras, or a plain spec)
        if isinstance(ex.inner, PreRopeExtras):
            raise ValueError("a transform cannot wrap pre-RoPE keys (the codec would see transformed keys)")
        return TransformedCodec(spec, head_dim, make_codec(dataclasses.replace(spec, extras=ex.inner), head_dim,
                                                           dtype))
    if isinstance(ex, PreRopeExtras):
        return PreRopeKeyCodec(spec, head_dim, ex)
    if ex is not None and not isinstance(ex, GroupExtras):
        raise ValueError(f"unknown calibrated extras {type(ex).__name__}; allowed: GroupExtras, PreRopeExtras, "
                         "TransformExtras")
    if isinstance(ex, GroupExtras) or spec.fmt == "ternary":
        if spec.fmt not in ("int", "ternary") or spec.axis != "token":
            raise ValueError("calibrated group codecs store per-token integer or ternary codes; "
                             f"got fmt={spec.fmt!r}, axis={spec.axis!r}")
        return PermutedGroupCodec(spec, head_dim, ex)
    if spec.fmt == "none":
        return FullCodec(head_dim, dtype)
    if spec.fmt in ROT_FORMATS:
        return RotatedCodec(spec, head_dim)
    if spec.fmt == "int":
        return IntChannelCodec(spec, head_dim) if spec.axis == "channel" else IntTokenCodec(spec, head_dim)
    return Fp8Codec(spec, head_dim)
