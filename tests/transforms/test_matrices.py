"""Invertible transform families: RoPE commutation, closed-form inverses, conditioning."""

from __future__ import annotations

import pytest
import torch

from kvsqueeze.calibrate.fold import rope_commutes
from kvsqueeze.rope import apply_rope, rope_cos_sin
from kvsqueeze.transforms.matrices import (
    GeneralTransform,
    RopeCommutingTransform,
    coinciding_frequencies,
    condition_number,
    hadamard,
    rope_commuting,
    rope_commuting_inverse,
    sherman_morrison_inverse,
    woodbury_inverse,
)

D = 64
INV_FREQ = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))


def _random_commuting(heads: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(heads, D // 2, generator=g) * 0.7
    phi = torch.rand(heads, D // 2, generator=g) * 6.3
    return u, phi, rope_commuting(u, phi)


@pytest.mark.parametrize("seed", range(4))
def test_rope_commuting_family_commutes_with_rope_at_every_position(seed):
    _, _, a = _random_commuting(seed=seed)
    x = torch.randn(3, 200, D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    positions = torch.cat([torch.arange(100), torch.randint(100, 200_000, (100,))])
    cos, sin = rope_cos_sin(positions, INV_FREQ, 1.0)
    cos, sin = cos.double(), sin.double()
    lhs = apply_rope(x, cos, sin) @ a.double()  # rope first, then the transform (online)
    rhs = apply_rope(x @ a.double(), cos, sin)  # transform first (folded into W_k), then rope
    assert torch.allclose(lhs, rhs, atol=1e-9)
    assert all(rope_commutes(a[h], INV_FREQ) for h in range(3))


def test_general_matrices_do_not_commute_with_rope():
    assert not rope_commutes(hadamard(D), INV_FREQ)
    g = torch.Generator().manual_seed(1)
    assert not rope_commutes(torch.eye(D) + 0.1 * torch.randn(D, D, generator=g), INV_FREQ)


def test_rope_commuting_inverse_and_condition_number():
    u, phi, a = _random_commuting()
    inv = rope_commuting_inverse(u, phi)
    assert torch.allclose(a @ inv, torch.eye(D).expand(3, D, D), atol=1e-5)
    expected = torch.exp(u.amax(-1) - u.amin(-1))
    assert torch.allclose(condition_number(a), expected, rtol=1e-4)
    m = RopeCommutingTransform(3, D, u)
    assert torch.allclose(m.matrix() @ m.inverse(), torch.eye(D).expand(3, D, D), atol=1e-5)


def test_coinciding_frequencies_are_found():
    assert coinciding_frequencies(INV_FREQ) == []
    f = INV_FREQ.clone()
    f[5] = f[9]
    assert coinciding_frequencies(f) == [[5, 9]]


@pytest.mark.parametrize("rank", [1, 4, 16])
def test_woodbury_inverse_matches_linalg_inv(rank):
    g = torch.Generator().manual_seed(rank)
    u = torch.randn(2, D, rank, generator=g, dtype=torch.float64) * 0.3
    v = torch.randn(2, D, rank, generator=g, dtype=torch.float64) * 0.3
    m = torch.eye(D, dtype=torch.float64) + u @ v.transpose(-1, -2)
    assert torch.allclose(woodbury_inverse(u, v), torch.linalg.inv(m), atol=1e-9)


def test_sherman_morrison_matches_linalg_inv_and_refuses_singular_updates():
    g = torch.Generator().manual_seed(0)
    a = torch.eye(D, dtype=torch.float64) + 0.1 * torch.randn(D, D, generator=g, dtype=torch.float64)
    u, v = torch.randn(D, generator=g, dtype=torch.float64), torch.randn(D, generator=g, dtype=torch.float64)
    got = sherman_morrison_inverse(torch.linalg.inv(a), u, v)
    assert torch.allclose(got, torch.linalg.inv(a + torch.outer(u, v)), atol=1e-8)
    # I + u v^T with v^T u = -1 is singular
    u1 = torch.zeros(D, dtype=torch.float64)
    u1[0] = 1.0
    with pytest.raises(ValueError, match="singular"):
        sherman_morrison_inverse(torch.eye(D, dtype=torch.float64), u1, -u1)


@pytest.mark.parametrize("base", ["identity", "hadamard"])
def test_general_transform_inverse_stays_exact_after_updates(base):
    t = GeneralTransform(3, D, rank=4, base=base, seed=2)
    with torch.no_grad():
        t.u.normal_(0, 0.2)
        t.s.normal_(0, 0.3)
    assert torch.allclose(t.matrix() @ t.inverse(), torch.eye(D).expand(3, D, D), atol=1e-4)


def test_hadamard_is_orthogonal_and_needs_a_power_of_two():
    h = hadamard(D)
    assert torch.allclose(h @ h.T, torch.eye(D), atol=1e-6)
    with pytest.raises(ValueError, match="power-of-two"):
        hadamard(48)
