"""Dense bit packing of uint8 codes along the last dim, vectorised (called on every decode step).

Densely packed widths: 1, 2, 4 bits (8 // bits codes per byte, first code in the lowest bits) and 3 bits (8 codes
in 3 bytes, read as one little-endian 24-bit word, first code in the lowest bits).  8-bit codes are already
bytes; 5-7-bit codes are stored one per byte (identity) - a dense 5-7-bit layout saves too little to be worth
the unaligned shifts.  Codes must already be < 2**bits; they are not masked.  Ternary codes (the 1.5-bit format)
are packed five per byte in base 3 by :func:`pack_ternary`.
"""

from __future__ import annotations

import torch
from torch import Tensor

# codes per packing unit and bytes per unit, for the densely packed widths
_UNITS: dict[int, tuple[int, int]] = {1: (8, 1), 2: (4, 1), 3: (8, 3), 4: (2, 1)}


def _check(bits: int, n: int) -> tuple[int, int] | None:
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"unsupported bits {bits!r}; allowed: 1, 2, 3, 4, 5, 6, 7, 8")
    unit = _UNITS.get(bits)
    if unit is not None and n % unit[0]:
        raise ValueError(f"{bits}-bit packing needs the packed dim to be a multiple of {unit[0]}, got {n}")
    return unit


def packed_nbytes(n_codes: int, bits: int) -> int:
    """Bytes that ``n_codes`` codes of ``bits`` bits take along the packed dim (``n_codes`` for 5-8 bits)."""
    unit = _check(bits, n_codes)
    return n_codes if unit is None else n_codes // unit[0] * unit[1]


def _shifts(bits: int, per: int, device: torch.device, dtype: torch.dtype) -> Tensor:
    return torch.arange(0, per * bits, bits, device=device, dtype=dtype)


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """Pack uint8 ``codes`` (values < 2**bits) along the last dim; the result has ``packed_nbytes`` there."""
    if codes.dtype != torch.uint8:
        raise TypeError(f"codes must be uint8, got {codes.dtype}")
    unit = _check(bits, codes.shape[-1])
    if unit is None:
        return codes
    per, nbytes = unit
    lead, n = codes.shape[:-1], codes.shape[-1]
    c = codes.reshape(*lead, n // per, per)
    if bits != 3:
        # fields do not overlap, so the sum is a bitwise OR
        return (c << _shifts(bits, per, c.device, torch.uint8)).sum(-1, dtype=torch.uint8)
    word = (c.to(torch.int32) << _shifts(3, 8, c.device, torch.int32)).sum(-1, dtype=torch.int32)
    b = (word.unsqueeze(-1) >> _shifts(8, 3, c.device, torch.int32)) & 0xFF
    return b.to(torch.uint8).reshape(*lead, n // per * nbytes)


def unpack_bits(packed: Tensor, bits: int, n: int, exportable: bool = False) -> Tensor:
    """Inverse of :func:`pack_bits`: ``n`` uint8 codes along the last dim.

    ``exportable``: the same codes without a bitwise AND, for graphs exported to ONNX below opset 18 (which has
    no BitwiseAnd): each field is shifted down and its higher bits are taken off by a subtraction."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed codes must be uint8, got {packed.dtype}")
    unit = _check(bits, n)
    expect = packed_nbytes(n, bits)
    if packed.shape[-1] != expect:
        raise ValueError(f"{n} {bits}-bit codes take {expect} bytes, but the packed dim has {packed.shape[-1]}")
    if unit is None:
        return packed
    lead = packed.shape[:-1]

    def low_bits(c: Tensor, width: int) -> Tensor:
        return c - ((c >> width) << width) if exportable else c & ((1 << width) - 1)

    if bits != 3:
        c = packed.unsqueeze(-1) >> _shifts(bits, 8 // bits, packed.device, torch.uint8)
        return low_bits(c, bits).reshape(*lead, n)
    b = packed.reshape(*lead, n // 8, 3).to(torch.int32) << _shifts(8, 3, packed.device, torch.int32)
    word = b.sum(-1, dtype=torch.int32)
    c = word.unsqueeze(-1) >> _shifts(3, 8, packed.device, torch.int32)
    return low_bits(c, 3).to(torch.uint8).reshape(*lead, n)


def unpack_bits_exportable(packed: Tensor, bits: int, n: int) -> Tensor:
    """:func:`unpack_bits` for ONNX graphs below opset 18 (no BitwiseAnd); the static engines' traced steps use it."""
    return unpack_bits(packed, bits, n, exportable=True)


TRITS_PER_BYTE = 5  # 3**5 = 243 <= 256: five ternary codes per byte, 1.6 bits per code
_POW3 = (1, 3, 9, 27, 81)


def ternary_nbytes(n: int) -> int:
    """Bytes that ``n`` ternary codes take: ceil(n / 5) (the last byte is zero-padded)."""
    return -(-n // TRITS_PER_BYTE)


def pack_ternary(codes: Tensor) -> Tensor:
    """Pack uint8 codes in {0, 1, 2} along the last dim, five per byte in base 3 (first code least significant)."""
    n = codes.shape[-1]
    pad = ternary_nbytes(n) * TRITS_PER_BYTE - n
    c = torch.nn.functional.pad(codes, (0, pad)).reshape(*codes.shape[:-1], -1, TRITS_PER_BYTE).to(torch.int32)
    w = torch.tensor(_POW3, dtype=torch.int32, device=codes.device)
    return (c * w).sum(-1).to(torch.uint8)


def unpack_ternary(packed: Tensor, n: int) -> Tensor:
    """Inverse of :func:`pack_ternary`: ``n`` codes along the last dim."""
    if packed.shape[-1] != ternary_nbytes(n):
        raise ValueError(f"{n} ternary codes take {ternary_nbytes(n)} bytes, got {packed.shape[-1]}")
    w = torch.tensor(_POW3, dtype=torch.int32, device=packed.device)
    c = (packed.to(torch.int32).unsqueeze(-1) // w) % 3
    return c.reshape(*packed.shape[:-1], -1)[..., :n].to(torch.uint8)
