"""Triton GPU kernels over the packed cache: decode attention (prefill and packing in sibling modules).

Imported lazily by the adapter's backend switch; ``import kvsqueeze`` never needs Triton.  Under
``TRITON_INTERPRET=1`` the kernels also run on CPU tensors (slowly), which is how they are tested without a GPU.

Decode (``attend``, split-K as in flash-decoding): programs own a (batch * kv head, chunk of tokens) pair (chunks
of at least ``CHUNK`` tokens, longer where batch x kv heads already give ``TARGET_PROGRAMS`` programs); a program
unpacks ``BLOCK_T`` tokens of codes at a time in registers, applies the group parameters there or folds them into
the products (triton_common.folds), scores all query rows of its KV head (GQA rows share the loads; the rows
padded to a tile of at least 16, scores and weighted values as ``tl.dot`` products on the matrix units, operands
in the query's dtype), keeps an online softmax and writes its partial (max, sum, weighted values).  Where the
cache keeps its blocks in a pool
(cache/pool.py: every device cache) one launch walks the whole stored history through the block table; otherwise
one launch per stored block.  A finishing launch, one program per (batch, kv head), merges the partials exactly
by log-sum-exp, attends to the full-precision segments itself (sinks, window, the step's new tokens: a few hundred
tokens at most) and writes the output in the query's dtype: two launches per layer and step whatever the context
length, no host synchronisation, the query cast and scaled and the masks read in place.  Steps longer than
``MAX_QUERIES`` tokens (prefill on top of a cache) go to :mod:`kvsqueeze.kernels.triton_prefill`, which tiles the
queries too.  Quantize-and-pack on append is :mod:`kvsqueeze.kernels.triton_pack`.

Supported in the fused kernels (decode and prefill; tests/kernels/test_triton_formats.py): fp blocks of the model
dtype, integer codes of 1-8 bits per channel or per token groups, symmetric or not, fp8 e4m3/e5m2 with a scale
per token, head or tensor, and rotated codebooks (plain or centred, fractional widths: the query is rotated once and
the stored tokens' weighted values rotated back once, as the C++ kernel does), all with fp32/fp16/bf16 parameters.
Calibrated layouts (permuted, clipped per group, transformed, pre-RoPE), ternary codes and rotated codes with a
residual sketch take the reference, and ``path`` says so.
"""

from __future__ import annotations

import math
import os

import torch

from ..cache.plan import EXACT, SegmentPlan
from . import reference
from .triton_common import (
    HAS_TRITON,
    MIN_DOT,
    Side,
    available,
    codes16,
    device_table,
    dot_head_dim,
    dot_kind,
    folds,
    interpreting,
    mask_args,
    rotate_query,
    side,
    stored_runs,
    table_width,
    unrotate_rows,
)

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .triton_common import dot, dot_acc, load_folded, load_tokens, masked_scores

__all__ = ["attend", "available", "interpreting", "path", "supports"]

MAX_QUERIES = 16
CHUNK = 256  # the fewest stored tokens a program takes
# launch shape: 32:4096:1 (one warp per program, many programs) was the fastest for kivi-4, kivi-2, int8 and fp8 at
# 32k x 16 on an H200 (2026-11-27, BENCHMARKS.md section 2: kivi-4 0.716 against 0.999 ms), but one device test
# (int4, float32, a mask broadcast over a batch of 3) then failed with a misaligned address that was not found; the
# default stays the shape every device test passed with (KVSQUEEZE_TRITON_DECODE=32:4096:1 opts in)
TARGET_PROGRAMS = 1024  # programs per launch worth having (waves of a GPU's SMs): longer chunks beyond it
BLOCK_T = 32  # tokens a program unpacks and scores per loop iteration
NUM_WARPS = 4  # warps per program of the partials launch
NUM_STAGES = 0  # software-pipelining depth of the partials launch's loop (0: Triton's default)


def parse_launch(text: str) -> tuple[int, int, int, int, int]:
    """(BLOCK_T, TARGET_PROGRAMS, NUM_WARPS, CHUNK, NUM_STAGES) from ``BT:PROGRAMS:WARPS[:CHUNK[:STAGES]]`` (CHUNK
    defaults to the module's, STAGES to 0: Triton's own); ValueError naming what is allowed otherwise."""
    try:
        bt, programs, warps, *rest = (int(x) for x in text.split(":"))
        if len(rest) > 2:
            raise ValueError
        chunk, stages = (*rest, *(CHUNK, 0)[len(rest):])  # the fields left out take their defaults
    except ValueError:
        raise ValueError(f"a decode launch shape is BLOCK_T:TARGET_PROGRAMS:NUM_WARPS[:CHUNK[:STAGES]] (e.g. "
                         f"32:1024:4), got {text!r}") from None
    if bt < 16 or bt & (bt - 1) or warps not in (1, 2, 4, 8, 16) or programs < 1 or chunk < bt or not 0 <= stages <= 8:
        raise ValueError(f"decode launch shape {text}: BLOCK_T a power of two >= 16, NUM_WARPS 1-16 (a power of two), "
                         "TARGET_PROGRAMS >= 1, CHUNK >= BLOCK_T, STAGES 0-8 (0: Triton's default)")
    return bt, programs, warps, chunk, stages


def launch_text() -> str:
    """The current launch shape as ``parse_launch`` reads it: ``BT:PROGRAMS:WARPS:CHUNK[:STAGES]``."""
    return f"{BLOCK_T}:{TARGET_PROGRAMS}:{NUM_WARPS}:{CHUNK}" + (f":{NUM_STAGES}" if NUM_STAGES else "")


def launch_options() -> dict:
    """The partials launch's num_warps (and num_stages, where set)."""
    return {"num_warps": NUM_WARPS, **({"num_stages": NUM_STAGES} if NUM_STAGES else {})}


def _launch_from_env() -> None:
    """``KVSQUEEZE_TRITON_DECODE=BLOCK_T:TARGET_PROGRAMS:NUM_WARPS[:CHUNK[:STAGES]]`` sets the launch shape (tuning
    on another GPU; benchmarks/attention_micro.py --gpu-configs times candidates)."""
    global BLOCK_T, TARGET_PROGRAMS, NUM_WARPS, CHUNK, NUM_STAGES
    text = os.environ.get("KVSQUEEZE_TRITON_DECODE", "")
    if text:
        try:
            BLOCK_T, TARGET_PROGRAMS, NUM_WARPS, CHUNK, NUM_STAGES = parse_launch(text)
        except ValueError as err:
            raise ValueError(f"KVSQUEEZE_TRITON_DECODE: {err}") from None


_launch_from_env()

if HAS_TRITON:

    @triton.jit
    def _scores(q, k, DOT: tl.constexpr):
        """Scores [RP, BT] of the (scaled) query rows q [RP, D] against tokens k [BT, D]."""
        return dot(q, tl.trans(k), DOT)

    @triton.jit
    def _softmax_step(m, l_, acc, s):
        """One tile of the online softmax: the new max and sum, the weighted values so far rescaled, the tile's
        weights p [RP, BT] (their product with the tile's values is the caller's) and the rescaling factor."""
        m_new = tl.maximum(m, tl.max(s, axis=1))
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet stay zero
        p = tl.exp(s - safe[:, None])
        corr = tl.exp(m - safe)
        return m_new, l_ * corr + tl.sum(p, axis=1), acc * corr[:, None], p, corr

    @triton.jit
    def _online(m, l_, acc, s, v, DOT: tl.constexpr):
        """One tile of the online softmax over scores s [RP, BT] and values v [BT, D]."""
        m, l_, acc, p, _ = _softmax_step(m, l_, acc, s)
        return m, l_, dot_acc(p, v, acc, DOT)

    @triton.jit
    def _folded_scores(q, qsum, raw, a, c, KIND: tl.constexpr, DOT: tl.constexpr):
        """Scores of q [RP, D] against keys raw * a + c (load_folded) without dequantizing them."""
        if KIND == 2:  # per-channel parameters: into the query
            s = dot(q * a[None, :], tl.trans(raw), DOT) + tl.sum(q * c[None, :], axis=1)[:, None]
        elif KIND == 1:  # per-token parameters: onto the scores
            s = dot(q, tl.trans(raw), DOT) * a[None, :] + qsum[:, None] * c[None, :]
        elif KIND == 0:
            s = dot(q, tl.trans(raw), DOT)
        else:
            s = dot(q, tl.trans(raw), DOT) * a[None, :]
        return s

    @triton.jit
    def _folded_values(acc, p, raw, a, c, KIND: tl.constexpr, DOT: tl.constexpr):
        """(acc + the weighted values p [RP, BT] @ (raw * a + c) without dequantizing them, and a term [RP] each
        row adds to all its channels, which the caller sums across tiles and adds once at the end)."""
        row = tl.zeros((p.shape[0],), tl.float32)
        if KIND == 2:  # per-channel parameters: onto the product
            acc = acc + dot(p, raw, DOT) * a[None, :] + tl.sum(p, axis=1)[:, None] * c[None, :]
        elif KIND == 1:  # per-token parameters: into the weights (sums taken by the matrix units)
            acc = dot_acc(p * a[None, :], raw, acc, DOT)
            row = tl.sum(p * c[None, :], axis=1)
        elif KIND == 0:
            acc = dot_acc(p, raw, acc, DOT)
        else:
            acc = dot_acc(p * a[None, :], raw, acc, DOT)
        return acc, row

    @triton.jit
    def _partials_kernel(
        q_ptr, m_ptr, l_ptr, acc_ptr, mask_ptr, table_ptr,
        kx_ptr, ks_ptr, kz_ptr, vx_ptr, vs_ptr, vz_ptr, kt_ptr, vt_ptr,
        kx_ss, kx_sb, kx_sh, kx_sr, kp_ss, kp_sb, kp_sh, kp_sr,
        vx_ss, vx_sb, vx_sh, vx_sr, vp_ss, vp_sb, vp_sh, vp_sr,
        m_sb, m_sq, m_sc,
        first, n_tok, col0, part0, n_parts, scaling, cnt_ptr,
        R: tl.constexpr, RP: tl.constexpr, LQ: tl.constexpr, D: tl.constexpr, HKV: tl.constexpr,
        CH, BT: tl.constexpr, PAGED: tl.constexpr, BLK: tl.constexpr, MASK: tl.constexpr,
        W: tl.constexpr, NDEV: tl.constexpr, DOT: tl.constexpr, KFOLD: tl.constexpr, VFOLD: tl.constexpr,
        KKIND: tl.constexpr, KBITS: tl.constexpr, KG: tl.constexpr, KSYM: tl.constexpr, KPR: tl.constexpr,
        KNHI: tl.constexpr,
        VKIND: tl.constexpr, VBITS: tl.constexpr, VG: tl.constexpr, VSYM: tl.constexpr, VPR: tl.constexpr,
        VNHI: tl.constexpr, KH16: tl.constexpr, VH16: tl.constexpr,
    ):
        """Partial softmax state of the query rows of one (sequence, kv head) over tokens [CH c, CH (c + 1)) of the
        stored tokens (n_tok of them, from a pool or one block); CH, a multiple of BT, is an argument so that the
        split can follow the context without a new compilation.  NDEV: n_tok is read from cnt_ptr[0] on the device
        (a static cache's step: the launch's arguments never change, so a CUDA graph can replay it).  KFOLD / VFOLD:
        the side is read by load_folded, its parameters folded into the products (triton_common.folds).  KH16 /
        VH16: triton_common.codes16 (2- and 4-bit codes made into the dots' 16-bit operands from their bits)."""
        if NDEV:
            n_tok = tl.load(cnt_ptr)
        bh = tl.program_id(0)
        chunk = tl.program_id(1)
        b = bh // HKV
        h = bh % HKV
        rows = tl.arange(0, RP)
        ch = tl.arange(0, D)
        r_ok = rows < R
        q = tl.load(q_ptr + (bh * R + rows)[:, None] * D + ch[None, :], mask=r_ok[:, None], other=0.0)
        q = q.to(tl.float32) * scaling
        qsum = tl.sum(q, axis=1)
        lq = rows % LQ  # rows are [rep, Lq] flattened
        m = tl.full((RP,), float("-inf"), tl.float32)
        l_ = tl.zeros((RP,), tl.float32)
        acc = tl.zeros((RP, D), tl.float32)
        vrow = tl.zeros((RP,), tl.float32)
        for t0 in range(0, CH, BT):
            t = chunk * CH + t0 + tl.arange(0, BT)
            t_ok = t < n_tok
            if KFOLD:
                kr, ka, kc = load_folded(kx_ptr, ks_ptr, kz_ptr, kt_ptr, t, t_ok, first, table_ptr, b, h, kx_ss, kx_sb,
                                         kx_sh, kx_sr, kp_ss, kp_sb, kp_sh, kp_sr, ch, PAGED, BLK, KPR, KKIND, KBITS,
                                         KSYM, D, KH16)
                s = _folded_scores(q, qsum, kr, ka, kc, KKIND, DOT)
            else:
                k = load_tokens(kx_ptr, ks_ptr, kz_ptr, kt_ptr, t, t_ok, first, table_ptr, b, h, kx_ss, kx_sb, kx_sh,
                                kx_sr, kp_ss, kp_sb, kp_sh, kp_sr, ch, PAGED, BLK, KPR, KKIND, KBITS, KG, KSYM, KNHI, D,
                                W, KH16)
                s = _scores(q, k, DOT)  # [RP, BT]
            s = masked_scores(s, r_ok[:, None] & t_ok[None, :], b, lq, t, col0, 0, mask_ptr, m_sb, m_sq, m_sc, MASK)
            m, l_, acc, p, corr = _softmax_step(m, l_, acc, s)
            if VFOLD:
                vr, va, vc = load_folded(vx_ptr, vs_ptr, vz_ptr, vt_ptr, t, t_ok, first, table_ptr, b, h, vx_ss, vx_sb,
                                         vx_sh, vx_sr, vp_ss, vp_sb, vp_sh, vp_sr, ch, PAGED, BLK, VPR, VKIND, VBITS,
                                         VSYM, D, VH16)
                acc, row = _folded_values(acc, p, vr, va, vc, VKIND, DOT)
                vrow = vrow * corr + row
            else:
                v = load_tokens(vx_ptr, vs_ptr, vz_ptr, vt_ptr, t, t_ok, first, table_ptr, b, h, vx_ss, vx_sb, vx_sh,
                                vx_sr, vp_ss, vp_sb, vp_sh, vp_sr, ch, PAGED, BLK, VPR, VKIND, VBITS, VG, VSYM, VNHI, D,
                                W, VH16)
                acc = dot_acc(p, v, acc, DOT)
        acc += vrow[:, None]  # the row terms of every tile, rescaled as acc was
        part = (bh * n_parts + part0 + chunk) * R + rows
        tl.store(m_ptr + part, m, mask=r_ok)
        tl.store(l_ptr + part, l_, mask=r_ok)
        tl.store(acc_ptr + part[:, None] * D + ch[None, :], acc, mask=r_ok[:, None])

    @triton.jit
    def _exact_tokens(q, m, l_, acc, k_ptr, v_ptr, ksb, ksh, kst, vsb, vsh, vst, n, col0, b, h, lq, r_ok, ch,
                      mask_ptr, m_sb, m_sq, m_sc, MASK: tl.constexpr, BT: tl.constexpr, RING: tl.constexpr,
                      RING0: tl.constexpr, DOT: tl.constexpr):
        """The online softmax continued over n full-precision tokens [B, H, n, D] (strides given) for the scaled
        query rows q [RP, D]; RING > 0: the tokens are positions col0 .. col0 + n - 1 of a ring of RING slots,
        position p at slot (p - RING0) % RING."""
        for t0 in range(0, n, BT):
            t = t0 + tl.arange(0, BT)
            t_ok = t < n
            if RING:
                row = (col0 - RING0 + t) % RING
            else:
                row = t
            k = tl.load(k_ptr + b * ksb + h * ksh + row[:, None] * kst + ch[None, :], mask=t_ok[:, None],
                        other=0.0).to(tl.float32)
            s = _scores(q, k, DOT)
            s = masked_scores(s, r_ok[:, None] & t_ok[None, :], b, lq, t, col0, 0, mask_ptr, m_sb, m_sq, m_sc, MASK)
            v = tl.load(v_ptr + b * vsb + h * vsh + row[:, None] * vst + ch[None, :], mask=t_ok[:, None],
                        other=0.0).to(tl.float32)
            m, l_, acc = _online(m, l_, acc, s, v, DOT)
        return m, l_, acc

    @triton.jit
    def _finish_kernel(
        q_ptr, m_ptr, l_ptr, acc_ptr, out_ptr, mask_ptr,
        sk_ptr, sv_ptr, wk_ptr, wv_ptr, nk_ptr, nv_ptr,
        sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, wk_b, wk_h, wk_t, wv_b, wv_h, wv_t, nk_b, nk_h, nk_t, nv_b, nv_h, nv_t,
        n_s, n_w, n_n, col_s, col_w, col_n, n_parts, scaling, m_sb, m_sq, m_sc, cnt_ptr,
        R: tl.constexpr, RP: tl.constexpr, LQ: tl.constexpr, D: tl.constexpr, HKV: tl.constexpr,
        BT: tl.constexpr, MASK: tl.constexpr, NEW_MASK: tl.constexpr, RING: tl.constexpr, RING0: tl.constexpr,
        DOT: tl.constexpr,
    ):
        """One (sequence, kv head): the stored tokens' partials merged exactly (log-sum-exp), the full-precision
        segments (sinks, window, the step's new tokens: n_s, n_w, n_n tokens, any of them 0) attended here, and the
        output written in its dtype; rows whose every score was masked give 0.  RING > 0 (a static cache's step):
        window and new tokens lie in one ring of RING slots (position p at slot (p - RING0) % RING), their counts
        and first positions and the sinks held read from cnt_ptr[1:6] on the device (n_w, col_w, n_n, col_n, n_s)."""
        if RING:
            n_w = tl.load(cnt_ptr + 1)
            col_w = tl.load(cnt_ptr + 2)
            n_n = tl.load(cnt_ptr + 3)
            col_n = tl.load(cnt_ptr + 4)
            n_s = tl.load(cnt_ptr + 5)
        bh = tl.program_id(0)
        b = bh // HKV
        h = bh % HKV
        rows = tl.arange(0, RP)
        ch = tl.arange(0, D)
        r_ok = rows < R
        m = tl.full((RP,), float("-inf"), tl.float32)
        l_ = tl.zeros((RP,), tl.float32)
        acc = tl.zeros((RP, D), tl.float32)
        for i in range(0, n_parts):
            part = (bh * n_parts + i) * R + rows
            mp = tl.load(m_ptr + part, mask=r_ok, other=float("-inf"))
            lp = tl.load(l_ptr + part, mask=r_ok, other=0.0)
            ap = tl.load(acc_ptr + part[:, None] * D + ch[None, :], mask=r_ok[:, None], other=0.0)
            m_new = tl.maximum(m, mp)
            safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            a = tl.exp(m - safe)
            w = tl.exp(mp - safe)
            l_ = l_ * a + lp * w
            acc = acc * a[:, None] + ap * w[:, None]
            m = m_new
        q = tl.load(q_ptr + (bh * R + rows)[:, None] * D + ch[None, :], mask=r_ok[:, None], other=0.0)
        q = q.to(tl.float32) * scaling
        lq = rows % LQ
        m, l_, acc = _exact_tokens(q, m, l_, acc, sk_ptr, sv_ptr, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, n_s, col_s,
                                   b, h, lq, r_ok, ch, mask_ptr, m_sb, m_sq, m_sc, MASK, BT, 0, 0, DOT)
        m, l_, acc = _exact_tokens(q, m, l_, acc, wk_ptr, wv_ptr, wk_b, wk_h, wk_t, wv_b, wv_h, wv_t, n_w, col_w,
                                   b, h, lq, r_ok, ch, mask_ptr, m_sb, m_sq, m_sc, MASK, BT, RING, RING0, DOT)
        m, l_, acc = _exact_tokens(q, m, l_, acc, nk_ptr, nv_ptr, nk_b, nk_h, nk_t, nv_b, nv_h, nv_t, n_n, col_n,
                                   b, h, lq, r_ok, ch, mask_ptr, m_sb, m_sq, m_sc, NEW_MASK, BT, RING, RING0, DOT)
        out = acc / tl.maximum(l_, 1e-30)[:, None]
        tl.store(out_ptr + (bh * R + rows)[:, None] * D + ch[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=r_ok[:, None])


def partial_buffers(bh: int, splits: int, r: int, d: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where ``_partials_kernel`` writes each split's (max, sum, weighted values) for ``r`` query rows of ``bh``
    (sequence, kv head) pairs, and ``_finish_kernel`` reads them: [bh, splits, r] twice, [bh, splits, r, d]."""
    m_buf = torch.empty(bh, max(splits, 1), r, device=device)
    return m_buf, torch.empty_like(m_buf), torch.empty(bh, max(splits, 1), r, d, device=device)


def exact_strides(tensors, unused: torch.Tensor) -> list[int]:
    """(batch, head, token) strides of each [B, H, T, D] full-precision tensor ``_finish_kernel`` reads; 0s for
    ``unused`` (an empty slot's placeholder)."""
    return [st for t in tensors for st in ((0, 0, 0) if t is unused else (t.stride(0), t.stride(1), t.stride(2)))]


def query_rows(r: int) -> int:
    """Rows of a program's query tile for ``r`` query rows per kv head: a power of two, at least 16 (the least M
    of tl.dot; the padding rows are masked and cost the matrix units next to nothing)."""
    return max(MIN_DOT, triton.next_power_of_2(r))


def fold_plan(ks: Side, vs: Side, kpr: int, vpr: int, d: int, bt: int, first: int, blk: int
              ) -> tuple[bool, bool, int]:
    """(keys fold, values fold, the unit a program's chunk of tokens is a multiple of) for a partials launch whose
    tiles of ``bt`` tokens start at store index ``first`` (blocks of ``blk`` tokens; 0: one run of rows): a
    per-channel side folds when its parameter rows (``kpr`` / ``vpr`` tokens) cover whole tiles and chunks."""
    def row_aligned(per_row: int) -> bool:
        return per_row % bt == 0 and first % per_row == 0 and blk % per_row == 0

    kf = folds(ks, d, kpr, bt, row_aligned(kpr))
    vf = folds(vs, d, vpr, bt, row_aligned(vpr))
    unit = math.lcm(bt, *(pr for sd, f, pr in ((ks, kf, kpr), (vs, vf, vpr)) if f and sd.kind == 2))
    return kf, vf, unit


def _chunk_tokens(n: int, programs_per_split: int, least: int, bt: int) -> int:
    """Tokens per program of a split-K launch over n tokens: as many chunks as give the GPU TARGET_PROGRAMS
    programs, each at least ``least`` tokens, a multiple of ``bt`` (fewer, longer chunks keep the partials, written
    and read once more, small next to the codes)."""
    def cdiv(x: int, y: int) -> int:
        return -(-x // y)

    splits = min(cdiv(n, least), max(1, cdiv(TARGET_PROGRAMS, programs_per_split)))
    return cdiv(cdiv(n, splits), bt) * bt


def tile_tokens(ks: Side, vs: Side) -> int:
    """BLOCK_T of a launch (at most CHUNK).  On a GPU, tiles of 1/2/4-bit codes take at least 32 tokens: 16-token
    tiles of them gave wrong results on an H200 (the same code right under the interpreter and at 32 tokens)."""
    bt = min(BLOCK_T, CHUNK)
    if not interpreting() and any(sd.kind in (1, 2) and sd.bits in (1, 2, 4) for sd in (ks, vs)):
        bt = max(bt, min(32, CHUNK))
    return bt


def supports(plan: SegmentPlan) -> bool:
    return side(plan.key_format) is not None and side(plan.value_format) is not None


def path(query: torch.Tensor, plan: SegmentPlan) -> str:
    """The path :func:`attend` takes for this step, for reports: ``triton``, ``triton-prefill`` (the tiled kernel),
    ``triton-prefill-dense`` (unpacked once, then SDPA: triton_prefill.dense) or ``reference``."""
    d = query.shape[-1]
    if not available() or not supports(plan) or not dot_head_dim(d) or plan.new is None:
        return "reference"
    if query.shape[2] <= MAX_QUERIES:
        return "triton"
    from .triton_prefill import dense  # prefill on top of a cache

    return "triton-prefill-dense" if dense(query, plan) else "triton-prefill"


def attend(query: torch.Tensor, plan: SegmentPlan, mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """Attention of ``query`` [B, Hq, Lq, D] over everything the plan holds."""
    b, hq, lq, d = query.shape
    route = path(query, plan)
    if route == "reference":
        return reference.attend(query, plan, mask, scaling)
    if route.startswith("triton-prefill"):
        from .triton_prefill import attend_prefill

        return attend_prefill(query, plan, mask, scaling)
    hkv = plan.new.k.shape[1]
    r = (hq // hkv) * lq
    q = query.contiguous()  # [B, Hq, Lq, D] is [B * Hkv, R, D] row for row
    plan.check_mask(mask, lq)
    first = plan.first_visible
    ks, vs = side(plan.key_format), side(plan.value_format)
    chunk, bt = CHUNK, tile_tokens(ks, vs)  # module attributes, so tests can shrink them for the interpreter
    mask_t, mst, mkind = mask_args(mask, q)
    work = stored_runs(plan)  # the stored tokens (a pool: one launch; else one per block)
    fold = [fold_plan(ks, vs, w.k[2], w.v[2], d, bt, w.pool.first if w.pool else 0,
                      w.pool.block_tokens if w.pool else 0) for w in work]
    chunks = [_chunk_tokens(w.n, b * hkv, chunk, unit) for w, (_, _, unit) in zip(work, fold)]
    splits = [triton.cdiv(w.n, c) for w, c in zip(work, chunks)]
    total = sum(splits)
    dev = query.device
    m_buf, l_buf, acc_buf = partial_buffers(b * hkv, total, r, d, dev)
    rp, dot = query_rows(r), dot_kind(q.dtype)
    k_tab, v_tab = device_table(ks, dev), device_table(vs, dev)
    q_rot = rotate_query(q, k_tab) if ks.rotated else q  # rotated keys: scores in the rotated space
    part0 = 0
    for w, nsp, ch, (kf, vf, _) in zip(work, splits, chunks, fold):
        (kt, kst, kpr), (vt, vst, vpr) = w.k, w.v
        paged = w.pool is not None
        _partials_kernel[(b * hkv, nsp)](
            q_rot, m_buf, l_buf, acc_buf, mask_t, w.pool.table if paged else m_buf, *kt, *vt,
            k_tab if ks.rotated else m_buf, v_tab if vs.rotated else m_buf, *kst, *vst, *mst,
            w.pool.first if paged else 0, w.n, w.start - first, part0, total, float(scaling), m_buf,
            CH=ch, R=r, RP=rp, LQ=lq, D=d, HKV=hkv, BT=bt, PAGED=paged,
            BLK=w.pool.block_tokens if paged else 1, MASK=mkind, W=table_width(d), NDEV=False, DOT=dot,
            KFOLD=kf, VFOLD=vf,
            **ks.consts("K"), KPR=kpr, **vs.consts("V"), VPR=vpr, **codes16(dot),
            **launch_options(),
        )
        part0 += nsp
    if vs.rotated and total:  # the stored tokens' weighted values back to the original space
        acc_buf[:, :total] = unrotate_rows(acc_buf[:, :total], v_tab)
    # the full-precision segments (sinks, window; the step's new tokens last) in the finishing launch
    exact = [seg for seg in plan.segments if seg.kind == EXACT and seg.length and not seg.is_new]
    if len(exact) > 2:
        raise RuntimeError(f"the Triton decode takes sinks and a window, got {len(exact)} full-precision segments")
    exact += [None] * (2 - len(exact)) + [plan.new]
    args, counts = [], []
    for seg in exact:
        k, v = (m_buf, m_buf) if seg is None else (seg.k, seg.v)
        args += [t if t.stride(-1) == 1 else t.contiguous() for t in (k, v)]
        counts.append((0, 0) if seg is None else (seg.length, seg.start - first))
    strides = exact_strides(args, m_buf)
    out = torch.empty_like(q)
    new_mask = (3 if lq > 1 else 0) if mask is None else mkind  # new tokens: causal among themselves
    _finish_kernel[(b * hkv,)](
        q, m_buf, l_buf, acc_buf, out, mask_t, *args, *strides, *(n for n, _ in counts), *(c for _, c in counts),
        total, float(scaling), *mst, m_buf, R=r, RP=rp, LQ=lq, D=d, HKV=hkv, BT=bt, MASK=mkind, NEW_MASK=new_mask,
        RING=0, RING0=0, DOT=dot,
    )
    return out
