"""Invertible head_dim x head_dim transforms and their inverses (row-vector convention: ``x' = x @ A``).

Three families, all with an inverse that is available in closed form at every step of learning:

* :func:`rope_commuting` - the family that commutes with RoPE in the half-split convention of Llama-style
  models (channel ``i`` is paired with ``i + D/2`` and rotated by ``pos * inv_freq[i]``).  Writing each pair as
  a complex number ``z = x_i + 1j * x_{i+D/2}``, RoPE multiplies ``z`` by ``exp(1j * pos * theta_i)``; a transform
  that multiplies each pair by its own complex scalar ``exp(-u_i + 1j * phi_i)`` (a scaled 2x2 rotation) commutes
  with it at every position, so it can be folded into ``W_k`` *before* RoPE.  Its inverse multiplies by the
  reciprocal and its condition number is ``exp(max(u) - min(u))``.  Pairs whose frequencies coincide would also
  admit mixing between them (a complex matrix over the coinciding pairs); :func:`coinciding_frequencies` finds
  them, and this family does not use that freedom, so it commutes for any set of frequencies.
* :class:`GeneralTransform` - any invertible matrix reachable as ``A0 @ diag(exp(s)) @ (I + U V^T)`` with an
  orthogonal base ``A0`` (identity or a normalised Hadamard), inverted with the Woodbury identity (the
  Sherman-Morrison identity for rank 1): ``(I + U V^T)^-1 = I - U (I_r + V^T U)^-1 V^T``, only an ``r x r``
  solve.  It is invertible exactly while ``det(I_r + V^T U) != 0``; learning watches the condition number.
* :func:`hadamard` - the fixed orthogonal baseline (QuaRot-style).
"""

from __future__ import annotations

import math

import torch


def hadamard(d: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Normalised Sylvester Hadamard matrix [d, d] in ``dtype`` (orthogonal, symmetric); d must be a power of two.
    The project's one builder: the learned transforms' base and quant.rotation's fixed rotation (float64) use it."""
    if not isinstance(d, int) or d < 1 or d & (d - 1):
        raise ValueError(f"a Hadamard matrix needs a power-of-two head_dim, got {d!r}")
    h = torch.ones(1, 1, dtype=dtype)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / math.sqrt(d)


def rope_commuting(log_scale: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """Matrices [..., D, D] of the RoPE-commuting family for per-pair ``log_scale`` u and ``angle`` phi [..., D/2].

    ``x @ A`` multiplies pair i (channels i, i + D/2) by ``exp(-u_i) * exp(1j * phi_i)``: keys shrink where
    ``u > 0`` and the query side of the fold (``A^-T``) grows by the same factor, so scores are unchanged."""
    if log_scale.shape != angle.shape:
        raise ValueError(f"log_scale {tuple(log_scale.shape)} and angle {tuple(angle.shape)} must match")
    half = log_scale.shape[-1]
    r = torch.exp(-log_scale)
    c, s = r * torch.cos(angle), r * torch.sin(angle)
    a = torch.zeros(*log_scale.shape[:-1], 2 * half, 2 * half, dtype=log_scale.dtype, device=log_scale.device)
    i = torch.arange(half, device=log_scale.device)
    a[..., i, i] = c
    a[..., i + half, i + half] = c
    a[..., i, i + half] = s
    a[..., i + half, i] = -s
    return a


def rope_commuting_inverse(log_scale: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """Exact inverse of :func:`rope_commuting` (the reciprocal complex scalar per pair)."""
    return rope_commuting(-log_scale, -angle)


def coinciding_frequencies(inv_freq: torch.Tensor, rtol: float = 1e-6) -> list[list[int]]:
    """Groups of RoPE pairs with equal frequencies (only those with more than one pair)."""
    f = inv_freq.double().tolist()
    groups: list[list[int]] = []
    for i, x in enumerate(f):
        for g in groups:
            if abs(f[g[0]] - x) <= rtol * max(abs(x), 1e-30):
                g.append(i)
                break
        else:
            groups.append([i])
    return [g for g in groups if len(g) > 1]


def woodbury_inverse(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``(I + U V^T)^-1`` for U, V [..., D, r] by the Woodbury identity (Sherman-Morrison when r == 1)."""
    d, r = u.shape[-2], u.shape[-1]
    eye_r = torch.eye(r, dtype=u.dtype, device=u.device)
    eye_d = torch.eye(d, dtype=u.dtype, device=u.device)
    core = eye_r + v.transpose(-1, -2) @ u  # [..., r, r]
    return eye_d - u @ torch.linalg.solve(core, v.transpose(-1, -2))


def sherman_morrison_inverse(a_inv: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``(A + u v^T)^-1`` from ``A^-1`` and vectors u, v [D] (the identity the seed document builds on)."""
    au = a_inv @ u
    va = v @ a_inv
    denom = 1.0 + v @ au
    if abs(float(denom)) < 1e-12:
        raise ValueError(f"A + u v^T is singular: 1 + v^T A^-1 u = {float(denom):.3g}")
    return a_inv - torch.outer(au, va) / denom


def condition_number(a: torch.Tensor) -> torch.Tensor:
    """2-norm condition number of each matrix [..., D, D] (inf for a singular one)."""
    sv = torch.linalg.svdvals(a.double())
    return (sv[..., 0] / sv[..., -1]).float()


class GeneralTransform(torch.nn.Module):
    """Learnable ``A = A0 @ diag(exp(s)) @ (I + U V^T)`` per head, [H, D, D], with its Woodbury inverse.

    Starts at ``A0`` (U = 0, s = 0), i.e. identity or the normalised Hadamard; V starts small and random so the
    gradient of U is not zero."""

    def __init__(self, heads: int, dim: int, rank: int = 8, base: str = "identity", seed: int = 0):
        super().__init__()
        if base not in ("identity", "hadamard"):
            raise ValueError(f"unknown base {base!r}; allowed: identity, hadamard")
        if not 0 <= rank <= dim:
            raise ValueError(f"rank must be in [0, {dim}], got {rank}")
        a0 = torch.eye(dim) if base == "identity" else hadamard(dim)
        self.register_buffer("a0", a0.expand(heads, dim, dim).clone())
        gen = torch.Generator().manual_seed(seed)
        self.s = torch.nn.Parameter(torch.zeros(heads, dim))
        self.u = torch.nn.Parameter(torch.zeros(heads, dim, rank))
        self.v = torch.nn.Parameter(torch.randn(heads, dim, rank, generator=gen) / math.sqrt(dim))

    def matrix(self) -> torch.Tensor:
        eye = torch.eye(self.a0.shape[-1], dtype=self.a0.dtype)
        return self.a0 @ (torch.exp(self.s)[..., :, None] * (eye + self.u @ self.v.transpose(-1, -2)))

    def inverse(self) -> torch.Tensor:
        # (A0 D (I + UV^T))^-1 = (I + UV^T)^-1 D^-1 A0^T  (A0 orthogonal)
        return woodbury_inverse(self.u, self.v) * torch.exp(-self.s)[..., None, :] @ self.a0.transpose(-1, -2)


class RopeCommutingTransform(torch.nn.Module):
    """Learnable RoPE-commuting transform per head: per-pair log-scales and angles [H, D/2]."""

    def __init__(self, heads: int, dim: int, log_scale: torch.Tensor | None = None):
        super().__init__()
        if dim % 2:
            raise ValueError(f"RoPE pairs need an even head_dim, got {dim}")
        init = torch.zeros(heads, dim // 2) if log_scale is None else log_scale.float().clone()
        self.log_scale = torch.nn.Parameter(init)
        self.angle = torch.nn.Parameter(torch.zeros(heads, dim // 2))

    def matrix(self) -> torch.Tensor:
        return rope_commuting(self.log_scale, self.angle)

    def inverse(self) -> torch.Tensor:
        return rope_commuting_inverse(self.log_scale, self.angle)
