"""A codec that stores keys or values after an invertible per-head transform (learned or fixed).

``encode(x)`` quantizes ``x @ A`` with an inner codec; ``decode`` returns ``decoded @ A^-1``.  For keys this is
exactly attention with queries multiplied by ``X = A^-T`` (``q . (k_hat A^-1) = (q A^-T) . k_hat``); for values it
is the output multiplied by ``Y^-1`` with ``Y = A``.  So a cache with this codec on the original model computes
what the folded model (``W_k -> W_k A``, ``W_q -> W_q A^-T``, ``W_v -> W_v A``, ``W_o -> A^-1 W_o``; see
:mod:`kvsqueeze.calibrate.fold`) computes with the inner codec alone, and transforms that cannot be folded
(keys mixed across RoPE pairs) run "online" this way.  Decoding costs a D x D product per token.
"""

from __future__ import annotations

from typing import Any

import torch

from ..spec import QuantSpec
from .codecs import Codec, PartLayout


class TransformExtras:
    """Per-layer transform tensors plus the inner codec's own extras (e.g. SKVQ's GroupExtras) or None.

    matrix, inverse: [H, D, D] float32 with ``x' = x @ matrix[h]``.  ``kind`` says which family it came from
    ("rope-commuting" can be folded before RoPE; "general" only after RoPE for keys, anywhere for values)."""

    def __init__(self, matrix: torch.Tensor, inverse: torch.Tensor, kind: str = "general", inner: Any = None,
                 name: str = "transform"):
        self.matrix = matrix.float()
        self.inverse = inverse.float()
        self.kind = kind
        self.inner = inner
        self.name = name

    def label(self, spec: QuantSpec) -> str:
        import dataclasses

        inner = dataclasses.replace(spec, extras=self.inner)
        return f"{self.name}+{inner.label()}"

    def describe(self) -> dict[str, Any]:
        d = {"kind": "transform", "family": self.kind, "name": self.name}
        if self.inner is not None and hasattr(self.inner, "describe"):
            d["inner"] = self.inner.describe()
        return d

    def check(self, heads: int, head_dim: int, max_condition: float = 1e4) -> None:
        from ..transforms.matrices import condition_number

        want = (heads, head_dim, head_dim)
        for what, t in (("matrix", self.matrix), ("inverse", self.inverse)):
            if tuple(t.shape) != want:
                raise ValueError(f"transform {what} has shape {tuple(t.shape)}, the model needs {want} "
                                 "(kv heads, head_dim, head_dim)")
            if not torch.isfinite(t).all():
                raise ValueError(f"transform {what} has non-finite entries")
        eye = torch.eye(head_dim)
        err = float((self.matrix.double() @ self.inverse.double() - eye).abs().max())
        if err > 1e-3:
            raise ValueError(f"transform and its stored inverse disagree: max |A A^-1 - I| = {err:.3g} "
                             "(> 1e-3): the artifact is corrupt or the matrix is not invertible")
        cond = float(condition_number(self.matrix).max())
        if not cond < max_condition:
            raise ValueError(f"transform is ill-conditioned: condition number {cond:.3g} (limit {max_condition:g})")


class TransformedCodec(Codec):
    """Inner codec applied to ``x @ A``; decode multiplies by ``A^-1``.  Same parts and bytes as the inner codec."""

    def __init__(self, spec: QuantSpec, head_dim: int, inner: Codec):
        self.spec, self.head_dim, self.inner = spec, head_dim, inner
        ex: TransformExtras = spec.extras
        self.matrix, self.inv = ex.matrix, ex.inverse

    def layout(self) -> dict[str, PartLayout]:
        return self.inner.layout()

    def _apply(self, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
        if x.shape[1] != m.shape[0]:
            raise ValueError(f"transform has {m.shape[0]} heads, the tensor has {x.shape[1]}")
        return torch.matmul(x.float(), m.to(x.device)[None])  # [B,H,T,D] @ [1,H,D,D]

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return self.inner.encode(self._apply(x, self.matrix).to(x.dtype))

    def decode(self, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        return self._apply(self.inner.decode(parts), self.inv)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        return self.inner.state_tensors()

    def select_batch(self, index: torch.Tensor) -> None:
        self.inner.select_batch(index)
