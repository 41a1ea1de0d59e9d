"""Bit packing: exact inverse, exact sizes, the documented byte layout."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsqueeze.quant import pack_bits, packed_nbytes, unpack_bits

UNIT = {1: 8, 2: 4, 3: 8, 4: 2, 5: 1, 6: 1, 7: 1, 8: 1}


@settings(max_examples=150, deadline=None)
@given(
    bits=st.integers(1, 8),
    lead=st.lists(st.integers(1, 4), min_size=0, max_size=3),
    units=st.integers(1, 12),
    seed=st.integers(0, 2**31 - 1),
)
def test_pack_unpack_identity(bits: int, lead: list[int], units: int, seed: int) -> None:
    n = units * UNIT[bits]
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (*lead, n), generator=gen, dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.shape == (*lead, packed_nbytes(n, bits))
    assert torch.equal(unpack_bits(packed, bits, n), codes)


@pytest.mark.parametrize("bits", range(1, 9))
def test_packed_nbytes(bits: int) -> None:
    n = 64
    assert packed_nbytes(n, bits) == (n * bits // 8 if bits in (1, 2, 3, 4, 8) else n)


def test_three_bit_is_dense() -> None:
    codes = torch.arange(8, dtype=torch.uint8)  # 0..7, first code in the lowest bits of a 24-bit word
    packed = pack_bits(codes, 3)
    assert packed.shape == (3,)
    word = sum(i << (3 * i) for i in range(8))
    assert packed.tolist() == [word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF]
    assert packed_nbytes(128, 3) == 48


def test_little_endian_within_byte() -> None:
    assert pack_bits(torch.tensor([1, 2], dtype=torch.uint8), 4).tolist() == [0x21]
    assert pack_bits(torch.tensor([1, 2, 3, 0], dtype=torch.uint8), 2).tolist() == [1 | 2 << 2 | 3 << 4]
    bits1 = torch.tensor([1, 0, 0, 0, 0, 0, 0, 1], dtype=torch.uint8)
    assert pack_bits(bits1, 1).tolist() == [0x81]


def test_extreme_codes_survive() -> None:
    for bits in range(1, 9):
        n = 8 * UNIT[bits]
        for v in (0, 2**bits - 1):
            codes = torch.full((3, n), v, dtype=torch.uint8)
            assert torch.equal(unpack_bits(pack_bits(codes, bits), bits, n), codes)


def test_non_contiguous_input() -> None:
    codes = torch.randint(0, 16, (4, 8, 6), dtype=torch.uint8).transpose(0, 2)  # last dim 4, strided
    assert torch.equal(unpack_bits(pack_bits(codes, 4), 4, 4), codes)
    c3 = torch.randint(0, 8, (8, 5), dtype=torch.uint8).t()
    assert torch.equal(unpack_bits(pack_bits(c3, 3), 3, 8), c3)


@pytest.mark.parametrize("bits,n", [(1, 12), (2, 6), (3, 12), (4, 3)])
def test_non_dividing_dim_raises(bits: int, n: int) -> None:
    with pytest.raises(ValueError, match="multiple of"):
        pack_bits(torch.zeros(2, n, dtype=torch.uint8), bits)
    with pytest.raises(ValueError, match="multiple of"):
        packed_nbytes(n, bits)


def test_bad_inputs_raise() -> None:
    with pytest.raises(TypeError):
        pack_bits(torch.zeros(8, dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="allowed"):
        pack_bits(torch.zeros(8, dtype=torch.uint8), 9)
    with pytest.raises(ValueError, match="bytes"):
        unpack_bits(torch.zeros(5, dtype=torch.uint8), 4, 8)
