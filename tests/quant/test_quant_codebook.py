"""Rotated codebook quantization: Lloyd-Max codebooks against published values, the rotation, bit splits, the
round trip's distortion against the codebook's own, and the residual sign sketch's unbiasedness."""

from __future__ import annotations

import math

import pytest
import torch

from kvsqueeze.quant.codebook import (
    codebook_values,
    lloyd_max,
    pack_split,
    rotated_dequantize,
    rotated_quantize,
    sign_sketch,
    sketch_estimate,
    sketch_matrix,
    split_bits,
    unpack_split,
)
from kvsqueeze.quant.rotation import rotation_matrix, sylvester_hadamard

# Lloyd-Max quantizers of N(0, 1) (Max 1960): positive levels and mean squared error
GAUSSIAN = {
    1: ((math.sqrt(2 / math.pi),), 0.3634),
    2: ((0.4528, 1.5104), 0.1175),
    3: ((0.2451, 0.7560, 1.3439, 2.1520), 0.03455),
    4: ((0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6181, 2.0690, 2.7326), 0.009497),
}


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_gaussian_codebook_matches_published_values(bits):
    cb = lloyd_max(bits, 64, "gaussian")
    sigma = 1 / math.sqrt(64)  # levels are in units of a unit vector's coordinate, N(0, 1/d)
    levels, mse = GAUSSIAN[bits]
    got = [v / sigma for v in cb.levels]
    assert len(got) == 2 ** bits and got == sorted(got)
    assert got[2 ** (bits - 1):] == pytest.approx(levels, abs=2e-4)
    assert got[:2 ** (bits - 1)] == pytest.approx([-v for v in reversed(levels)], abs=2e-4)
    assert cb.mse / sigma ** 2 == pytest.approx(mse, rel=1e-3)
    # thresholds are the midpoints between levels (the Lloyd-Max optimality condition)
    assert list(cb.thresholds) == pytest.approx([(a + b) / 2 for a, b in zip(cb.levels, cb.levels[1:])])


def test_sphere_codebook_tends_to_the_gaussian_one():
    for bits in (2, 3):
        big = lloyd_max(bits, 4096, "sphere")
        assert [v * 64 for v in big.levels[2 ** (bits - 1):]] == pytest.approx(GAUSSIAN[bits][0], abs=1e-3)
    # at d = 64 the sphere marginal has lighter tails: outer levels and distortion slightly smaller
    s, g = lloyd_max(3, 64, "sphere"), lloyd_max(3, 64, "gaussian")
    assert s.levels[-1] < g.levels[-1] and s.mse < g.mse


def test_distortion_decreases_with_bits_and_codebooks_are_cached():
    mses = [lloyd_max(b, 64).mse * 64 for b in (1, 2, 3, 4)]
    assert all(a > 2.5 * b for a, b in zip(mses, mses[1:]))  # each bit cuts the MSE by ~3.5-4x
    assert lloyd_max(3, 64) is lloyd_max(3, 64)


def test_codebook_errors():
    with pytest.raises(ValueError, match="allowed: sphere, gaussian"):
        lloyd_max(2, 64, "laplace")
    with pytest.raises(ValueError, match="1, 2, 3, 4"):
        lloyd_max(5, 64)


def test_rotation_is_orthogonal_deterministic_and_seeded():
    r = rotation_matrix(64)
    torch.testing.assert_close(r @ r.T, torch.eye(64), atol=1e-6, rtol=0)
    assert torch.equal(r, rotation_matrix(64, 0))
    assert not torch.equal(r, rotation_matrix(64, 1))
    signs = r @ sylvester_hadamard(64).float().T  # R = diag(+-1) H, so R H^T is that diagonal
    torch.testing.assert_close(signs, torch.diag(torch.diagonal(signs)), atol=1e-6, rtol=0)
    assert set(torch.diagonal(signs).round().tolist()) == {-1.0, 1.0}
    with pytest.raises(ValueError, match="power-of-two"):
        rotation_matrix(48)


@pytest.mark.parametrize("bits,expect", [(2.75, (2, 3, 48)), (3, (3, 4, 0)), (4, (4, 4, 0)), (1.5, (1, 2, 32)),
                                         (3.125, (3, 4, 8))])
def test_split_bits(bits, expect):
    sp = split_bits(bits, 64)
    assert (sp.bits_lo, sp.bits_hi, sp.n_hi) == expect
    assert sp.code_bits == pytest.approx(bits)
    assert sp.nbytes * 8 == pytest.approx(bits * 64)


@pytest.mark.parametrize("bits", [2.7, 0.5, 4.5])
def test_split_bits_errors(bits):
    with pytest.raises(ValueError, match="multiple of 0.125|in \\[1, 4\\]"):
        split_bits(bits, 64)


@pytest.mark.parametrize("bits", [1, 1.5, 2.25, 2.75, 3, 3.5, 4])
def test_pack_split_round_trip(bits):
    sp = split_bits(bits, 64)
    g = torch.Generator().manual_seed(0)
    codes = torch.cat([torch.randint(0, 2 ** sp.bits_hi, (5, sp.n_hi), generator=g),
                       torch.randint(0, 2 ** sp.bits_lo, (5, sp.n_lo), generator=g)], -1).to(torch.uint8)
    packed = pack_split(codes, sp)
    assert packed.shape == (5, sp.nbytes)
    assert torch.equal(unpack_split(packed, sp), codes)


@pytest.mark.parametrize("bits", [2, 2.5, 3, 4])
def test_round_trip_distortion_is_the_codebooks(bits):
    """Random directions (the model the codebook is optimal for): the relative MSE of the round trip equals the
    codebook's distortion per coordinate times d, mixed over the split (a little less: the stored scale is the
    least-squares one for the codes, which is never worse than the norm)."""
    d, sp = 64, split_bits(bits, 64)
    x = torch.randn(20000, d, generator=torch.Generator().manual_seed(1)) * 3
    r = rotation_matrix(d)
    codes, norm = rotated_quantize(x, sp, r)
    xh = rotated_dequantize(codes, norm, sp, r)
    rel = float(((xh - x) ** 2).sum(-1).mean() / (x ** 2).sum(-1).mean())
    expect = (sp.n_hi * lloyd_max(sp.bits_hi, d).mse + sp.n_lo * lloyd_max(sp.bits_lo, d).mse)
    assert 0.9 * expect < rel < 1.03 * expect
    xn = rotated_dequantize(codes, x.norm(dim=-1, keepdim=True), sp, r)  # the same codes scaled by the norm
    assert rel < float(((xn - x) ** 2).sum(-1).mean() / (x ** 2).sum(-1).mean())
    c = codebook_values(codes, sp)
    ls = ((x @ r) * c).sum(-1) / (c * c).sum(-1)
    torch.testing.assert_close(norm.float().squeeze(-1), ls, rtol=1e-3, atol=0)


def test_sign_sketch_is_unbiased():
    """E_S[<q, r_hat>] = <q, r> over the random projection (QJL); one fixed S is a single draw."""
    g = torch.Generator().manual_seed(2)
    r, q = torch.randn(64, generator=g), torch.randn(64, generator=g)
    est = []
    for seed in range(400):
        s = sketch_matrix(64, seed=seed + 10)
        bits, rn = sign_sketch(r, s, torch.float32)
        est.append(float(q @ sketch_estimate(bits, rn, s)))
    mean, sd = sum(est) / len(est), torch.tensor(est).std().item()
    assert abs(mean - float(q @ r)) < 4 * sd / math.sqrt(len(est))
