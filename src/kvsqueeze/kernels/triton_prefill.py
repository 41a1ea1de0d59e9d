"""Triton attention for steps with many queries (prefill on top of a quantized cache), history read in place.

Programs own a (batch * kv head, block of ``BLOCK_M`` query rows) pair; the query rows of one KV head's GQA
group are laid out [rep * Lq] as in the decode kernel, so they share every key/value load.  One launch per
segment (sinks, the packed history - one launch through the block table where the cache keeps a pool, else one
per block -, the window, the step's new tokens): a program loops over the
segment in tiles of ``BLOCK_N`` tokens, unpacks codes in registers, scores with ``tl.dot`` and updates an
online softmax whose running (max, sum, weighted values) state lives in a small float32 buffer [B*Hkv, rows]
that the next segment's launch continues from.  Launches run in token order on one stream, so this is the
same log-sum-exp merge as the decode path, and no score matrix or dequantized history is ever materialised.

Masks are read in place: a bool or additive float mask [B|1, 1, Lq, kv_len], or (mask None) causal among the
new tokens only.  Products run on the matrix units in the query's dtype (fp16 / bf16 operands, float32
accumulation; the stored tokens dequantized in float32 and rounded once to that dtype) or, for float32 queries,
in float32 without TF32 (triton_common.dot).

The tiled kernel unpacks every key and value tile once per ``BLOCK_M`` query rows: for a long chunk that is many
times over (8k new tokens over 24k stored on an H200: 2.0x the time of SDPA over the same history in bf16).  So a
step whose history is short next to its queries (``dense``: the dequantized keys and values at most
``DENSE_RATIO`` x the query's bytes) takes the dense route instead: one launch per stored run writes each token,
dequantized in float32 and rounded once to the query's dtype as the tiled kernel rounds it, into a transient
[B, Hkv, kv_len, D] pair that also gets the exact segments, then PyTorch's scaled_dot_product_attention (flash
attention on a GPU, the new tokens causal from the bottom right) attends over it; rows a bool or -inf mask hides
entirely give 0, as in the tiled kernel.  ``KVSQUEEZE_TRITON_PREFILL_DENSE`` = auto (default) / 1 / 0 forces it.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from ..cache.plan import EXACT, SegmentPlan
from .triton_common import (
    FP_SIDE,
    HAS_TRITON,
    codes16,
    device_table,
    dot_kind,
    interpreting,
    mask_args,
    rotate_query,
    side,
    side_args,
    stored_runs,
    table_width,
    unrotate_rows,
)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .triton_common import dot, load_tokens, masked_scores

DENSE_MODES = ("auto", "1", "0")
DENSE_RATIO = 4  # the dense route's transient keys and values: at most this many times the query's bytes
UNPACK_T = 64  # tokens per program of the dense route's unpacking launch
BLOCK_M = 128  # query rows per program (every key/value tile is unpacked once per BLOCK_M rows)
BLOCK_N = 64  # keys per tile
NUM_WARPS = 8  # for head_dim >= 128 (4 below)


def _launch_from_env() -> None:
    """``KVSQUEEZE_TRITON_PREFILL=BLOCK_M:BLOCK_N:NUM_WARPS`` sets the launch shape (tuning on another GPU)."""
    global BLOCK_M, BLOCK_N, NUM_WARPS
    text = os.environ.get("KVSQUEEZE_TRITON_PREFILL", "")
    if text:
        try:
            bm, bn, warps = (int(x) for x in text.split(":"))
        except ValueError:
            raise ValueError(f"KVSQUEEZE_TRITON_PREFILL is BLOCK_M:BLOCK_N:NUM_WARPS (e.g. 128:64:8), got {text!r}") \
                from None
        if min(bm, bn) < 16 or bm & (bm - 1) or bn & (bn - 1) or warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"KVSQUEEZE_TRITON_PREFILL {text}: BLOCK_M and BLOCK_N powers of two >= 16, NUM_WARPS a "
                             "power of two up to 16")
        BLOCK_M, BLOCK_N, NUM_WARPS = bm, bn, warps


_launch_from_env()

if HAS_TRITON:

    @triton.jit
    def _prefill_segment_kernel(
        q_ptr, m_ptr, l_ptr, acc_ptr, mask_ptr, table_ptr,
        kx_ptr, ks_ptr, kz_ptr, vx_ptr, vs_ptr, vz_ptr, kt_ptr, vt_ptr,
        kx_ss, kx_sb, kx_sh, kx_sr, kp_ss, kp_sb, kp_sh, kp_sr,
        vx_ss, vx_sb, vx_sh, vx_sr, vp_ss, vp_sb, vp_sh, vp_sr,
        msb, msr, msc,
        first, n_tok, col0, kpos0, qpos0, R, LQ,
        HKV: tl.constexpr, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, MASK: tl.constexpr,
        DOT: tl.constexpr, PAGED: tl.constexpr, BLK: tl.constexpr, W: tl.constexpr,
        KKIND: tl.constexpr, KBITS: tl.constexpr, KG: tl.constexpr, KSYM: tl.constexpr, KPR: tl.constexpr,
        KNHI: tl.constexpr,
        VKIND: tl.constexpr, VBITS: tl.constexpr, VG: tl.constexpr, VSYM: tl.constexpr, VPR: tl.constexpr,
        VNHI: tl.constexpr, KH16: tl.constexpr, VH16: tl.constexpr,
    ):
        """MASK: 0 none, 1 bool mask (as uint8), 2 additive float mask, 3 causal by absolute position; KH16 /
        VH16: triton_common.codes16."""
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
        n_end = n_tok
        if MASK == 3:  # causal: no tile past the last token the tile's latest query sees
            n_end = tl.minimum(n_tok, tl.max(tl.where(r_ok, lq, 0)) + qpos0 - kpos0 + 1)
        for t0 in range(0, n_end, BN):
            t_idx = t0 + tl.arange(0, BN)
            t_ok = t_idx < n_tok
            k = load_tokens(kx_ptr, ks_ptr, kz_ptr, kt_ptr, t_idx, t_ok, first, table_ptr, b, h, kx_ss, kx_sb,
                            kx_sh, kx_sr, kp_ss, kp_sb, kp_sh, kp_sr, ch, PAGED, BLK, KPR, KKIND, KBITS, KG, KSYM, KNHI,
                            D, W, KH16)
            s = dot(q, tl.trans(k), DOT)  # [BM, BN]
            s = masked_scores(s, r_ok[:, None] & t_ok[None, :], b, lq, t_idx, col0, kpos0 - qpos0, mask_ptr, msb, msr,
                              msc, MASK)
            m_new = tl.maximum(m, tl.max(s, axis=1))
            safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # fully masked rows so far stay zero
            p = tl.exp(s - safe[:, None])
            corr = tl.exp(m - safe)
            v = load_tokens(vx_ptr, vs_ptr, vz_ptr, vt_ptr, t_idx, t_ok, first, table_ptr, b, h, vx_ss, vx_sb,
                            vx_sh, vx_sr, vp_ss, vp_sb, vp_sh, vp_sr, ch, PAGED, BLK, VPR, VKIND, VBITS, VG, VSYM, VNHI,
                            D, W, VH16)
            l_ = l_ * corr + tl.sum(p, axis=1)
            acc = acc * corr[:, None] + dot(p, v, DOT)
            m = m_new
        tl.store(m_ptr + st, m, mask=r_ok)
        tl.store(l_ptr + st, l_, mask=r_ok)
        tl.store(acc_ptr + st[:, None] * D + ch[None, :], acc, mask=r_ok[:, None])


if HAS_TRITON:

    @triton.jit
    def _unpack_kernel(
        ko_ptr, vo_ptr, table_ptr, kx_ptr, ks_ptr, kz_ptr, vx_ptr, vs_ptr, vz_ptr, kt_ptr, vt_ptr,
        kx_ss, kx_sb, kx_sh, kx_sr, kp_ss, kp_sb, kp_sh, kp_sr,
        vx_ss, vx_sb, vx_sh, vx_sr, vp_ss, vp_sb, vp_sh, vp_sr,
        o_sb, o_sh, o_st, first, n_tok,
        HKV: tl.constexpr, D: tl.constexpr, BT: tl.constexpr, PAGED: tl.constexpr, BLK: tl.constexpr,
        W: tl.constexpr,
        KKIND: tl.constexpr, KBITS: tl.constexpr, KG: tl.constexpr, KSYM: tl.constexpr, KPR: tl.constexpr,
        KNHI: tl.constexpr,
        VKIND: tl.constexpr, VBITS: tl.constexpr, VG: tl.constexpr, VSYM: tl.constexpr, VPR: tl.constexpr,
        VNHI: tl.constexpr,
    ):
        """Tokens [BT c, BT (c + 1)) of one (sequence, kv head) of a stored run (a pool from store index ``first``,
        or one block) dequantized (load_tokens, float32) and written in the output's dtype to rows of ``ko_ptr`` /
        ``vo_ptr`` [B, H, n_tok, D] (strides o_*; rotated sides stay in the rotated space)."""
        bh = tl.program_id(0)
        b = bh // HKV
        h = bh % HKV
        t = tl.program_id(1) * BT + tl.arange(0, BT)
        t_ok = t < n_tok
        ch = tl.arange(0, D)
        out = b.to(tl.int64) * o_sb + h.to(tl.int64) * o_sh + t.to(tl.int64)[:, None] * o_st + ch[None, :]
        k = load_tokens(kx_ptr, ks_ptr, kz_ptr, kt_ptr, t, t_ok, first, table_ptr, b, h, kx_ss, kx_sb, kx_sh, kx_sr,
                        kp_ss, kp_sb, kp_sh, kp_sr, ch, PAGED, BLK, KPR, KKIND, KBITS, KG, KSYM, KNHI, D, W, 0)
        tl.store(ko_ptr + out, k.to(ko_ptr.dtype.element_ty), mask=t_ok[:, None])
        v = load_tokens(vx_ptr, vs_ptr, vz_ptr, vt_ptr, t, t_ok, first, table_ptr, b, h, vx_ss, vx_sb, vx_sh, vx_sr,
                        vp_ss, vp_sb, vp_sh, vp_sr, ch, PAGED, BLK, VPR, VKIND, VBITS, VG, VSYM, VNHI, D, W, 0)
        tl.store(vo_ptr + out, v.to(vo_ptr.dtype.element_ty), mask=t_ok[:, None])


def dense_mode() -> str:
    """``KVSQUEEZE_TRITON_PREFILL_DENSE``: auto (default), 1 (always the dense route) or 0 (always the tiled kernel);
    ValueError naming those otherwise."""
    mode = os.environ.get("KVSQUEEZE_TRITON_PREFILL_DENSE", "") or "auto"
    if mode not in DENSE_MODES:
        raise ValueError(f"KVSQUEEZE_TRITON_PREFILL_DENSE={mode!r}; allowed: {', '.join(DENSE_MODES)}")
    return mode


def dense(query: torch.Tensor, plan: SegmentPlan) -> bool:
    """Whether a prefill step takes the dense route: forced by dense_mode, else when its dequantized keys and values
    (2 x kv heads x kv_len rows) are at most DENSE_RATIO x the query's rows (heads x Lq)."""
    mode = dense_mode()
    if mode != "auto":
        return mode == "1"
    _, hq, lq, _ = query.shape
    return 2 * plan.new.k.shape[1] * plan.kv_length(lq) <= DENSE_RATIO * hq * lq


def _attend_dense(query: torch.Tensor, plan: SegmentPlan, mask: torch.Tensor | None, scaling: float
                  ) -> torch.Tensor:
    """The dense route (module docstring): every visible token's key and value in the query's dtype, once, then
    scaled_dot_product_attention."""
    b, hq, lq, d = query.shape
    hkv = plan.new.k.shape[1]
    first, kv_len = plan.first_visible, plan.kv_length(lq)
    # the query's dtype on a GPU; float32 under the interpreter, whose tiled kernel computes in float32 too (dot_kind)
    work = torch.float32 if interpreting() else query.dtype
    keys = torch.empty(b, hkv, kv_len, d, dtype=work, device=query.device)
    values = torch.empty_like(keys)
    ks, vs = side(plan.key_format), side(plan.value_format)

    runs = stored_runs(plan)  # (a pool: one launch; else one per block)
    for run in runs:
        (kt, kst, kpr), (vt, vst, vpr), pool = run.k, run.v, run.pool
        ko, vo = keys[:, :, run.start - first:], values[:, :, run.start - first:]
        _unpack_kernel[(b * hkv, triton.cdiv(run.n, UNPACK_T))](
            ko, vo, ko if pool is None else pool.table, *kt, *vt, device_table(ks, query.device) if ks.rotated else ko,
            device_table(vs, query.device) if vs.rotated else ko, *kst, *vst, *ko.stride()[:3],
            0 if pool is None else pool.first, run.n, HKV=hkv, D=d, BT=UNPACK_T, PAGED=pool is not None,
            BLK=1 if pool is None else pool.block_tokens, W=table_width(d), **ks.consts("K"), KPR=kpr,
            **vs.consts("V"), VPR=vpr, num_warps=4,
        )
    for seg in plan.segments:
        if seg.kind == EXACT and seg.length:
            keys[:, :, seg.start - first:seg.start - first + seg.length] = seg.k
            values[:, :, seg.start - first:seg.start - first + seg.length] = seg.v
    for sd, x in ((ks, keys), (vs, values)):
        if sd.rotated:  # stored tokens back from the rotated space (the tiled kernel rotates the query instead)
            table = device_table(sd, query.device).to(x.dtype)
            for run in runs:
                at = run.start - first
                x[:, :, at:at + run.n] = unrotate_rows(x[:, :, at:at + run.n], table)
    if mask is None:
        attn_mask, visible = causal_lower_right(lq, kv_len), None  # history visible, new tokens causal
    else:
        attn_mask = mask[..., :kv_len]
        visible = attn_mask.any(-1) if attn_mask.dtype == torch.bool else (attn_mask > float("-inf")).any(-1)
        if attn_mask.dtype != torch.bool:
            attn_mask = attn_mask.to(work)
    # one call per query head of each GQA group (heads g, g + rep, ... read kv heads 0, 1, ...): equal head counts,
    # which every SDPA backend takes (flash and memory-efficient ones included; not all take enable_gqa), the
    # group's heads copied together first (dense strides, whatever a backend asks of its inputs)
    rep = hq // hkv
    q = query.to(work)
    out = torch.empty_like(q)
    for g in range(rep):
        out[:, g::rep] = F.scaled_dot_product_attention(q[:, g::rep].contiguous(), keys, values, attn_mask=attn_mask,
                                                        scale=scaling)
    if visible is not None:  # rows that see nothing give 0, as the tiled kernel's (SDPA may give NaN)
        out = torch.where(visible[..., None], out, torch.zeros((), dtype=out.dtype, device=out.device))
    return out.to(query.dtype)


def attend_prefill(query: torch.Tensor, plan: SegmentPlan, mask: torch.Tensor | None, scaling: float
                   ) -> torch.Tensor:
    """Attention of ``query`` [B, Hq, Lq, D] over the plan (stored segments plus the step's new tokens): the dense
    route where :func:`dense` says so, else the tiled kernel."""
    plan.check_mask(mask, query.shape[2])
    if dense(query, plan):
        return _attend_dense(query, plan, mask, scaling)
    b, hq, lq, d = query.shape
    hkv = plan.new.k.shape[1]
    rep = hq // hkv
    r = rep * lq
    dev = query.device
    q = (query.float() * scaling).reshape(b, hkv, r, d).contiguous()
    first = plan.first_visible
    m_state = torch.full((b * hkv, r), float("-inf"), device=dev)
    l_state = torch.zeros(b * hkv, r, device=dev)
    acc = torch.zeros(b * hkv, r, d, device=dev)
    mask_arg, mst, hist_kind = mask_args(mask, m_state)
    bm, bn = BLOCK_M, BLOCK_N  # module attributes, so tests can shrink them for the interpreter
    grid = (b * hkv, triton.cdiv(r, bm))
    warps = NUM_WARPS if d >= 128 else min(NUM_WARPS, 4)

    ks, vs = side(plan.key_format), side(plan.value_format)
    k_tab, v_tab = device_table(ks, dev), device_table(vs, dev)
    q_rot = rotate_query(q, k_tab) if ks.rotated else q  # rotated keys: scores in the rotated space

    def launch(start: int, n: int, kargs, vargs, k_side, v_side, mkind: int, pool=None, stored=False) -> None:
        if n == 0:
            return
        (kt, kst, kpr), (vt, vst, vpr) = kargs, vargs
        _prefill_segment_kernel[grid](
            q_rot if stored else q, m_state, l_state, acc, mask_arg, m_state if pool is None else pool.table,
            *kt, *vt, k_tab if stored and ks.rotated else m_state, v_tab if stored and vs.rotated else m_state,
            *kst, *vst, *mst, 0 if pool is None else pool.first, n, start - first, start, plan.query_start, r, lq,
            HKV=hkv, D=d, BM=bm, BN=bn, MASK=mkind, DOT=dot_kind(query.dtype), PAGED=pool is not None,
            BLK=1 if pool is None else pool.block_tokens, W=table_width(d),
            **k_side.consts("K"), KPR=kpr, **v_side.consts("V"), VPR=vpr, **codes16(dot_kind(query.dtype)),
            num_warps=warps,
        )

    # the stored tokens first (the online softmax is order-free): rotated values leave the running sums in the
    # rotated space, turned back once before the exact tokens add theirs
    for run in stored_runs(plan):  # a pool: one launch through the block table; else one per block
        launch(run.start, run.n, run.k, run.v, ks, vs, hist_kind, run.pool, stored=True)
    if vs.rotated:
        acc = unrotate_rows(acc, v_tab).contiguous()
    for seg in plan.segments:
        if seg.kind == EXACT:
            launch(seg.start, seg.length, side_args(None, x=seg.k), side_args(None, x=seg.v), FP_SIDE, FP_SIDE,
                   (3 if mask is None else hist_kind) if seg.is_new else hist_kind)
    out = acc / l_state.clamp_min(1e-30)[..., None]
    return out.reshape(b, hq, lq, d).to(query.dtype)
