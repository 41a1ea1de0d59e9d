"""A codec that stores keys or values after an invertible per-head transform (learned or fixed).

``encode(x)`` quantizes ``x @ A`` with an inner codec; ``decode`` returns ``decoded @ A^-1``.  For keys this is
exactly attention with queries multiplied by ``X = A^-T`` (``q . (k_hat A^-1) = (q A^-T) . k_hat``); for values it
is the output multiplied by ``Y^-1`` with ``Y = A``.  So a cache with this codec on the original model computes
what the folded model (``W_k -> W_k A``, ``W_q -> W_q A^-T``, ``W_v -> W_v A``, ``W_o -> A^-1 W_o``; see
:mod:`kvsqueeze.calibrate.fold`) computes with the inner codec alone, and transforms that cannot be folded
(keys mixed across RoPE pairs) run "online" this way.  Decoding costs a D x D product per token.
"""

from __future__ import annotations

import dataclasses

import torch

from ..quant.extras import TransformExtras
from ..quant.nonfinite import finite_vectors, saturate
from ..spec import QuantSpec
from .codecs import Codec, PartLayout


class TransformedCodec(Codec):
    """Inner codec applied to ``x @ A``; decode multiplies by ``A^-1``.  Same parts and bytes as the inner codec."""

    def __init__(self, spec: QuantSpec, head_dim: int, inner: Codec):
        self.spec, self.inner = spec, inner
        self.fmt = dataclasses.replace(inner.fmt, transformed=True)
        ex: TransformExtras = spec.extras
        self.matrix, self.inv = ex.matrix, ex.inverse

    def layout(self) -> dict[str, PartLayout]:
        return self.inner.layout()

    def _apply(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        if x.shape[1] != m.shape[0]:
            raise ValueError(f"transform has {m.shape[0]} heads, the tensor has {x.shape[1]}")
        return torch.matmul(x.float(), m.to(x.device)[None])  # [B,H,T,D] @ [1,H,D,D]

    def encode(self, x, start=0, shared=None):
        # an inf would turn every channel it is mixed into NaN; the product saturates at the model dtype's range
        return self.inner.encode(saturate(self._apply(finite_vectors(x), self.matrix), x.dtype), start, shared)

    def decode(self, parts, start=0, shared=None):
        return self._apply(self.inner.decode(parts, start, shared), self.inv)

    def constants(self) -> dict[str, torch.Tensor]:
        return self.inner.constants()
