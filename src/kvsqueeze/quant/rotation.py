"""A fixed, data-oblivious orthogonal rotation of head vectors: a random sign flip, then a normalised Hadamard.

Row-vector convention, as everywhere in kvsqueeze: ``y = x @ R`` with ``R = diag(s) @ H / sqrt(d)``, s a fixed
random +-1 vector drawn from a seeded generator.  ``R`` is orthogonal, so ``x = y @ R.T`` and inner products are
unchanged (``q . k = (q R) . (k R)``).  The sign flip breaks the alignment between Hadamard rows and the few
large channels of real keys, so every rotated coordinate is a balanced mixture of all channels (near-Gaussian).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from ..transforms.matrices import hadamard


def sylvester_hadamard(d: int) -> Tensor:
    """Normalised Sylvester Hadamard matrix [d, d] in float64 (symmetric, orthogonal); ``d`` must be a power of
    two."""
    return hadamard(d, torch.float64)


def random_signs(d: int, seed: int) -> Tensor:
    """``d`` values in {-1, +1} (float64) from a torch generator seeded with ``seed``: the same on every machine."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (d,), generator=g, dtype=torch.int64).double() * 2 - 1


@functools.lru_cache(maxsize=32)
def _rotation(d: int, seed: int) -> Tensor:
    return (random_signs(d, seed)[:, None] * sylvester_hadamard(d)).float()


def rotation_matrix(d: int, seed: int = 0) -> Tensor:
    """The rotation ``R = diag(signs(seed)) @ H`` [d, d] float32 (computed once per (d, seed), returned as a copy)."""
    return _rotation(d, seed).clone()


def rotate(x: Tensor, r: Tensor) -> Tensor:
    """``x @ R`` over the last dim, in float32."""
    return torch.matmul(x.float(), r.to(x.device))


def unrotate(y: Tensor, r: Tensor) -> Tensor:
    """``y @ R.T``: the inverse of :func:`rotate` (R is orthogonal)."""
    return torch.matmul(y.float(), r.to(y.device).transpose(0, 1))
