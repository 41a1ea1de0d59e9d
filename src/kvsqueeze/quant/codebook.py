"""Data-oblivious codebook quantization of rotated head vectors (the reference; pure torch, plus numpy once).

A vector ``x`` [d] is stored as one code per coordinate of the rotated unit vector ``y = (x / |x|) @ R``
(:mod:`kvsqueeze.quant.rotation`) and one scale (fp16): the least-squares scale of the code vector, close to
``|x|``.  Once rotated, every coordinate of a unit vector in a generic direction follows the same law, so one
fixed scalar codebook serves every coordinate of every token with no calibration data: the Lloyd-Max quantizer (levels at the centroids of their cells, cell boundaries half-way
between levels, which is optimal for mean squared error) of

* ``"sphere"`` (default): the exact marginal of one coordinate of a uniformly random unit vector in d dimensions,
  density proportional to ``(1 - t^2)^((d - 3) / 2)`` on [-1, 1] - what ``y`` is when ``x``'s direction is
  random, and the law that the rotation is meant to produce;
* ``"gaussian"``: N(0, 1/d), its limit for large d (slightly heavier tails; at d = 64 the two codebooks differ
  in the third decimal).

Fractional bit widths mix two integer widths across rotated coordinates: the first ``n_hi`` coordinates get
``bits_hi = bits_lo + 1`` bits (coordinates are exchangeable after the rotation, so which ones does not matter).

An optional 1-bit residual sign sketch (QJL, Zandieh et al. 2024) stores ``sign(r @ S)`` for a fixed Gaussian
matrix S [d, m] and the residual norm ``|r|``; ``sqrt(pi/2) / m * |r| * sign(r S) @ S.T`` is then an unbiased
estimate of the residual in every direction, so inner products with any query are unbiased.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .nonfinite import saturate
from .packing import pack_bits, packed_nbytes, unpack_bits
from .rotation import rotate, rotation_matrix, unrotate

DENSITIES = ("sphere", "gaussian")
CODEBOOK_BITS = (1, 2, 3, 4)
_GRID = 1 << 20  # quadrature points of the density
_TOL = 1e-12  # the Lloyd iteration stops when no level moves more than this
_MAX_ITER = 200_000


@dataclass(frozen=True)
class Codebook:
    """A Lloyd-Max scalar quantizer.  ``levels`` sorted; ``thresholds`` the len(levels)-1 cell boundaries;
    ``mse`` the mean squared error per coordinate under the density; ``iterations`` of the Lloyd loop."""

    bits: int
    density: str
    dim: int
    levels: tuple[float, ...]
    thresholds: tuple[float, ...]
    mse: float
    iterations: int

    def levels_tensor(self, device: torch.device | str | None = None) -> Tensor:
        return torch.tensor(self.levels, dtype=torch.float32, device=device)

    def thresholds_tensor(self, device: torch.device | str | None = None) -> Tensor:
        return torch.tensor(self.thresholds, dtype=torch.float32, device=device)


def _density_grid(density: str, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """Grid and (unnormalised) density values, in units of a unit vector's coordinate."""
    if density == "gaussian":
        s = 1.0 / math.sqrt(dim)
        x = np.linspace(-12 * s, 12 * s, _GRID + 1)
        return x, np.exp(-0.5 * (x / s) ** 2)
    x = np.linspace(-1.0, 1.0, _GRID + 1)
    return x, np.clip(1.0 - x * x, 0.0, None) ** ((dim - 3) / 2)


def _cumulative(x: np.ndarray, f: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cumulative integrals of f, x f and x^2 f (trapezoid rule), f normalised to a probability density."""
    dx = x[1] - x[0]

    def cum(y: np.ndarray) -> np.ndarray:
        return np.concatenate([[0.0], np.cumsum((y[1:] + y[:-1]) * (dx / 2))])

    m0 = cum(f)
    f = f / m0[-1]
    return cum(f), cum(x * f), cum(x * x * f)


@functools.lru_cache(maxsize=64)
def lloyd_max(bits: int, dim: int = 64, density: str = "sphere") -> Codebook:
    """The Lloyd-Max codebook of ``2**bits`` levels for one coordinate of a rotated unit vector in ``dim``
    dimensions (see the module docstring for the densities); computed once per process by a deterministic Lloyd
    iteration from the quantile levels, kept exactly symmetric."""
    if bits not in CODEBOOK_BITS:
        raise ValueError(f"codebook bits must be one of {', '.join(map(str, CODEBOOK_BITS))}, got {bits!r}")
    if density not in DENSITIES:
        raise ValueError(f"unknown codebook density {density!r}; allowed: {', '.join(DENSITIES)}")
    if not isinstance(dim, int) or dim < 4:
        raise ValueError(f"codebook dimension must be an integer >= 4, got {dim!r}")
    x, f = _density_grid(density, dim)
    cf, cg, ch = _cumulative(x, f)
    n = 2 ** bits
    levels = np.interp((np.arange(n) + 0.5) / n, cf, x)  # start at the quantiles
    it, moved = 0, math.inf
    while moved >= _TOL and it < _MAX_ITER:
        t = np.concatenate([[x[0]], (levels[1:] + levels[:-1]) / 2, [x[-1]]])
        mass, first = np.diff(np.interp(t, x, cf)), np.diff(np.interp(t, x, cg))
        new = first / mass
        new = (new - new[::-1]) / 2  # the density is even: keep the codebook exactly antisymmetric
        moved = float(np.max(np.abs(new - levels)))
        levels, it = new, it + 1
    t = np.concatenate([[x[0]], (levels[1:] + levels[:-1]) / 2, [x[-1]]])
    mass = np.diff(np.interp(t, x, cf))
    first = np.diff(np.interp(t, x, cg))
    second = np.diff(np.interp(t, x, ch))
    mse = float(np.sum(second - 2 * levels * first + levels ** 2 * mass))
    return Codebook(bits, density, dim, tuple(float(v) for v in levels),
                    tuple(float(v) for v in t[1:-1]), mse, it)


# ------------------------------------------------------------------------------------------------ bit splits
@dataclass(frozen=True)
class BitSplit:
    """How ``dim`` rotated coordinates share a (possibly fractional) bit budget: the first ``n_hi`` coordinates
    take ``bits_hi`` bits, the other ``dim - n_hi`` take ``bits_lo``."""

    dim: int
    bits_lo: int
    bits_hi: int
    n_hi: int

    @property
    def n_lo(self) -> int:
        return self.dim - self.n_hi

    @property
    def code_bits(self) -> float:
        """Code bits per coordinate (parameters not included)."""
        return (self.n_hi * self.bits_hi + self.n_lo * self.bits_lo) / self.dim

    @property
    def nbytes(self) -> int:
        """Bytes of one vector's packed codes: the high-bit coordinates' bytes, then the low-bit ones'."""
        return (packed_nbytes(self.n_hi, self.bits_hi) if self.n_hi else 0) + \
            (packed_nbytes(self.n_lo, self.bits_lo) if self.n_lo else 0)


SPLIT_UNIT = 8  # both coordinate runs are multiples of 8, which every packed width (1, 2, 3, 4 bits) accepts


def split_bits(bits: float, dim: int) -> BitSplit:
    """The split of ``dim`` coordinates that spends exactly ``bits`` code bits per coordinate on average.

    ``bits`` in [1, 4]; its fractional part times ``dim`` must be a multiple of 8 (e.g. 2.5, 2.75, 3.25 for
    dim 64; any multiple of 1/8 for dim 64, of 1/16 for dim 128)."""
    if isinstance(bits, bool) or not isinstance(bits, int | float) or not 1 <= bits <= 4:
        raise ValueError(f"rotated codebook bits must be a number in [1, 4], got {bits!r}")
    if not isinstance(dim, int) or dim < 8 or dim & (dim - 1):
        raise ValueError(f"rotated codebook formats need a power-of-two head_dim >= 8, got {dim!r}")
    lo = int(math.floor(bits))
    n_hi = (bits - lo) * dim
    if abs(n_hi - round(n_hi)) > 1e-9 or round(n_hi) % SPLIT_UNIT:
        step = SPLIT_UNIT / dim
        raise ValueError(f"{bits} bits cannot be split over head_dim {dim}: use a multiple of {step:g} "
                         f"(e.g. {lo + step:g}, {lo + 2 * step:g})")
    n_hi = int(round(n_hi))
    if lo == 4:
        return BitSplit(dim, 4, 4, 0)
    return BitSplit(dim, lo, lo + 1, n_hi)


def _codebooks(split: BitSplit, density: str) -> tuple[Codebook, Codebook]:
    return lloyd_max(split.bits_hi, split.dim, density), lloyd_max(split.bits_lo, split.dim, density)


def _nearest(y: Tensor, cb: Codebook) -> Tensor:
    return torch.searchsorted(cb.thresholds_tensor(y.device), y.contiguous()).to(torch.uint8)


def codebook_quantize(y: Tensor, split: BitSplit, density: str = "sphere") -> Tensor:
    """Codes (uint8, [..., d]) of rotated unit vectors ``y``: nearest level of each coordinate's codebook."""
    hi, lo = _codebooks(split, density)
    return torch.cat([_nearest(y[..., :split.n_hi], hi), _nearest(y[..., split.n_hi:], lo)], dim=-1)


def codebook_values(codes: Tensor, split: BitSplit, density: str = "sphere") -> Tensor:
    """Levels (float32) of ``codes`` [..., d]: the rotated unit vectors as stored."""
    hi, lo = _codebooks(split, density)
    c = codes.long()
    return torch.cat([hi.levels_tensor(codes.device)[c[..., :split.n_hi]],
                      lo.levels_tensor(codes.device)[c[..., split.n_hi:]]], dim=-1)


def pack_split(codes: Tensor, split: BitSplit) -> Tensor:
    """Pack codes [..., d]: the high-bit run, then the low-bit run, each with :func:`pack_bits`."""
    out = []
    if split.n_hi:
        out.append(pack_bits(codes[..., :split.n_hi].contiguous(), split.bits_hi))
    if split.n_lo:
        out.append(pack_bits(codes[..., split.n_hi:].contiguous(), split.bits_lo))
    return torch.cat(out, dim=-1) if len(out) > 1 else out[0]


def unpack_split(packed: Tensor, split: BitSplit) -> Tensor:
    """Inverse of :func:`pack_split`."""
    if packed.shape[-1] != split.nbytes:
        raise ValueError(f"{split.dim} codes of {split.code_bits:g} bits take {split.nbytes} bytes, "
                         f"got {packed.shape[-1]}")
    nb = packed_nbytes(split.n_hi, split.bits_hi) if split.n_hi else 0
    out = []
    if split.n_hi:
        out.append(unpack_bits(packed[..., :nb], split.bits_hi, split.n_hi))
    if split.n_lo:
        out.append(unpack_bits(packed[..., nb:], split.bits_lo, split.n_lo))
    return torch.cat(out, dim=-1) if len(out) > 1 else out[0]


# ------------------------------------------------------------------------------------------------ vectors
def codebook_fit(y: Tensor, split: BitSplit, density: str = "sphere", scale_dtype: torch.dtype = torch.float16
                 ) -> tuple[Tensor, Tensor]:
    """Codes and scale of vectors ``y`` [..., d] already in the rotated space: (codes uint8 [..., d], scale
    [..., 1] in ``scale_dtype``).

    The codes are the nearest levels of the unit vector ``y / |y|``; the scale is the least-squares one for those
    levels, ``s = y . c / (c . c)`` with ``c = levels(codes)``, not ``|y|``: the orthogonal projection of ``y`` on
    the code vector, so ``|y - s c|`` is the smallest any scale of these codes gives (the decoder is the same,
    ``s * c``; ``s`` is close to ``|y|``)."""
    norm = y.norm(dim=-1, keepdim=True)
    codes = codebook_quantize(y / torch.where(norm > 0, norm, torch.ones_like(norm)), split, density)
    c = codebook_values(codes, split, density)
    # saturating: a huge vector's scale would overflow an fp16 store to inf (and decode to inf * 0 = NaN)
    return codes, saturate((y * c).sum(-1, keepdim=True) / (c * c).sum(-1, keepdim=True), scale_dtype)


def rotated_quantize(x: Tensor, split: BitSplit, rotation: Tensor, density: str = "sphere",
                     norm_dtype: torch.dtype = torch.float16) -> tuple[Tensor, Tensor]:
    """Quantize vectors ``x`` [..., d]: (codes uint8 [..., d], scale [..., 1] in ``norm_dtype``), the codes and
    least-squares scale (:func:`codebook_fit`) of ``x R``."""
    return codebook_fit(rotate(x.float(), rotation), split, density, norm_dtype)


def rotated_dequantize(codes: Tensor, norm: Tensor, split: BitSplit, rotation: Tensor,
                       density: str = "sphere") -> Tensor:
    """Vectors [..., d] float32 from codes and scales: ``scale * levels(codes) @ R.T``."""
    return unrotate(codebook_values(codes, split, density) * norm.float(), rotation)


def group_means(y: Tensor, group: int, dtype: torch.dtype = torch.float16) -> Tensor:
    """Per-channel means of ``y`` [..., T, d] over consecutive groups of ``group`` tokens: [..., T / group, d],
    rounded to ``dtype`` (``T`` must be a multiple of ``group``)."""
    *lead, t, d = y.shape
    if t % group:
        raise ValueError(f"centred rotated codes need whole groups of {group} tokens, got {t}")
    return saturate(y.reshape(*lead, t // group, group, d).mean(-2), dtype)


def expand_groups(m: Tensor, group: int) -> Tensor:
    """[..., T / group, X] -> [..., T, X]: each group's row repeated for its tokens (float32)."""
    *lead, n, d = m.shape
    return m.float().unsqueeze(-2).expand(*lead, n, group, d).reshape(*lead, n * group, d)


# ------------------------------------------------------------------------------------------------ sign sketch
@functools.lru_cache(maxsize=16)
def _sketch(d: int, m: int, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(d, m, generator=g, dtype=torch.float64).float()


def sketch_matrix(d: int, m: int | None = None, seed: int = 1) -> Tensor:
    """The fixed Gaussian projection S [d, m] (m = d by default) of the residual sign sketch (a copy)."""
    return _sketch(d, d if m is None else m, seed).clone()


def sign_sketch(r: Tensor, proj: Tensor, norm_dtype: torch.dtype = torch.float16) -> tuple[Tensor, Tensor]:
    """(bits uint8 in {0, 1} [..., m] = sign(r @ S) >= 0, |r| [..., 1] in ``norm_dtype``) of residuals ``r``."""
    z = torch.matmul(r.float(), proj.to(r.device))
    return (z >= 0).to(torch.uint8), saturate(r.float().norm(dim=-1, keepdim=True), norm_dtype)


def sketch_estimate(bits: Tensor, rnorm: Tensor, proj: Tensor) -> Tensor:
    """The residual estimate ``sqrt(pi/2) / m * |r| * sign @ S.T`` [..., d] (unbiased for every inner product)."""
    m = proj.shape[1]
    signs = bits.float() * 2 - 1
    return math.sqrt(math.pi / 2) / m * rnorm.float() * torch.matmul(signs, proj.to(bits.device).transpose(0, 1))


# the rotated format's fixed choices: part of the format, since changing one changes what stored codes mean
ROTATION_SEED = 0
SKETCH_SEED = 1
DENSITY = "sphere"  # codebook law of a rotated unit vector's coordinate
_TABLES: dict[tuple[int, float], Tensor] = {}


def rotated_kernel_table(head_dim: int, bits: float) -> Tensor:
    """float32 [1, 1, D + 2, max(D, 16)] for the C++ kernel: rows 0..D-1 the rotation R, row D the high-width
    levels, row D+1 the low-width levels of the rotated format with ``bits`` per coordinate (built once)."""
    key = (head_dim, float(bits))
    if key not in _TABLES:
        split = split_bits(bits, head_dim)
        t = torch.zeros(1, 1, head_dim + 2, max(head_dim, 16))
        t[0, 0, :head_dim, :head_dim] = rotation_matrix(head_dim, ROTATION_SEED)
        hi = lloyd_max(split.bits_hi, split.dim, DENSITY).levels_tensor()
        lo = lloyd_max(split.bits_lo, split.dim, DENSITY).levels_tensor()
        t[0, 0, head_dim, :hi.numel()] = hi
        t[0, 0, head_dim + 1, :lo.numel()] = lo
        _TABLES[key] = t
    return _TABLES[key]
