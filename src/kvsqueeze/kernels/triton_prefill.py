"""Triton attention for steps with many queries (prefill on top of a quantized cache), history read in place.

Programs own a (batch * kv head, block of ``BLOCK_M`` query rows) pair; the query rows of one KV head's GQA
group are laid out [rep * Lq] as in the decode kernel, so they share every key/value load.  One launch per
segment (sinks, each packed history block, the window, the step's new tokens): a program loops over the
segment in tiles of ``BLOCK_N`` tokens, unpacks codes in registers, scores with ``tl.dot`` and updates an
online softmax whose running (max, sum, weighted values) state lives in a small float32 buffer [B*Hkv, rows]
that the next segment's launch continues from.  Launches run in token order on one stream, so this is the
same log-sum-exp merge as the decode path, and no score matrix or dequantized history is ever materialised.

Masks are read in place: a bool or additive float mask [B|1, 1, Lq, kv_len], or (mask None) causal among the
new tokens only.  ``DOT_PRECISION`` is "ieee" (float32 products, matching the reference to ~1e-6); "tf32" is
faster on tensor cores at ~1e-3 relative error.
"""

from __future__ import annotations

import torch

from ..cache.plan import EXACT, SegmentPlan
from .triton_decode import HAS_TRITON, _parts, _side

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .triton_decode import _load_side

BLOCK_M = 32  # query rows per program
BLOCK_N = 32  # keys per tile
DOT_PRECISION = "ieee"
MIN_HEAD_DIM = 16  # tl.dot needs every dim >= 16

if HAS_TRITON:

    @triton.jit
    def _prefill_segment_kernel(
        q_ptr, m_ptr, l_ptr, acc_ptr, mask_ptr,
        kx_ptr, ks_ptr, kz_ptr, vx_ptr, vs_ptr, vz_ptr,
        skb, skh, skr, sksb, sksh, sksr, svb, svh, svr, svsb, svsh, svsr,
        msb, msr, msc,
        n_tok, col0, kpos0, qpos0, R, LQ,
        HKV: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, MASK: tl.constexpr,
        PREC: tl.constexpr,
        KKIND: tl.constexpr, KBITS: tl.constexpr, KG: tl.constexpr, KSYM: tl.constexpr,
        VKIND: tl.constexpr, VBITS: tl.constexpr, VG: tl.constexpr, VSYM: tl.constexpr,
    ):
        """MASK: 0 none, 1 bool mask (as uint8), 2 additive float mask, 3 causal by absolute position."""
        bh = tl.program_id(0)
        b = bh // HKV
        h = bh % HKV
        rows = tl.program_id(1) * BM + tl.arange(0, BM)
        r_ok = rows < R
        ch = tl.arange(0, D)
        st = bh * R + rows
        q = tl.load(q_ptr + st[:, None] * D + ch[None, :], mask=r_ok[:, None], other=0.0)
        m = tl.load(m_ptr + st, mask=r_ok, other=float("-inf"))
        l_ = tl.load(l_ptr + st, mask=r_ok, other=0.0)
        acc = tl.load(acc_ptr + st[:, None] * D + ch[None, :], mask=r_ok[:, None], other=0.0)
        lq = rows % LQ  # query index of each row (rows are [rep, Lq] flattened)
        for t0 in range(0, n_tok, BN):
            t_idx = t0 + tl.arange(0, BN)
            t_ok = t_idx < n_tok
            k = _load_side(kx_ptr, ks_ptr, kz_ptr, b * skb + h * skh, skr, b * sksb + h * sksh, sksr, t_idx, t_ok,
                           ch, KKIND, KBITS, KG, KSYM)
            s = tl.dot(q, tl.trans(k), input_precision=PREC)  # [BM, BN]
            valid = r_ok[:, None] & t_ok[None, :]
            if MASK == 1:
                mv = tl.load(mask_ptr + b * msb + lq[:, None] * msr + (col0 + t_idx)[None, :] * msc, mask=valid,
                             other=0)
                valid = valid & (mv != 0)
            elif MASK == 2:
                s = s + tl.load(mask_ptr + b * msb + lq[:, None] * msr + (col0 + t_idx)[None, :] * msc,
                                mask=valid, other=0.0).to(tl.float32)
            elif MASK == 3:
                valid = valid & ((kpos0 + t_idx)[None, :] <= (qpos0 + lq)[:, None])
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked rows so far stay zero
            p = tl.exp(s - safe[:, None])
            corr = tl.exp(m - safe)
            v = _load_side(vx_ptr, vs_ptr, vz_ptr, b * svb + h * svh, svr, b * svsb + h * svsh, svsr, t_idx, t_ok,
                           ch, VKIND, VBITS, VG, VSYM)
            l_ = l_ * corr + tl.sum(p, axis=1)
            acc = acc * corr[:, None] + tl.dot(p, v, input_precision=PREC)
            m = m_new
        tl.store(m_ptr + st, m, mask=r_ok)
        tl.store(l_ptr + st, l_, mask=r_ok)
        tl.store(acc_ptr + st[:, None] * D + ch[None, :], acc, mask=r_ok[:, None])


def supports_query(d: int) -> bool:
    return d >= MIN_HEAD_DIM and not d & (d - 1)


_FP_SIDE = (0, 16, 1, False)


def _fp_args(x: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], tuple[int, ...]]:
    """Kernel tensors and (batch, head, row) strides of a full-precision segment [B, H, n, D]."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    st = (x.stride(0), x.stride(1), x.stride(2))
    return (x, x, x), st + st


def _block_args(fmt, parts):
    x, s, z = _parts(fmt, parts)
    return (x, s, z), (x.stride(0), x.stride(1), x.stride(2), s.stride(0), s.stride(1), s.stride(2))


def attend_prefill(query: torch.Tensor, plan: SegmentPlan, mask: torch.Tensor | None, scaling: float
                   ) -> torch.Tensor:
    """Attention of ``query`` [B, Hq, Lq, D] over the plan (stored segments plus the step's new tokens)."""
    b, hq, lq, d = query.shape
    hkv = plan.new.k.shape[1]
    rep = hq // hkv
    r = rep * lq
    dev = query.device
    q = (query.float() * scaling).reshape(b, hkv, r, d).contiguous()
    first = plan.first_visible
    plan.check_mask(mask, lq)
    m_state = torch.full((b * hkv, r), float("-inf"), device=dev)
    l_state = torch.zeros(b * hkv, r, device=dev)
    acc = torch.zeros(b * hkv, r, d, device=dev)
    if mask is None:
        mask_arg, mst, hist_kind = m_state, (0, 0, 0), 0
    else:
        mm = mask[:, 0]
        hist_kind = 1 if mm.dtype == torch.bool else 2
        mask_arg = mm.view(torch.uint8) if hist_kind == 1 else mm
        mst = (mm.stride(0) if mm.shape[0] > 1 else 0, mm.stride(1), mm.stride(2))
    bm, bn = BLOCK_M, BLOCK_N  # module attributes, so tests can shrink them for the interpreter
    grid = (b * hkv, triton.cdiv(r, bm))
    warps = 8 if d >= 128 else 4

    def launch(start: int, n: int, kargs, kst, vargs, vst, ks, vs, mkind: int) -> None:
        if n == 0:
            return
        _prefill_segment_kernel[grid](
            q, m_state, l_state, acc, mask_arg, *kargs, *vargs, *kst, *vst, *mst,
            n, start - first, start, plan.query_start, r, lq,
            HKV=hkv, D=d, BM=bm, BN=bn, MASK=mkind, PREC=DOT_PRECISION,
            KKIND=ks[0], KBITS=ks[1], KG=ks[2], KSYM=ks[3], VKIND=vs[0], VBITS=vs[1], VG=vs[2], VSYM=vs[3],
            num_warps=warps,
        )

    def fp(start: int, k: torch.Tensor, v: torch.Tensor, mkind: int) -> None:
        (ka, kst), (va, vst) = _fp_args(k), _fp_args(v)
        launch(start, k.shape[2], ka, kst, va, vst, _FP_SIDE, _FP_SIDE, mkind)

    ks, vs = _side(plan.key_format), _side(plan.value_format)
    for seg in plan.segments:
        if seg.kind == EXACT:
            fp(seg.start, seg.k, seg.v, (3 if mask is None else hist_kind) if seg.is_new else hist_kind)
        elif seg.length:
            (ka, kst), (va, vst) = _block_args(plan.key_format, seg.k_parts), _block_args(plan.value_format,
                                                                                          seg.v_parts)
            launch(seg.start, seg.length, ka, kst, va, vst, ks, vs, hist_kind)
    out = acc / l_state.clamp_min(1e-30)[..., None]
    return out.reshape(b, hq, lq, d).to(query.dtype)
