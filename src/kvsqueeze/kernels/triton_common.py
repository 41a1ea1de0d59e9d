"""What the Triton kernels share: availability, the loader of packed or full-precision token rows, argument helpers.

Imported by :mod:`triton_decode` (few queries), :mod:`triton_prefill` (query tiles) and :mod:`triton_pack`; it
imports none of them.  Importing it without Triton works (``HAS_TRITON`` is then False).

Token rows are addressed as ``slot * s_slot + b * s_b + h * s_h + row * s_row`` in every layout the kernels read:
a pool of blocks ``[slots, B, H, rows, ...]`` (``PAGED``: token ``u`` of the store lies in slot
``table[u // BLK]``, row ``u % BLK``; see cache/pool.py), one stored block ``[B, H, rows, ...]`` or a full-precision
segment ``[B, H, n, D]`` (slot 0, row = token).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import NamedTuple

import torch

from ..cache.plan import EXACT, PoolRun, SegmentPlan
from ..quant.codebook import rotated_kernel_table, split_bits
from ..quant.format import StorageFormat

try:  # Triton is optional
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised where Triton is missing
    HAS_TRITON = False

PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
MIN_DOT = 16  # tl.dot's least dimension: query tiles, token tiles and head_dim are at least this
FP8_KINDS = {"e4m3": 3, "e5m2": 4}
# 2- and 4-bit codes become the dots' 16-bit operands by bit operations (codes16): no integer-to-float conversion
# (a quarter-rate pipe on Hopper) and no float32 round trip; KVSQUEEZE_TRITON_CODES16=0 turns it off (A/B on a GPU)
CODES16 = os.environ.get("KVSQUEEZE_TRITON_CODES16", "1") != "0"


class Side(NamedTuple):
    """A side's layout as the kernels' constants: kind (see load_rows: 0 full precision, 1/2 integer per token /
    per channel, 3/4 fp8, 5/6 rotated codebook plain / centred), bits (rotated: the low width), group, symmetric,
    and for rotated codes how many coordinates take the high width and the C++ kernel's rotation + level table."""

    kind: int
    bits: int
    group: int
    sym: bool
    nhi: int = 0
    table: torch.Tensor | None = None

    @property
    def rotated(self) -> bool:
        return self.kind >= 5

    def consts(self, p: str) -> dict:
        return {f"{p}KIND": self.kind, f"{p}BITS": self.bits, f"{p}G": self.group, f"{p}SYM": self.sym,
                f"{p}NHI": self.nhi}


FP_SIDE = Side(0, 16, 1, False)


def codes16(dot: int) -> dict[str, int]:
    """The kernels' KH16 and VH16 constants for a launch whose products take ``dot`` operands (dot_kind): 1 / 2
    where a side's 2- and 4-bit codes are made into the query's fp16 / bf16 from their bits (never under the
    interpreter, where DOT is 0 and inline PTX cannot run), 0 where they take the float32 path.  Raw codes are
    exact in either; codes dequantized in the operand dtype (load_rows: a * c + z in one fma) only for fp16, whose
    11 bits keep the parameters' rounding below the float32 path's: bf16 parameters moved kivi-2's 32k outputs by
    1.7x bf16 SDPA's own error on an H200 (2026-11-27), and fp16 operands in a bf16 model overflow past 65504
    (tests/robustness/test_nonfinite.py puts 1e30 in a value), so bf16 models dequantize through float32."""
    on = CODES16 and dot > 0
    return {"KH16": dot if on else 0, "VH16": dot if on else 0}


def _planes_asm(bits: int, h16: int, affine: bool) -> str:
    """PTX for ``tl.inline_asm_elementwise(..., pack=4)``: 4 bytes of ``bits``-bit codes (one 32-bit register,
    byte i holding codes 8/bits i .. , the first in the lowest bits) -> one output per code position in a byte, each
    2 registers of 16-bit values.  A byte goes to the low half of a 16-bit lane (prmt), a code is masked into the
    mantissa of the magic number M (lop3: fp16 1024 + c, bf16 128 + c, exact for codes under 128), M is subtracted
    exactly (fma x * 1 - M), and with ``affine`` the result is c * a + z (one fma, parameters per byte pair)."""
    per = 8 // bits
    ty = "f16x2" if h16 == 1 else "bf16x2"
    magic, neg = ("0x64006400", "0xE400E400") if h16 == 1 else ("0x43004300", "0xC300C300")
    one = "0x3C003C00" if h16 == 1 else "0x3F803F80"
    mask = f"0x{(1 << bits) - 1:04X}{(1 << bits) - 1:04X}"
    src = 2 * per  # the codes' register; then a (2 registers), z (2)
    lines = ["{", ".reg .b32 m, n, o, x0, x1, t;", f"mov.b32 m, {magic};", f"mov.b32 n, {neg};",
             f"mov.b32 o, {one};", f"prmt.b32 x0, ${src}, 0, 0x4140;", f"prmt.b32 x1, ${src}, 0, 0x4342;"]
    for k in range(per):
        for i in (0, 1):
            x = f"x{i}"
            if k:
                lines.append(f"shr.b32 t, {x}, {k * bits};")
                x = "t"
            lines.append(f"lop3.b32 t, {x}, {mask}, m, 0xEA;")  # (x & mask) | m
            out = f"${2 * k + i}"
            if affine:
                lines += [f"fma.rn.{ty} t, t, o, n;", f"fma.rn.{ty} {out}, t, ${src + 1 + i}, ${src + 3 + i};"]
            else:
                lines.append(f"fma.rn.{ty} {out}, t, o, n;")
    return "\n".join(lines + ["}"])


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def dot_kind(dtype: torch.dtype) -> int:
    """The DOT constant of the kernels for queries of ``dtype``: 1 / 2 fp16 / bf16 operands, 0 float32 (also
    under the interpreter, whose 16-bit dot gives wrong results)."""
    return 0 if interpreting() else {torch.float16: 1, torch.bfloat16: 2}.get(dtype, 0)


def dot_head_dim(d: int) -> bool:
    """Whether the kernels take this head_dim: a power of two (tile shapes) of at least MIN_DOT (tl.dot)."""
    return d >= MIN_DOT and not d & (d - 1)


def available() -> bool:
    """Triton importable and a CUDA device present (or the Triton interpreter switched on)."""
    return HAS_TRITON and (torch.cuda.is_available() or interpreting())


if HAS_TRITON:

    @triton.jit
    def dot(a, b, DOT: tl.constexpr):
        """a [M, K] @ b [K, N] in float32 on the matrix units: operands in fp16 / bf16 (DOT 1 / 2, the model's
        dtype: the tensor cores' rate) or float32 without TF32 (DOT 0: float32 models, and the interpreter, whose
        16-bit dot is wrong)."""
        if DOT == 1:
            return tl.dot(a.to(tl.float16), b.to(tl.float16))
        elif DOT == 2:
            return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
        else:
            return tl.dot(a, b, input_precision="ieee")

    @triton.jit
    def dot_acc(a, b, acc, DOT: tl.constexpr):
        """acc + a @ b, the sum taken by the matrix units (no separate pass over acc); operands as ``dot``."""
        if DOT == 1:
            out = tl.dot(a.to(tl.float16), b.to(tl.float16), acc)
        elif DOT == 2:
            out = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
        else:
            out = tl.dot(a, b, acc, input_precision="ieee")
        return out

    @triton.jit
    def _affine(s, z, BITS: tl.constexpr, SYM: tl.constexpr):
        # value = code * a + c for every integer layout (mirrors quant.integer.dequantize_groups)
        if SYM:
            if BITS == 1:
                return 2.0 * s, -s
            return s, -(2 ** (BITS - 1)) * s
        return s, z

    @triton.jit
    def token_rows(t, t_ok, first, table_ptr, b, h, s_slot, s_b, s_h, s_row,
                   PAGED: tl.constexpr, BLK: tl.constexpr, PER_ROW: tl.constexpr):
        """int64 offsets of tokens ``t`` (a vector) of sequence b, head h; PER_ROW tokens share a row (the
        parameters of per-channel groups).  Token indices are never negative: taken as unsigned, division and
        remainder by the constant block and row sizes need no sign fix-ups (a shift and a mask for powers of two;
        the signed ones cost ~100 instructions per 32-token tile at one warp for the 1-byte formats)."""
        if PAGED:
            u = (first + t).to(tl.uint32)
            slot = tl.load(table_ptr + (u // BLK).to(tl.int32), mask=t_ok, other=0).to(tl.int64)
            row = (u % BLK) // PER_ROW
        else:
            slot = tl.zeros_like(t).to(tl.int64)
            row = t.to(tl.uint32) // PER_ROW
        return slot * s_slot + b.to(tl.int64) * s_b + h.to(tl.int64) * s_h + row.to(tl.int64) * s_row

    @triton.jit
    def _codes(x_ptr, xo, i, base, t_ok, c_ok, BITS: tl.constexpr):
        """int32 codes of elements ``i`` (a vector) of the rows at ``xo``, packed from byte ``base`` on as
        pack_bits packs BITS-bit codes; ``c_ok`` masks elements that are not in this run."""
        ok = t_ok[:, None] & c_ok[None, :]
        if BITS == 3:  # 8 codes in a little-endian 24-bit word (3 bytes); a code may straddle two bytes
            bit = (i % 8) * 3
            idx = base + (i // 8) * 3 + bit // 8
            sh = bit % 8
            lo = tl.load(x_ptr + xo[:, None] + idx[None, :], mask=ok, other=0).to(tl.int32)
            hi = tl.load(x_ptr + xo[:, None] + (idx + 1)[None, :], mask=ok & (sh > 5)[None, :], other=0).to(tl.int32)
            return ((lo | (hi << 8)) >> sh[None, :]) & 7
        PER: tl.constexpr = 8 // BITS  # codes per byte (one for 5-8 bits), the first in the lowest bits
        byte = tl.load(x_ptr + xo[:, None] + (base + i // PER)[None, :], mask=ok, other=0).to(tl.int32)
        return (byte >> ((i % PER) * BITS)[None, :]) & ((1 << BITS) - 1)

    @triton.jit
    def _row_codes(x_ptr, xo, t_ok, BITS: tl.constexpr, D: tl.constexpr):
        """int32 codes [BT, D] of whole rows at ``xo`` for BITS in 1, 2, 4, 8: each row's D * BITS / 8 bytes read
        once, contiguous (vector loads), and split in registers: byte j holds channels PER j .. PER j + PER - 1,
        the first in its lowest bits (pack_bits), put back in channel order by joins (no gather per channel)."""
        PER: tl.constexpr = 8 // BITS
        NB: tl.constexpr = D // PER
        byte = tl.load(x_ptr + xo[:, None] + tl.arange(0, NB)[None, :], mask=t_ok[:, None], other=0).to(tl.int32)
        M: tl.constexpr = (1 << BITS) - 1
        # one return at the end: Triton compiles the code after a constexpr-guarded early return too
        if PER == 1:
            codes = byte
        elif PER == 2:
            codes = tl.reshape(tl.join(byte & M, byte >> 4), (xo.shape[0], D))
        elif PER == 4:  # join's new axis is the last: [j, a, b] holds channel 4 j + 2 a + b
            codes = tl.reshape(tl.join(tl.join(byte & M, (byte >> 4) & M), tl.join((byte >> 2) & M, byte >> 6)),
                               (xo.shape[0], D))
        else:  # [j, a, b, c] holds channel 8 j + 4 a + 2 b + c
            codes = tl.reshape(
                tl.join(tl.join(tl.join(byte & M, (byte >> 4) & M), tl.join((byte >> 2) & M, (byte >> 6) & M)),
                        tl.join(tl.join((byte >> 1) & M, (byte >> 5) & M), tl.join((byte >> 3) & M, byte >> 7))),
                (xo.shape[0], D))
        return codes

    _P4F = tl.constexpr(_planes_asm(4, 1, False))
    _P4B = tl.constexpr(_planes_asm(4, 2, False))
    _P2F = tl.constexpr(_planes_asm(2, 1, False))
    _P2B = tl.constexpr(_planes_asm(2, 2, False))
    _A4F = tl.constexpr(_planes_asm(4, 1, True))
    _A4B = tl.constexpr(_planes_asm(4, 2, True))
    _A2F = tl.constexpr(_planes_asm(2, 1, True))
    _A2B = tl.constexpr(_planes_asm(2, 2, True))

    @triton.jit
    def _planes(byte, a, z, ASM: tl.constexpr, H16: tl.constexpr, PER: tl.constexpr, AFFINE: tl.constexpr):
        """The PER planes [BT, NB] (plane j: the code in bits j BITS.. of each byte) of ``byte`` as 16-bit values
        (H16 1 fp16, 2 bf16) by the inline PTX ``ASM`` (_planes_asm), times a plus z ([BT, NB], per byte) with
        AFFINE.  (The dtypes are spelled out per branch: a dtype passed as a constexpr does not lower here.)"""
        if AFFINE:
            args = [byte, a, z]
            C: tl.constexpr = "r,r,r,r,r"
        else:
            args = [byte]
            C: tl.constexpr = "r"
        if PER == 2:
            if H16 == 1:
                out = tl.inline_asm_elementwise(ASM, "=r,=r,=r,=r," + C, args, (tl.float16, tl.float16), True, 4)
            else:
                out = tl.inline_asm_elementwise(ASM, "=r,=r,=r,=r," + C, args, (tl.bfloat16, tl.bfloat16), True, 4)
        else:
            if H16 == 1:
                out = tl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,=r,=r,=r,=r," + C, args,
                                                (tl.float16, tl.float16, tl.float16, tl.float16), True, 4)
            else:
                out = tl.inline_asm_elementwise(ASM, "=r,=r,=r,=r,=r,=r,=r,=r," + C, args,
                                                (tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16), True, 4)
        return out

    @triton.jit
    def _row16(x_ptr, xo, t_ok, a, z, BITS: tl.constexpr, D: tl.constexpr, H16: tl.constexpr,
               AFFINE: tl.constexpr):
        """[BT, D] codes of whole rows of 2- or 4-bit codes at ``xo`` as the dot's 16-bit operands (H16 1 fp16,
        2 bf16), made from their bits (_planes_asm) and put in channel order by joins as _row_codes does; with
        AFFINE each code times a plus z, given per byte [BT, D * BITS / 8] in that dtype."""
        PER: tl.constexpr = 8 // BITS
        NB: tl.constexpr = D // PER
        byte = tl.load(x_ptr + xo[:, None] + tl.arange(0, NB)[None, :], mask=t_ok[:, None], other=0)
        if BITS == 4 and H16 == 1:
            ASM: tl.constexpr = _A4F if AFFINE else _P4F
        elif BITS == 4:
            ASM: tl.constexpr = _A4B if AFFINE else _P4B
        elif H16 == 1:
            ASM: tl.constexpr = _A2F if AFFINE else _P2F
        else:
            ASM: tl.constexpr = _A2B if AFFINE else _P2B
        p = _planes(byte, a, z, ASM, H16, PER, AFFINE)
        if PER == 2:
            codes = tl.reshape(tl.join(p[0], p[1]), (xo.shape[0], D))
        else:  # [j, a, b] holds channel 4 j + 2 a + b (as _row_codes)
            codes = tl.reshape(tl.join(tl.join(p[0], p[2]), tl.join(p[1], p[3])), (xo.shape[0], D))
        return codes

    @triton.jit
    def _token_codes(x_ptr, xo, t_ok, ch, BITS: tl.constexpr, D: tl.constexpr):
        """float32 integer codes [BT, D] of the rows at ``xo``: whole rows of 16 bytes or more split in registers
        for 1/2/4/8 bits, else one byte (or two) per channel (3, 5, 6, 7 bits: codes may straddle bytes)."""
        if (BITS == 1 or BITS == 2 or BITS == 4 or BITS == 8) and D * BITS >= 128:
            # (rows under 16 bytes: a byte per channel; whole rows of 4 bytes split by joins gave wrong results on
            # an H200 - head_dim 16, 2-bit - right under the interpreter)
            code = _row_codes(x_ptr, xo, t_ok, BITS, D)
        else:
            code = _codes(x_ptr, xo, ch, 0, t_ok, ch >= 0, BITS)
        return code.to(tl.float32)

    @triton.jit
    def _fp8_values(x_ptr, xo, t_ok, ch, KIND: tl.constexpr):
        """float32 values [BT, D] of fp8 rows at ``xo`` (KIND 3 e4m3, 4 e5m2), before their scales."""
        byte = tl.load(x_ptr + xo[:, None] + ch[None, :], mask=t_ok[:, None], other=0)
        if KIND == 3:
            f = byte.to(tl.float8e4nv, bitcast=True)
        else:
            f = byte.to(tl.float8e5, bitcast=True)
        return f.to(tl.float32)

    @triton.jit
    def _group_small(p_ptr, po, t_ok, NG: tl.constexpr):
        """[BT, NG] float32: each token's NG per-group parameters, read once."""
        return tl.load(p_ptr + po[:, None] + tl.arange(0, NG)[None, :], mask=t_ok[:, None], other=0.0).to(tl.float32)

    @triton.jit
    def _spread(p, G: tl.constexpr, D: tl.constexpr):
        """[BT, D] from per-group values p [BT, D / G]: each repeated over its G columns in registers."""
        return tl.reshape(tl.broadcast_to(p[:, :, None], (p.shape[0], D // G, G)), (p.shape[0], D))

    @triton.jit
    def _group_params(p_ptr, po, t_ok, G: tl.constexpr, D: tl.constexpr):
        """[BT, D] float32 parameters of per-token groups of G channels (a power of two dividing D): each token's
        D / G values read once and repeated over their groups in registers."""
        return _spread(_group_small(p_ptr, po, t_ok, D // G), G, D)

    @triton.jit
    def _to16(x, H16: tl.constexpr):
        if H16 == 1:
            y = x.to(tl.float16)
        else:
            y = x.to(tl.bfloat16)
        return y

    @triton.jit
    def load_rows(x_ptr, s_ptr, z_ptr, tab_ptr, xo, po, tg, t_ok, ch,
                  KIND: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, SYM: tl.constexpr, NHI: tl.constexpr,
                  D: tl.constexpr, W: tl.constexpr, H16: tl.constexpr):
        """[BT, D] float32 values of the tokens whose code rows start at ``xo`` and parameter rows at ``po``
        (``tg``: their indices for centring groups).  KIND 0 full precision; 1 integer per-token groups of G
        channels; 2 integer per-channel (parameters [D] per row); 3 / 4 fp8 e4m3 / e5m2 times the row's scale
        (parameter column 0); 5 / 6 rotated codebook codes, in the rotated space (the caller rotates the query
        and un-rotates the output): levels from ``tab_ptr`` (rows D / D + 1 of the C++ kernel's table: the
        (BITS + 1)-bit levels of the first NHI coordinates, the BITS-bit levels of the rest) times the token's
        scale (5: parameter column 0; 6: column D + tg % G of its group's row, plus the group mean, columns 0..D).
        H16 == 1 (codes16, fp16 operands): 2- and 4-bit per-token groups of at least a byte's codes come back as
        fp16 instead, dequantized from their bits by _row16 with the parameters rounded to fp16."""
        if KIND == 0:
            return tl.load(x_ptr + xo[:, None] + ch[None, :], mask=t_ok[:, None], other=0.0).to(tl.float32)
        if KIND == 3 or KIND == 4:
            scale = tl.load(s_ptr + po, mask=t_ok, other=0.0).to(tl.float32)
            return _fp8_values(x_ptr, xo, t_ok, ch, KIND) * scale[:, None]
        if KIND >= 5:
            lo_ok = ch >= NHI
            # the first NHI channels take the high width: index 0 for them here (their load is masked), since a
            # negative index's C-style % on the GPU gave a negative shift, a wild code and a read past the table
            code = _codes(x_ptr, xo, tl.where(lo_ok, ch - NHI, 0), NHI * (BITS + 1) // 8, t_ok, lo_ok, BITS)
            lv = tl.load(tab_ptr + (D + 1) * W + code, mask=t_ok[:, None], other=0.0)
            if NHI > 0:
                hi_code = _codes(x_ptr, xo, ch, 0, t_ok, ch < NHI, BITS + 1)
                lv = tl.where(lo_ok[None, :], lv, tl.load(tab_ptr + D * W + hi_code, mask=t_ok[:, None], other=0.0))
            if KIND == 5:
                return lv * tl.load(s_ptr + po, mask=t_ok, other=0.0).to(tl.float32)[:, None]
            sc = tl.load(s_ptr + po + D + tg % G, mask=t_ok, other=0.0).to(tl.float32)
            mean = tl.load(s_ptr + po[:, None] + ch[None, :], mask=t_ok[:, None], other=0.0).to(tl.float32)
            return lv * sc[:, None] + mean
        if (H16 == 1 and (BITS == 2 or BITS == 4) and D * BITS >= 128 and KIND == 1 and D % G == 0
                and (G & (G - 1)) == 0 and G * BITS >= 8):
            PER: tl.constexpr = 8 // BITS  # a byte's codes share a group: parameters per byte
            s = _group_small(s_ptr, po, t_ok, D // G)
            if SYM:
                z = s
            else:
                z = _group_small(z_ptr, po, t_ok, D // G)
            a, c = _affine(s, z, BITS, SYM)
            vals = _row16(x_ptr, xo, t_ok, _spread(_to16(a, H16), G // PER, D // PER),
                          _spread(_to16(c, H16), G // PER, D // PER), BITS, D, H16, True)
        else:
            code = _token_codes(x_ptr, xo, t_ok, ch, BITS, D)
            if KIND == 1 and D % G == 0 and (G & (G - 1)) == 0:
                s = _group_params(s_ptr, po, t_ok, G, D)
                if SYM:
                    z = s
                else:
                    z = _group_params(z_ptr, po, t_ok, G, D)
            else:
                if KIND == 1:
                    p_off = po[:, None] + (ch // G)[None, :]
                else:
                    p_off = po[:, None] + ch[None, :]
                s = tl.load(s_ptr + p_off, mask=t_ok[:, None], other=0.0).to(tl.float32)
                if SYM:
                    z = s
                else:
                    z = tl.load(z_ptr + p_off, mask=t_ok[:, None], other=0.0).to(tl.float32)
            a, c = _affine(s, z, BITS, SYM)
            vals = code * a + c
        return vals


    @triton.jit
    def load_folded(x_ptr, s_ptr, z_ptr, tab_ptr, t, t_ok, first, table_ptr, b, h,
                    x_ss, x_sb, x_sh, x_sr, p_ss, p_sb, p_sh, p_sr, ch,
                    PAGED: tl.constexpr, BLK: tl.constexpr, PER_ROW: tl.constexpr, KIND: tl.constexpr,
                    BITS: tl.constexpr, SYM: tl.constexpr, D: tl.constexpr, H16: tl.constexpr):
        """One side's tokens ``t`` as (raw [BT, D] float32, a, c) with value = raw * a + c, for the kernels to fold
        a and c into their products instead of dequantizing every element (see ``folds``): KIND 0 the values
        (a, c unused); 3 / 4 the fp8 values, a [BT] the token's scale; 1 (one group per token) the codes, a and c
        [BT]; 2 (every valid token of the tile in one parameter row) the codes, a and c [D].  H16 > 0: 2- and 4-bit
        codes come back as the dot's fp16 / bf16 operands (_row16: exact, no conversion instructions)."""
        xo = token_rows(t, t_ok, first, table_ptr, b, h, x_ss, x_sb, x_sh, x_sr, PAGED, BLK, 1)
        po = token_rows(t, t_ok, first, table_ptr, b, h, p_ss, p_sb, p_sh, p_sr, PAGED, BLK, PER_ROW)
        if KIND == 0:
            raw = tl.load(x_ptr + xo[:, None] + ch[None, :], mask=t_ok[:, None], other=0.0).to(tl.float32)
            a = 0.0
            c = 0.0
        elif KIND == 3 or KIND == 4:
            raw = _fp8_values(x_ptr, xo, t_ok, ch, KIND)
            a = tl.load(s_ptr + po, mask=t_ok, other=0.0).to(tl.float32)
            c = 0.0
        else:
            if H16 > 0 and (BITS == 2 or BITS == 4) and D * BITS >= 128:
                raw = _row16(x_ptr, xo, t_ok, 0.0, 0.0, BITS, D, H16, False)
            else:
                raw = _token_codes(x_ptr, xo, t_ok, ch, BITS, D)
            if KIND == 1:
                s = tl.load(s_ptr + po, mask=t_ok, other=0.0).to(tl.float32)
                if SYM:
                    z = s
                else:
                    z = tl.load(z_ptr + po, mask=t_ok, other=0.0).to(tl.float32)
            else:  # the row of the tile's valid tokens (any row when none is valid: its values go unused)
                po0 = tl.max(tl.where(t_ok, po, 0), axis=0)
                s = tl.load(s_ptr + po0 + ch).to(tl.float32)
                if SYM:
                    z = s
                else:
                    z = tl.load(z_ptr + po0 + ch).to(tl.float32)
            a, c = _affine(s, z, BITS, SYM)
        return raw, a, c

    @triton.jit
    def load_tokens(x_ptr, s_ptr, z_ptr, tab_ptr, t, t_ok, first, table_ptr, b, h,
                    x_ss, x_sb, x_sh, x_sr, p_ss, p_sb, p_sh, p_sr, ch,
                    PAGED: tl.constexpr, BLK: tl.constexpr, PER_ROW: tl.constexpr, KIND: tl.constexpr,
                    BITS: tl.constexpr, G: tl.constexpr, SYM: tl.constexpr, NHI: tl.constexpr, D: tl.constexpr,
                    W: tl.constexpr, H16: tl.constexpr):
        """[BT, D] float32 values of one side's tokens ``t`` (of a segment, or of a pool from store index
        ``first``): their code and parameter rows found by token_rows, read by load_rows."""
        if PAGED:  # store indices: centring groups start at multiples of their size
            tg = first + t
        else:
            tg = t
        xo = token_rows(t, t_ok, first, table_ptr, b, h, x_ss, x_sb, x_sh, x_sr, PAGED, BLK, 1)
        po = token_rows(t, t_ok, first, table_ptr, b, h, p_ss, p_sb, p_sh, p_sr, PAGED, BLK, PER_ROW)
        return load_rows(x_ptr, s_ptr, z_ptr, tab_ptr, xo, po, tg, t_ok, ch, KIND, BITS, G, SYM, NHI, D, W, H16)

    @triton.jit
    def masked_scores(s, valid, b, lq, t, col0, kq, mask_ptr, m_sb, m_sq, m_sc, MASK: tl.constexpr):
        """Scores of query rows (query index ``lq``) against tokens ``t`` of a segment whose mask columns start at
        ``col0``: MASK 0 none, 1 bool (uint8), 2 additive float, 3 causal (token kq + t visible to query lq, kq =
        the segment's first position minus the first query's); entries not valid are -inf."""
        if MASK == 1:
            mv = tl.load(mask_ptr + b * m_sb + lq[:, None] * m_sq + (col0 + t)[None, :] * m_sc, mask=valid, other=0)
            valid = valid & (mv != 0)
        elif MASK == 2:
            s = s + tl.load(mask_ptr + b * m_sb + lq[:, None] * m_sq + (col0 + t)[None, :] * m_sc, mask=valid,
                            other=0.0).to(tl.float32)
        elif MASK == 3:
            valid = valid & ((kq + t)[None, :] <= lq[:, None])
        return tl.where(valid, s, float("-inf"))


def folds(sd: Side, d: int, per_row: int, bt: int, aligned: bool) -> bool:
    """Whether the kernels read a side through ``load_folded`` (parameters folded into the products) rather than
    dequantizing every element: full precision, fp8, integer codes with one group per token, or per-channel
    groups whose parameter rows (``per_row`` tokens each) each cover whole tiles of ``bt`` tokens (``aligned``: the
    launch's tiles start on a row's first token)."""
    if sd.kind in (0, 3, 4):
        return True
    if sd.kind == 1:
        return sd.group == d
    return sd.kind == 2 and aligned and per_row % bt == 0


def side(fmt: StorageFormat | None) -> Side | None:
    """A side's kernel constants, or None when the format needs the reference."""
    if fmt is None or fmt.kind == "fp":
        return FP_SIDE
    if not fmt.plain or fmt.param_dtype not in PARAM_DTYPES:
        return None
    if fmt.kind == "int" and fmt.bits in range(1, 9):
        return Side(1 if fmt.axis == "token" else 2, fmt.bits, fmt.group, fmt.symmetric)
    if fmt.kind == "fp8" and fmt.fp8_variant in FP8_KINDS:
        return Side(FP8_KINDS[fmt.fp8_variant], 8, 1, False)
    if fmt.kind == "rot":
        sp = split_bits(fmt.bits, fmt.head_dim)
        centred = fmt.axis == "channel"
        return Side(6 if centred else 5, sp.bits_lo, fmt.token_group if centred else 1, False, sp.n_hi,
                    rotated_kernel_table(fmt.head_dim, fmt.bits))
    return None


_DEVICE_TABLES: dict[tuple[int, str], torch.Tensor] = {}


def device_table(sd: Side, device: torch.device) -> torch.Tensor | None:
    """A rotated side's table on ``device`` (copied there once), else None."""
    if sd.table is None:
        return None
    key = (id(sd.table), str(device))
    if key not in _DEVICE_TABLES:  # rotated_kernel_table builds each table once, so ids stay valid
        _DEVICE_TABLES[key] = sd.table.to(device)
    return _DEVICE_TABLES[key]


def rotate_query(q: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """q R (float32, contiguous): scores against rotated codes equal those against the decoded vectors."""
    d = q.shape[-1]
    return torch.matmul(q.float(), table[0, 0, :d, :d]).contiguous()


def unrotate_rows(y: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """y R^T: weighted rotated values back to the original space (R is orthogonal)."""
    d = y.shape[-1]
    return torch.matmul(y, table[0, 0, :d, :d].transpose(0, 1))


def table_width(d: int) -> int:
    """Row width of the rotated formats' table (rotated_kernel_table)."""
    return max(d, 16)


def slot_strides(t: torch.Tensor, paged: bool) -> tuple[int, int, int, int]:
    """(slot, batch, head, row) strides of a pool [slots, B, H, rows, ...] or of a tensor [B, H, rows, ...]."""
    if paged:
        return t.stride(0), t.stride(1), t.stride(2), t.stride(3)
    return 0, t.stride(0), t.stride(1), t.stride(2)


def _shared_strides(s: torch.Tensor) -> tuple[int, int, int, int]:
    """Strides of a per-head [B, H, 1, 1] or per-tensor [B, 1, 1, 1] fp8 scale read for every token."""
    return 0, s.stride(0) if s.shape[0] > 1 else 0, s.stride(1) if s.shape[1] > 1 else 0, 0


def side_args(fmt: StorageFormat | None, parts: Mapping[str, torch.Tensor] | None = None,
              x: torch.Tensor | None = None, paged: bool = False,
              shared: Mapping[str, torch.Tensor] | None = None) -> tuple[tuple, tuple, int]:
    """Kernel arguments of one side: (x, scale, zero) tensors, their strides (codes' 4, then parameters' 4) and
    the tokens per parameter row.  ``x``: a full-precision segment [B, H, n, D]; else ``parts`` as stored, and
    the side's ``shared`` tensors (an fp8 scale fixed per head or tensor)."""
    if x is not None or fmt is None or fmt.kind == "fp":
        if x is None:
            x = parts["x"]
        if x.stride(-1) != 1:
            x = x.contiguous()
        st = slot_strides(x, paged)
        return (x, x, x), st + st, 1
    xs = parts["codes"]
    if fmt.kind == "rot":  # scales (centred: a row per group holding the group means, then its tokens' scales)
        s = parts["stats"] if fmt.axis == "channel" else parts["norm"]
        return (xs, s, s), slot_strides(xs, paged) + slot_strides(s, paged), fmt.token_group if fmt.axis == "channel" else 1
    if fmt.kind == "fp8" and fmt.fixed_scale:
        s = shared["scale"]
        return (xs, s, s), slot_strides(xs, paged) + _shared_strides(s), 1
    s = parts["scale"]
    return (xs, s, parts.get("zero", s)), slot_strides(xs, paged) + slot_strides(s, paged), \
        fmt.group if fmt.kind == "int" and fmt.axis == "channel" else 1


def stored_args(plan, k_parts: Mapping[str, torch.Tensor], v_parts: Mapping[str, torch.Tensor],
                paged: bool = False) -> tuple[tuple, tuple]:
    """side_args of both sides of a plan's stored tokens: a pool's tensors (``paged``) or one stored segment's."""
    return (side_args(plan.key_format, k_parts, paged=paged, shared=plan.key_shared),
            side_args(plan.value_format, v_parts, paged=paged, shared=plan.value_shared))


class StoredRun(NamedTuple):
    """A run of a plan's stored tokens one launch reads: ``n`` tokens from absolute position ``start``, each side's
    side_args (tensors, strides, tokens per parameter row), and the pool it walks through its block table (None:
    one stored block's own tensors)."""

    start: int
    n: int
    k: tuple
    v: tuple
    pool: PoolRun | None


def stored_runs(plan: SegmentPlan) -> list[StoredRun]:
    """The plan's stored tokens as the kernels read them: one run over the whole pool where the store keeps one
    (every device cache), else one run per stored block; runs of no tokens are left out."""
    pool = plan.pool
    if pool is not None:
        return [StoredRun(pool.start, pool.n_tokens, *stored_args(plan, pool.parts["k"], pool.parts["v"], True),
                          pool)] if pool.n_tokens else []
    return [StoredRun(seg.start, seg.length, *stored_args(plan, seg.k_parts, seg.v_parts), None)
            for seg in plan.segments if seg.kind != EXACT and seg.length]


def mask_args(mask: torch.Tensor | None, fallback: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int], int]:
    """(tensor, (batch, query, column) strides, kind) of an attention mask [B|1, 1, Lq, kv_len] read in place:
    kind 0 none, 1 bool (read as uint8), 2 additive float."""
    if mask is None:
        return fallback, (0, 0, 0), 0
    mm = mask[:, 0]
    kind = 1 if mm.dtype == torch.bool else 2
    st = (mm.stride(0) if mm.shape[0] > 1 else 0, mm.stride(1), mm.stride(2))
    return (mm.view(torch.uint8) if kind == 1 else mm), st, kind
