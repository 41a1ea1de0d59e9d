"""Calibrated per-layer tensors that change how a tensor is stored: channel permutation and clip ratios (SKVQ),
pre-RoPE static ranges and codebooks (KVQuant-style keys), invertible transforms.  Set on a QuantSpec's
``extras`` by calibration artifacts; read by the codecs.
"""

from __future__ import annotations

from typing import Any

import torch

from ..spec import QuantSpec
from .params import param_torch_dtype


class GroupExtras:
    """Calibrated tensors of one layer for :class:`PermutedGroupCodec`.

    perm: [H, D] long or None - stored channel j of KV head h is input channel ``perm[h, j]``.
    clip: [H, D // group] float or None - clip ratio of each group of the stored (permuted) channels.
    """

    def __init__(self, perm: torch.Tensor | None = None, clip: torch.Tensor | None = None):
        self.perm = None if perm is None else perm.long()
        self.inv = None if perm is None else torch.argsort(self.perm, dim=-1)
        self.clip = None if clip is None else clip.float()

    def label(self, spec: QuantSpec) -> str:
        bits = "tern" if spec.fmt == "ternary" else f"int{spec.bits}"
        parts = [f"{bits}/token{spec.group or 'all'}"]
        if self.perm is not None:
            parts.append("reorder")
        if self.clip is not None:
            parts.append(f"clip{float(self.clip.min()):.2f}-{float(self.clip.max()):.2f}")
        return "/".join(parts + [spec.param_dtype])

    def describe(self) -> dict[str, Any]:
        return {"kind": "skvq-group", "reorder": self.perm is not None,
                "clip": None if self.clip is None else [float(self.clip.min()), float(self.clip.max())]}

    def check(self, heads: int, head_dim: int, n_groups: int) -> None:
        if self.perm is not None and tuple(self.perm.shape) != (heads, head_dim):
            raise ValueError(f"channel permutation has shape {tuple(self.perm.shape)}, the model needs "
                             f"({heads}, {head_dim}) (kv heads, head_dim)")
        if self.clip is not None and tuple(self.clip.shape) != (heads, n_groups):
            raise ValueError(f"clip ratios have shape {tuple(self.clip.shape)}, the model needs "
                             f"({heads}, {n_groups}) (kv heads, groups per head)")


class PreRopeExtras:
    """Calibrated tensors of one layer for :class:`PreRopeKeyCodec`.

    lo, hi:    [H, D] static per-channel range of pre-RoPE keys (values outside are clamped or outliers).
    inv_freq:  [r/2] RoPE inverse frequencies of this layer (r = rotary_dim; r < D: partial rotary, the last D - r
               channels are not rotated); ``rope_scaling`` the attention scaling of the cos/sin tables.
    codebook:  [2**bits] sorted levels in [0, 1] (non-uniform, per layer) or None for a uniform grid.
    outliers:  channels per token and head kept exactly (fp16 value + uint8 index) in the sparse structure.
    bits:      code bits, or None: no quantization (pre-RoPE values stored in float32 - a test mode that must
               reproduce the plain cache).
    """

    def __init__(self, lo: torch.Tensor, hi: torch.Tensor, inv_freq: torch.Tensor, rope_scaling: float = 1.0,
                 codebook: torch.Tensor | None = None, outliers: int = 1, bits: int | None = 2,
                 param_dtype: str = "fp16"):
        pt = param_torch_dtype(param_dtype)
        self.lo, self.hi = lo.to(pt), hi.to(pt)
        self.inv_freq, self.rope_scaling = inv_freq.float(), float(rope_scaling)
        self.codebook = None if codebook is None else codebook.float()
        self.outliers, self.bits, self.param_dtype = int(outliers), bits, param_dtype
        if bits is not None and codebook is not None and codebook.numel() != 2 ** bits:
            raise ValueError(f"a {bits}-bit codebook has {2 ** bits} levels, got {codebook.numel()}")

    def label(self, spec: QuantSpec) -> str:
        if self.bits is None:
            return "prerope-fp"
        nuq = "nuq" if self.codebook is not None else "int"
        return f"prerope-{nuq}{self.bits}/channel-static/outliers{self.outliers}"

    def describe(self) -> dict[str, Any]:
        return {"kind": "kvquant-prerope", "bits": self.bits, "outliers_per_token": self.outliers,
                "non_uniform": self.codebook is not None}

    def check(self, heads: int, head_dim: int) -> None:
        if tuple(self.lo.shape) != (heads, head_dim) or tuple(self.hi.shape) != (heads, head_dim):
            raise ValueError(f"pre-RoPE key ranges have shape {tuple(self.lo.shape)}, the model needs "
                             f"({heads}, {head_dim}) (kv heads, head_dim)")
        if not 0 < self.inv_freq.numel() * 2 <= head_dim:  # fewer: partial rotary (the rest pass through)
            raise ValueError(f"RoPE table has {self.inv_freq.numel()} frequencies, head_dim {head_dim} needs "
                             f"1 to {head_dim // 2}")
        if not 0 <= self.outliers <= head_dim:
            raise ValueError(f"outliers per token must be in [0, {head_dim}], got {self.outliers}")


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
