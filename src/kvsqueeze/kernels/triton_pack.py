"""Triton quantize-and-pack of appended tokens, bit-identical to the torch encoders of the integer codecs.

:func:`encode` returns exactly the parts the integer codecs store for a plain "int" storage format (codes packed
as :func:`kvsqueeze.quant.packing.pack_bits` packs them, scale and zero in the parameter dtype), computed by one
launch instead of a dozen torch ops and their float32 temporaries.  It follows :func:`quantize_groups` operation
by operation: min/max (exact in any order), parameters rounded to the storage dtype with the same directed
rounding (zero down, scale up), IEEE division, round-half-to-even; float contraction into FMAs is switched off so
no product is rounded differently.  The codes therefore match the torch encoder bit for bit, ties included.

Supported: 1 (asymmetric only), 2, 3, 4, 5-8 bits, symmetric or not, any clip ratio, fp32/fp16/bf16 parameters,
power-of-two head_dim and group size.  Everything else (1-bit symmetric, whose scale is a mean whose summation
order would differ; fp8 parameters; other group sizes) returns None and the caller keeps the torch encoder.

:func:`encode_ring` is a static layer's per-step flush (cache/static.py): the group it re-encodes read from the
layer's ring, its position from the token count on the device, so a CUDA graph can replay it.

The adapter hands :func:`encode` to the cache's block stores for CUDA tensors (its ``fast_encoder``);
``KVSQUEEZE_TRITON_ENCODE=1`` also routes CPU tensors here (under ``TRITON_INTERPRET=1``, for tests) and ``=0``
switches it off.  Importing this module without Triton works; :func:`encode` then returns None.
"""

from __future__ import annotations

import torch

from ..cache.plan import PoolTarget
from ..quant.format import StorageFormat
from ..quant.nonfinite import LIMIT
from ..quant.params import PARAM_DTYPE_NAMES, scale_floor
from .triton_common import HAS_TRITON, available, slot_strides

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .triton_common import token_rows

ROWS = 16  # tokens per program of the per-token kernel

_PKIND = {"fp32": 0, "fp16": 1, "bf16": 2}
_PMAX = {0: float(torch.finfo(torch.float32).max), 1: float(torch.finfo(torch.float16).max),
         2: float(torch.finfo(torch.bfloat16).max)}
_X_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _pow2(n: int) -> bool:
    return n > 0 and not n & (n - 1)


if HAS_TRITON:

    @triton.jit
    def _to_param(t, UP: tl.constexpr, PKIND: tl.constexpr, PMAX: tl.constexpr):
        """Round float32 ``t`` to the parameter dtype, up (result >= t) or down, as quant.params.to_param does;
        the result is a float32 holding a value exactly representable in that dtype."""
        t = tl.minimum(tl.maximum(t, -PMAX), PMAX)
        if PKIND == 0:
            return t
        neg = t.to(tl.int32, bitcast=True) < 0  # the sign bit, so -0.0 keeps its sign as in torch
        a = tl.abs(t)
        bits = a.to(tl.int32, bitcast=True)
        if PKIND == 2:
            # bf16 is float32 with the low 16 bits dropped: truncating them rounds the magnitude down
            tb = bits & -65536
            lo = tb.to(tl.float32, bitcast=True)
            hi = (tb + tl.where(tb != bits, 65536, 0)).to(tl.float32, bitcast=True)
        else:
            # fp16: the grid step of |t|'s binade (2**-24 below the normal range); scaling by powers of two is exact
            e = tl.maximum(((bits >> 23) & 255) - 127, -14)
            step = ((e - 10 + 127) << 23).to(tl.float32, bitcast=True)
            inv = ((127 - (e - 10)) << 23).to(tl.float32, bitcast=True)
            q = a * inv
            lo = tl.floor(q) * step
            hi = tl.ceil(q) * step
        # lo / hi: the magnitude rounded down / up
        if UP:
            return tl.where(neg, -lo, hi)
        return tl.where(neg, -hi, lo)

    @triton.jit
    def _rint(y):
        # round half to even, like torch.round (floor(y + 0.5) would mis-round just below .5)
        f = tl.floor(y)
        d = y - f
        odd = (f - 2.0 * tl.floor(f * 0.5)) == 1.0
        return f + tl.where((d > 0.5) | ((d == 0.5) & odd), 1.0, 0.0)

    @triton.jit
    def _finite(x, LIM: tl.constexpr):
        """(x with NaN -> 0, x clamped to +-LIM where finite, +LIM where not (for a min), -LIM (for a max)),
        as quant.nonfinite.finite_minmax computes them."""
        x = tl.where(x != x, 0.0, x)
        fin = tl.abs(x) <= 3.4028234663852886e38  # float32 max: False for +-inf
        xc = tl.minimum(tl.maximum(x, -LIM), LIM)
        return x, tl.where(fin, xc, LIM), tl.where(fin, xc, -LIM)

    @triton.jit
    def _quantize(x, mn, mx, clip, floor, BITS: tl.constexpr, SYM: tl.constexpr, PKIND: tl.constexpr,
                  PMAX: tl.constexpr):
        """(int32 codes, scale, zero) for values x and their broadcastable group min / max over finite values
        ((0, 0) when none): the rules of quant.affine.minmax_params / absmax_scale."""
        empty = mn > mx
        mn = tl.where(empty, 0.0, mn)
        mx = tl.where(empty, 0.0, mx)
        if SYM:
            QMAX: tl.constexpr = 2 ** (BITS - 1) - 1
            a = tl.maximum(-mn, mx) * clip
            raw = tl.where(mn == mx, a, tl.div_rn(a, QMAX * 1.0))  # zero range: the constant is code +-1
            s = _to_param(tl.maximum(raw, floor), True, PKIND, PMAX)
            q = tl.minimum(tl.maximum(_rint(tl.div_rn(x, s)), -QMAX * 1.0), QMAX * 1.0) + 2 ** (BITS - 1)
            return q.to(tl.int32), s, s
        QMAX2: tl.constexpr = 2 ** BITS - 1
        z = _to_param(mn * clip, False, PKIND, PMAX)
        s = _to_param(tl.maximum(tl.div_rn(mx * clip - z, QMAX2 * 1.0), floor), True, PKIND, PMAX)
        q = tl.minimum(tl.maximum(_rint(tl.div_rn(x - z, s)), 0.0), QMAX2 * 1.0)
        return q.to(tl.int32), s, z

    @triton.jit
    def _pack_store(c_ptr, codes, co, r_ok, BR: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
        """Store int32 codes [BR, D] packed along channels as pack_bits packs them, token i's bytes from offset
        co[i]."""
        if BITS >= 5:  # one code per byte
            ch = tl.arange(0, D)
            tl.store(c_ptr + co[:, None] + ch[None, :], codes.to(tl.uint8), mask=r_ok[:, None])
        elif BITS == 3:  # 8 codes in a little-endian 24-bit word, stored as 3 bytes
            NU: tl.constexpr = D // 8
            word = tl.sum(tl.reshape(codes, (BR, NU, 8)) << (tl.arange(0, 8) * 3)[None, None, :], axis=2)
            u = tl.arange(0, NU)
            base = c_ptr + co[:, None] + u[None, :] * 3
            for j in tl.static_range(3):
                tl.store(base + j, ((word >> (8 * j)) & 255).to(tl.uint8), mask=r_ok[:, None])
        else:  # 8 // BITS codes per byte, first code in the lowest bits; fields do not overlap, so sum == or
            PER: tl.constexpr = 8 // BITS
            NB: tl.constexpr = D // PER
            byte = tl.sum(tl.reshape(codes, (BR, NB, PER)) << (tl.arange(0, PER) * BITS)[None, None, :], axis=2)
            nb = tl.arange(0, NB)
            tl.store(c_ptr + co[:, None] + nb[None, :], byte.to(tl.uint8), mask=r_ok[:, None])

    @triton.jit
    def _flushed(t, T, cnt_ptr, ring_s, ring_w, ring_rows, RING: tl.constexpr):
        """(destination token, source row in x) of tokens ``t`` of a launch: themselves, or (RING > 0, a static
        layer's flush, cache/static.py) the T-token group ending at nq = T * max(1, (n - S - W) // T) of the body
        for the n = cnt_ptr[0] tokens held (its start capped at ring_rows - T), read from a ring of RING slots
        (body token u at slot u % RING).  The count is read on the device: a CUDA graph replays the launch."""
        if RING:
            m = tl.load(cnt_ptr).to(tl.int32) - ring_s - ring_w
            nq = tl.maximum(tl.where(m > 0, m // T, 0), 1) * T  # (m > 0: C-style // would round up below 0)
            first = tl.minimum(nq - T, ring_rows - T)
            return first + t, (first + t) % RING
        return t, t

    @triton.jit
    def _pack_token_kernel(x_ptr, c_ptr, s_ptr, z_ptr, table_ptr, n_rows, T, H, start,
                           cs_slot, cs_b, cs_h, cs_r, ps_slot, ps_b, ps_h, ps_r, clip, floor,
                           cnt_ptr, ring_s, ring_w, ring_rows,
                           D: tl.constexpr, G: tl.constexpr, BR: tl.constexpr, BITS: tl.constexpr,
                           SYM: tl.constexpr, PKIND: tl.constexpr, PMAX: tl.constexpr, LIM: tl.constexpr,
                           PAGED: tl.constexpr, BLK: tl.constexpr, RING: tl.constexpr):
        """Per-token groups: x [B, H, T, D] (n_rows = B H T rows) in groups of G channels -> codes and params
        [.., D // G] per token, written where token_rows puts them (a pool's slots, or [B, H, T, ..] outputs).
        RING > 0: x is a static layer's ring [B, H, RING, D] and the T tokens its flushed group (_flushed)."""
        NG: tl.constexpr = D // G
        rows = tl.program_id(0) * BR + tl.arange(0, BR)
        r_ok = rows < n_rows
        gi = tl.arange(0, NG)
        bh = rows // T
        t, src = _flushed(rows % T, T, cnt_ptr, ring_s, ring_w, ring_rows, RING)
        xrow = bh * (RING if RING else T) + src
        off = xrow[:, None, None] * D + gi[None, :, None] * G + tl.arange(0, G)[None, None, :]
        x = tl.load(x_ptr + off, mask=r_ok[:, None, None], other=0.0).to(tl.float32)
        x, for_min, for_max = _finite(x, LIM)
        mn = tl.min(for_min, axis=2)
        mx = tl.max(for_max, axis=2)
        q, s, z = _quantize(x, mn[:, :, None], mx[:, :, None], clip, floor, BITS, SYM, PKIND, PMAX)
        co = token_rows(t, r_ok, start, table_ptr, bh // H, bh % H, cs_slot, cs_b, cs_h, cs_r, PAGED, BLK, 1)
        po = token_rows(t, r_ok, start, table_ptr, bh // H, bh % H, ps_slot, ps_b, ps_h, ps_r, PAGED, BLK, 1)
        p_off = po[:, None] + gi[None, :]
        tl.store(s_ptr + p_off, tl.reshape(s, (BR, NG)), mask=r_ok[:, None])
        if not SYM:
            tl.store(z_ptr + p_off, tl.reshape(z, (BR, NG)), mask=r_ok[:, None])
        _pack_store(c_ptr, tl.reshape(q, (BR, D)), co, r_ok, BR, D, BITS)

    @triton.jit
    def _pack_channel_kernel(x_ptr, c_ptr, s_ptr, z_ptr, table_ptr, T, H, start,
                             cs_slot, cs_b, cs_h, cs_r, ps_slot, ps_b, ps_h, ps_r, clip, floor,
                             cnt_ptr, ring_s, ring_w, ring_rows,
                             D: tl.constexpr, G: tl.constexpr, BITS: tl.constexpr,
                             SYM: tl.constexpr, PKIND: tl.constexpr, PMAX: tl.constexpr, LIM: tl.constexpr,
                             PAGED: tl.constexpr, BLK: tl.constexpr, RING: tl.constexpr):
        """Per-channel groups: one program per group of G tokens of one (sequence, head); x [G, D] -> codes and
        params [D] (one parameter row per group).  RING > 0: as in _pack_token_kernel (T == G then)."""
        grp = tl.program_id(0)
        NGT = T // G
        bh = grp // NGT
        t, src = _flushed((grp % NGT) * G + tl.arange(0, G), T, cnt_ptr, ring_s, ring_w, ring_rows, RING)
        ch = tl.arange(0, D)
        x = tl.load(x_ptr + (bh * (RING if RING else T) + src)[:, None] * D + ch[None, :]).to(tl.float32)
        x, for_min, for_max = _finite(x, LIM)
        mn = tl.min(for_min, axis=0)
        mx = tl.max(for_max, axis=0)
        q, s, z = _quantize(x, mn[None, :], mx[None, :], clip, floor, BITS, SYM, PKIND, PMAX)
        ok = t >= 0
        co = token_rows(t, ok, start, table_ptr, bh // H, bh % H, cs_slot, cs_b, cs_h, cs_r, PAGED, BLK, 1)
        # the group's one parameter row, as a [G, D] block of identical rows: every token stores the same values
        po = token_rows(t, ok, start, table_ptr, bh // H, bh % H, ps_slot, ps_b, ps_h, ps_r, PAGED, BLK, G)
        first = tl.arange(0, G) == 0
        tl.store(s_ptr + po[:, None] + ch[None, :], s + tl.zeros((G, D), tl.float32), mask=first[:, None])
        if not SYM:
            tl.store(z_ptr + po[:, None] + ch[None, :], z + tl.zeros((G, D), tl.float32), mask=first[:, None])
        _pack_store(c_ptr, q, co, ok, G, D, BITS)


def supports(fmt: StorageFormat, x: torch.Tensor) -> bool:
    """Whether :func:`encode` reproduces the torch codec's parts for a format (plain integer layouts only)."""
    if fmt.kind != "int" or not fmt.plain:
        return False
    d, g = fmt.head_dim, fmt.group
    if PARAM_DTYPE_NAMES.get(fmt.param_dtype) not in _PKIND or (fmt.symmetric and fmt.bits == 1):
        return False
    if not (_pow2(d) and _pow2(g)):
        return False
    if x.dim() != 4 or x.shape[-1] != d or x.dtype not in _X_DTYPES or x.shape[2] == 0:
        return False
    return fmt.axis == "token" or x.shape[2] % g == 0  # a ragged per-channel call raises in torch


def encode(fmt: StorageFormat, x: torch.Tensor, into: PoolTarget | None = None) -> dict[str, torch.Tensor] | None:
    """The stored parts of ``x`` [B, H, T, D] in ``fmt`` computed by Triton, or None when not supported here.
    ``into``: write them straight into a pool's slots instead (the store's tokens from ``into.start`` on; every
    slot they reach already in the table) and return an empty dict."""
    if not available() or not supports(fmt, x):
        return None
    b, h, t, d = x.shape
    x = x.contiguous()
    if into is None:
        nbytes = d * fmt.bits // 8 if fmt.bits <= 4 else d
        pshape = (b, h, t, d // fmt.group) if fmt.axis == "token" else (b, h, t // fmt.group, d)
        scale = torch.empty(pshape, dtype=fmt.param_dtype, device=x.device)
        out = {"codes": torch.empty(b, h, t, nbytes, dtype=torch.uint8, device=x.device), "scale": scale}
        if not fmt.symmetric:
            out["zero"] = torch.empty_like(scale)
        _launch(fmt, x, out, t, out["codes"], 0, 1, False)
        return out
    _launch(fmt, x, into.parts, t, into.table, into.start, into.block_tokens, True)
    return {}


def encode_ring(fmt: StorageFormat, ring: torch.Tensor, parts: dict[str, torch.Tensor], count: torch.Tensor,
                sinks: int, window: int, group: int, rows: int) -> bool:
    """A static layer's flush in one launch (cache/static.py): the ``group`` body tokens ending at
    nq = group * max(1, (count - sinks - window) // group), read from the ring [B, H, R, D] (body token u at slot
    u % R), encoded into rows of ``parts`` ([B, H, rows, ...] by part name) from token nq - group on; the count is
    read on the device, so a CUDA graph replays it.  False (nothing written) where this format needs the torch
    encoder."""
    if not available() or not ring.is_contiguous() or not supports(fmt, ring[:, :, :group]):
        return False
    _launch(fmt, ring, parts, group, parts["codes"], 0, 1, False, (count, sinks, window, rows, ring.shape[2]))
    return True


def _launch(fmt, x, parts, t, table, start, blk, paged, ring=None) -> None:
    """One pack launch over ``t`` tokens per (sequence, head) of ``x`` into ``parts``."""
    b, h, _, d = x.shape
    g, bits, pname = fmt.group, fmt.bits, PARAM_DTYPE_NAMES[fmt.param_dtype]
    codes, scale = parts["codes"], parts["scale"]
    zero = parts.get("zero")
    pk = _PKIND[pname]
    cnt, ring_s, ring_w, ring_rows, n_ring = ring or (codes, 0, 0, 0, 0)
    consts = dict(D=d, G=g, BITS=bits, SYM=fmt.symmetric, PKIND=pk, PMAX=_PMAX[pk], LIM=LIMIT, PAGED=paged, BLK=blk,
                  RING=n_ring)
    args = (x, codes, scale, scale if zero is None else zero, table)
    st = (*slot_strides(codes, paged), *slot_strides(scale, paged), float(fmt.clip), scale_floor(pname),
          cnt, ring_s, ring_w, ring_rows)
    # no FMA contraction: every product is rounded as torch rounds it
    if fmt.axis == "token":
        n = b * h * t
        _pack_token_kernel[(triton.cdiv(n, ROWS),)](*args, n, t, h, start, *st, BR=ROWS, enable_fp_fusion=False,
                                                    **consts)
    else:
        _pack_channel_kernel[(b * h * t // g,)](*args, t, h, start, *st, enable_fp_fusion=False, **consts)
