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

import torch

from ..quant.format import StorageFormat

try:  # Triton is optional
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised where Triton is missing
    HAS_TRITON = False

PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# (kind, bits, group, symmetric) of a side: kind 0 full precision, 1 integer per-token groups, 2 integer per-channel
# groups, 3 / 4 fp8 e4m3 / e5m2 with one scale per token (or per head / tensor, shared)
FP_SIDE = (0, 16, 1, False)
FP8_KINDS = {"e4m3": 3, "e5m2": 4}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def available() -> bool:
    """Triton importable and a CUDA device present (or the Triton interpreter switched on)."""
    return HAS_TRITON and (torch.cuda.is_available() or interpreting())


if HAS_TRITON:

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
        parameters of per-channel groups)."""
        if PAGED:
            u = first + t
            slot = tl.load(table_ptr + u // BLK, mask=t_ok, other=0).to(tl.int64)
            row = (u % BLK) // PER_ROW
        else:
            slot = tl.zeros_like(t).to(tl.int64)
            row = t // PER_ROW
        return slot * s_slot + b.to(tl.int64) * s_b + h.to(tl.int64) * s_h + row.to(tl.int64) * s_row

    @triton.jit
    def load_rows(x_ptr, s_ptr, z_ptr, xo, po, t_ok, ch,
                  KIND: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, SYM: tl.constexpr):
        """[BT, D] float32 values of the tokens whose code rows start at ``xo`` and parameter rows at ``po``;
        KIND 0 full precision, 1 per-token groups of G channels, 2 per-channel (parameters [D] per row), 3 / 4 fp8
        e4m3 / e5m2 times the row's scale (parameter column 0)."""
        if KIND == 0:
            return tl.load(x_ptr + xo[:, None] + ch[None, :], mask=t_ok[:, None], other=0.0).to(tl.float32)
        if KIND >= 3:
            byte = tl.load(x_ptr + xo[:, None] + ch[None, :], mask=t_ok[:, None], other=0)
            if KIND == 3:
                f = byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            else:
                f = byte.to(tl.float8e5, bitcast=True).to(tl.float32)
            return f * tl.load(s_ptr + po, mask=t_ok, other=0.0).to(tl.float32)[:, None]
        if BITS == 3:  # 8 codes in a little-endian 24-bit word (3 bytes); a code may straddle two bytes
            bit = (ch % 8) * 3
            idx = (ch // 8) * 3 + bit // 8
            sh = bit % 8
            lo = tl.load(x_ptr + xo[:, None] + idx[None, :], mask=t_ok[:, None], other=0).to(tl.int32)
            hi = tl.load(x_ptr + xo[:, None] + (idx + 1)[None, :], mask=t_ok[:, None] & (sh > 5)[None, :],
                         other=0).to(tl.int32)
            code = (((lo | (hi << 8)) >> sh[None, :]) & 7).to(tl.float32)
        else:  # 8 // BITS codes per byte (one for 5-8 bits), first code in the lowest bits
            PER: tl.constexpr = 8 // BITS
            byte = tl.load(x_ptr + xo[:, None] + (ch // PER)[None, :], mask=t_ok[:, None], other=0)
            code = ((byte.to(tl.int32) >> ((ch % PER) * BITS)[None, :]) & ((1 << BITS) - 1)).to(tl.float32)
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
        return code * a + c


def side(fmt: StorageFormat | None) -> tuple[int, int, int, bool] | None:
    """(kind, bits, group, symmetric) for the kernels, or None when the format needs the reference."""
    if fmt is None or fmt.kind == "fp":
        return FP_SIDE
    if not fmt.plain or fmt.param_dtype not in PARAM_DTYPES:
        return None
    if fmt.kind == "int" and fmt.bits in range(1, 9):
        return (1 if fmt.axis == "token" else 2), fmt.bits, fmt.group, fmt.symmetric
    if fmt.kind == "fp8" and fmt.fp8_variant in FP8_KINDS:
        return FP8_KINDS[fmt.fp8_variant], 8, 1, False
    return None


def _strides(t: torch.Tensor, paged: bool) -> tuple[int, int, int, int]:
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
        st = _strides(x, paged)
        return (x, x, x), st + st, 1
    xs = parts["codes"]
    if fmt.kind == "fp8" and fmt.fixed_scale:
        s = shared["scale"]
        return (xs, s, s), _strides(xs, paged) + _shared_strides(s), 1
    s = parts["scale"]
    return (xs, s, parts.get("zero", s)), _strides(xs, paged) + _strides(s, paged), \
        fmt.group if fmt.kind == "int" and fmt.axis == "channel" else 1


def stored_args(plan, k_parts: Mapping[str, torch.Tensor], v_parts: Mapping[str, torch.Tensor],
                paged: bool = False) -> tuple[tuple, tuple]:
    """side_args of both sides of a plan's stored tokens: a pool's tensors (``paged``) or one stored segment's."""
    return (side_args(plan.key_format, k_parts, paged=paged, shared=plan.key_shared),
            side_args(plan.value_format, v_parts, paged=paged, shared=plan.value_shared))


def mask_args(mask: torch.Tensor | None, fallback: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int], int]:
    """(tensor, (batch, query, column) strides, kind) of an attention mask [B|1, 1, Lq, kv_len] read in place:
    kind 0 none, 1 bool (read as uint8), 2 additive float."""
    if mask is None:
        return fallback, (0, 0, 0), 0
    mm = mask[:, 0]
    kind = 1 if mm.dtype == torch.bool else 2
    st = (mm.stride(0) if mm.shape[0] > 1 else 0, mm.stride(1), mm.stride(2))
    return (mm.view(torch.uint8) if kind == 1 else mm), st, kind
