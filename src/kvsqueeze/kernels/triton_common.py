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

FAST_BITS = (2, 4, 8)
PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP_SIDE = (0, 16, 1, False)  # (kind, bits, group, symmetric) of full-precision tokens


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
        KIND 0 full precision, 1 per-token groups of G channels, 2 per-channel (parameters [D] per row)."""
        if KIND == 0:
            return tl.load(x_ptr + xo[:, None] + ch[None, :], mask=t_ok[:, None], other=0.0).to(tl.float32)
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
    if fmt.kind == "int" and fmt.plain and fmt.bits in FAST_BITS and fmt.param_dtype in PARAM_DTYPES:
        return (1 if fmt.axis == "token" else 2), fmt.bits, fmt.group, fmt.symmetric
    return None


def _strides(t: torch.Tensor, paged: bool) -> tuple[int, int, int, int]:
    """(slot, batch, head, row) strides of a pool [slots, B, H, rows, ...] or of a tensor [B, H, rows, ...]."""
    if paged:
        return t.stride(0), t.stride(1), t.stride(2), t.stride(3)
    return 0, t.stride(0), t.stride(1), t.stride(2)


def side_args(fmt: StorageFormat | None, parts: Mapping[str, torch.Tensor] | None = None,
              x: torch.Tensor | None = None, paged: bool = False) -> tuple[tuple, tuple, int]:
    """Kernel arguments of one side: (x, scale, zero) tensors, their strides (codes' 4, then parameters' 4) and
    the tokens per parameter row.  ``x``: a full-precision segment [B, H, n, D]; else ``parts`` as stored."""
    if x is not None or fmt is None or fmt.kind == "fp":
        if x is None:
            x = parts["x"]
        if x.stride(-1) != 1:
            x = x.contiguous()
        st = _strides(x, paged)
        return (x, x, x), st + st, 1
    s = parts["scale"]
    xs = parts["codes"]
    return (xs, s, parts.get("zero", s)), _strides(xs, paged) + _strides(s, paged), \
        fmt.group if fmt.axis == "channel" else 1


def mask_args(mask: torch.Tensor | None, fallback: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int], int]:
    """(tensor, (batch, query, column) strides, kind) of an attention mask [B|1, 1, Lq, kv_len] read in place:
    kind 0 none, 1 bool (read as uint8), 2 additive float."""
    if mask is None:
        return fallback, (0, 0, 0), 0
    mm = mask[:, 0]
    kind = 1 if mm.dtype == torch.bool else 2
    st = (mm.stride(0) if mm.shape[0] > 1 else 0, mm.stride(1), mm.stride(2))
    return (mm.view(torch.uint8) if kind == 1 else mm), st, kind
