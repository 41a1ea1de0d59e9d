"""The inline PTX that makes 2- and 4-bit codes into 16-bit operands (triton_common._planes_asm) checked without a
GPU: a small interpreter of the instructions it uses (mov, prmt, shr, lop3, fma on f16x2 / bf16x2) runs each
generated program on random bytes and parameters, and every output lane must hold the code the byte holds at that
plane (times a plus z with AFFINE), rounded once to the lane's dtype.  The GPU runs the same programs in the
conformance suite; this catches a wrong selector, shift, mask, magic number or operand number anywhere."""

from __future__ import annotations

import re

import pytest
import torch

from kvsqueeze.kernels.triton_common import _planes_asm

DTYPES = {1: torch.float16, 2: torch.bfloat16}


def _halves(word: int, dtype: torch.dtype) -> list[float]:
    """The two 16-bit lanes of a 32-bit register (lane 0 in the low half) as floats."""
    raw = torch.tensor([word & 0xFFFF, word >> 16], dtype=torch.int32).to(torch.int16)
    return raw.view(dtype).double().tolist()


def _word(lanes: list[float], dtype: torch.dtype) -> int:
    """Two float64 lanes rounded once to ``dtype`` (to nearest even) and packed as a 32-bit register."""
    bits = torch.tensor(lanes, dtype=torch.float64).to(dtype).view(torch.int16).int() & 0xFFFF
    return int(bits[0]) | int(bits[1]) << 16


def _run(asm: str, regs: dict[str, int], dtype: torch.dtype) -> dict[str, int]:
    """Interpret ``asm`` over ``regs`` ($n operands and locals, 32-bit values); returns the registers after."""
    def val(x: str) -> int:
        return int(x, 16) if x.startswith("0x") else int(x) if x.isdigit() else regs[x]

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if line in ("{", "}") or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        d, *src = [a.strip() for a in args.split(",")]
        if op == "mov.b32":
            regs[d] = val(src[0])
        elif op == "prmt.b32":  # result byte i = byte (sel >> 4 i) & 7 of {b, a}
            pool = val(src[0]) | val(src[1]) << 32
            sel = val(src[2])
            regs[d] = sum(((pool >> 8 * ((sel >> 4 * i) & 7)) & 0xFF) << 8 * i for i in range(4))
        elif op == "shr.b32":
            regs[d] = val(src[0]) >> val(src[1])
        elif op == "lop3.b32":
            a, b, c, lut = (val(s) for s in src)
            regs[d] = sum(((lut >> ((a >> i & 1) << 2 | (b >> i & 1) << 1 | (c >> i & 1))) & 1) << i
                          for i in range(32))
        elif re.fullmatch(r"fma\.rn\.(f16x2|bf16x2)", op):
            a, b, c = (_halves(val(s), dtype) for s in src)
            regs[d] = _word([a[i] * b[i] + c[i] for i in (0, 1)], dtype)
        else:
            raise AssertionError(f"instruction the interpreter does not know: {line}")
    return regs


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("h16", [1, 2])
@pytest.mark.parametrize("affine", [False, True])
def test_planes_asm_gives_each_planes_codes_in_lane_order(bits, h16, affine):
    dtype, per = DTYPES[h16], 8 // bits
    asm = _planes_asm(bits, h16, affine)
    g = torch.Generator().manual_seed(bits * 10 + h16 + affine)
    for _ in range(40):
        byte = torch.randint(0, 256, (4,), generator=g).tolist()  # elements 0..3 of the packed input register
        a = (torch.rand(4, generator=g, dtype=torch.float64) * 3 - 1.5).to(dtype).double().tolist()
        z = (torch.randn(4, generator=g, dtype=torch.float64) * 4).to(dtype).double().tolist()
        src = 2 * per
        regs = {f"${src}": sum(b << 8 * i for i, b in enumerate(byte))}
        if affine:  # a and z per element, two 16-bit lanes per register
            regs |= {f"${src + 1}": _word(a[:2], dtype), f"${src + 2}": _word(a[2:], dtype),
                     f"${src + 3}": _word(z[:2], dtype), f"${src + 4}": _word(z[2:], dtype)}
        out = _run(asm, regs, dtype)
        for plane in range(per):  # output tensor `plane`: registers $2 plane (elements 0, 1), $2 plane + 1 (2, 3)
            got = _halves(out[f"${2 * plane}"], dtype) + _halves(out[f"${2 * plane + 1}"], dtype)
            codes = [(b >> plane * bits) & ((1 << bits) - 1) for b in byte]
            want = [_halves(_word([c * a[i] + z[i], 0.0], dtype), dtype)[0] if affine else float(c)
                    for i, c in enumerate(codes)]
            assert got == want, (bits, h16, affine, plane, byte, got, want)
