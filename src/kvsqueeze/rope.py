"""RoPE as transformers applies it to Llama-family models (half-split rotation), and its inverse.

A leaf module: the pre-RoPE key codec, calibration, folding and the static engine all rotate with these.
"""

from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The half-split RoPE convention of Llama-family models in transformers: (x1, x2) -> (-x2, x1)."""
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float) -> tuple[torch.Tensor, ...]:
    """cos, sin [T, D] as transformers computes them (float32 products of positions and inverse frequencies)."""
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


def undo_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scaling: float) -> torch.Tensor:
    """Inverse of :func:`apply_rope` (the rotation is orthogonal up to the attention scaling factor)."""
    return (x * cos - rotate_half(x) * sin) / (scaling * scaling)
