"""Triton GPU kernels over the packed cache: fused decode attention (prefill and packing in sibling modules).

Imported lazily by the adapter's backend switch; ``import kvsqueeze`` never needs Triton.  Under
``TRITON_INTERPRET=1`` the kernels also run on CPU tensors (slowly), which is how they are tested without a GPU.

Decode (``attend``): every history block of the segment plan is read in place by one launch whose programs each own a
(batch * kv head, chunk of ``CHUNK`` tokens) pair (flash-decoding).  A program unpacks ``BLOCK_T`` tokens of codes at
a time in registers (shift and mask per channel), applies the group parameters there, scores all query rows of
its KV head (GQA rows share the loads) and keeps an online softmax; it writes its partial (max, sum, weighted
values).  The small full-precision segments (sinks, window, the step's new tokens) are scored with torch, and all
partials are merged exactly by log-sum-exp.  Steps longer than ``MAX_QUERIES`` tokens (prefill on top of a
cache) go to :mod:`kvsqueeze.kernels.triton_prefill`, which tiles the queries too and never dequantizes the
history outside registers.  Quantize-and-pack on append is :mod:`kvsqueeze.kernels.triton_pack`.

Supported in the fused kernel: fp blocks of the model dtype, integer codes of 2/4/8 bits (1 and 3 bits and fp8
go to the reference), per-channel or per-token groups, symmetric or not, fp32/fp16/bf16 parameters.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch

from ..cache.plan import EXACT, SegmentPlan
from ..quant.format import StorageFormat
from . import reference
from .reference import NEG_INF

try:  # Triton is optional
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - exercised where Triton is missing
    HAS_TRITON = False

MAX_QUERIES = 16
CHUNK = 256
BLOCK_T = 32
_FAST_BITS = (2, 4, 8)
_PARAM_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


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
    def _load_side(x_ptr, s_ptr, z_ptr, sxb, sxr, ssb, ssr, t_idx, t_ok, ch,
                   KIND: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, SYM: tl.constexpr):
        """[BLOCK_T, D] float32 values of tokens t_idx (rows of this block) for channel vector ch."""
        if KIND == 0:  # full precision
            x = tl.load(x_ptr + sxb + t_idx[:, None] * sxr + ch[None, :], mask=t_ok[:, None], other=0.0)
            return x.to(tl.float32)
        PER: tl.constexpr = 8 // BITS
        byte = tl.load(x_ptr + sxb + t_idx[:, None] * sxr + (ch // PER)[None, :], mask=t_ok[:, None], other=0)
        code = ((byte.to(tl.int32) >> ((ch % PER) * BITS)[None, :]) & ((1 << BITS) - 1)).to(tl.float32)
        if KIND == 1:  # per token: parameters [rows, D // G]
            p_off = ssb + t_idx[:, None] * ssr + (ch // G)[None, :]
        else:  # per channel: parameters [rows // G, D]
            p_off = ssb + (t_idx // G)[:, None] * ssr + ch[None, :]
        s = tl.load(s_ptr + p_off, mask=t_ok[:, None], other=0.0).to(tl.float32)
        if SYM:
            z = s
        else:
            z = tl.load(z_ptr + p_off, mask=t_ok[:, None], other=0.0).to(tl.float32)
        a, c = _affine(s, z, BITS, SYM)
        return code * a + c

    @triton.jit
    def _decode_block_kernel(
        q_ptr, bias_ptr, m_ptr, l_ptr, acc_ptr,
        kx_ptr, ks_ptr, kz_ptr, vx_ptr, vs_ptr, vz_ptr,
        skxb, skxr, sksb, sksr, svxb, svxr, svsb, svsr,
        used, bias_col0, bias_sb, bias_sr, part0, n_parts,
        R: tl.constexpr, RP: tl.constexpr, D: tl.constexpr, LQ: tl.constexpr, HKV: tl.constexpr,
        CH: tl.constexpr, BT: tl.constexpr, HAS_BIAS: tl.constexpr,
        KKIND: tl.constexpr, KBITS: tl.constexpr, KG: tl.constexpr, KSYM: tl.constexpr,
        VKIND: tl.constexpr, VBITS: tl.constexpr, VG: tl.constexpr, VSYM: tl.constexpr,
    ):
        bh = tl.program_id(0)
        chunk = tl.program_id(1)
        b = bh // HKV
        rows = tl.arange(0, RP)
        ch = tl.arange(0, D)
        r_ok = rows < R
        q = tl.load(q_ptr + (bh * R + rows)[:, None] * D + ch[None, :], mask=r_ok[:, None], other=0.0)
        m = tl.full((RP,), float("-inf"), tl.float32)
        l_ = tl.zeros((RP,), tl.float32)
        acc = tl.zeros((RP, D), tl.float32)
        for t0 in range(0, CH, BT):
            t_idx = chunk * CH + t0 + tl.arange(0, BT)
            t_ok = t_idx < used
            k = _load_side(kx_ptr, ks_ptr, kz_ptr, bh * skxb, skxr, bh * sksb, sksr, t_idx, t_ok, ch,
                           KKIND, KBITS, KG, KSYM)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)  # [RP, BT]
            valid = r_ok[:, None] & t_ok[None, :]
            if HAS_BIAS:
                lq = rows % LQ
                bias = tl.load(bias_ptr + b * bias_sb + lq[:, None] * bias_sr + (bias_col0 + t_idx)[None, :],
                               mask=valid, other=float("-inf"))
                s = s + bias
            s = tl.where(valid, s, float("-inf"))
            m_new = tl.maximum(m, tl.max(s, axis=1))
            safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - safe[:, None])
            corr = tl.exp(m - safe)
            v = _load_side(vx_ptr, vs_ptr, vz_ptr, bh * svxb, svxr, bh * svsb, svsr, t_idx, t_ok, ch,
                           VKIND, VBITS, VG, VSYM)
            l_ = l_ * corr + tl.sum(p, axis=1)
            acc = acc * corr[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
            m = m_new
        part = (bh * n_parts + part0 + chunk) * R + rows
        tl.store(m_ptr + part, m, mask=r_ok)
        tl.store(l_ptr + part, l_, mask=r_ok)
        tl.store(acc_ptr + part[:, None] * D + ch[None, :], acc, mask=r_ok[:, None])


def _side(fmt: StorageFormat | None) -> tuple[int, int, int, bool] | None:
    """(kind, bits, group, symmetric) for the kernel, or None when the format needs the reference."""
    if fmt is None or fmt.kind == "fp":
        return 0, 16, 1, False
    if fmt.kind == "int" and fmt.plain and fmt.bits in _FAST_BITS and fmt.param_dtype in _PARAM_DTYPES:
        return (1 if fmt.axis == "token" else 2), fmt.bits, fmt.group, fmt.symmetric
    return None


def supports(plan: SegmentPlan) -> bool:
    return _side(plan.key_format) is not None and _side(plan.value_format) is not None


def _parts(fmt: StorageFormat, parts: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    if fmt.kind == "fp":
        x = parts["x"]
        return x, x, x
    s = parts["scale"]
    return parts["codes"], s, parts.get("zero", s)


def _bias(plan: SegmentPlan, mask, b: int, lq: int, kv_len: int, device) -> torch.Tensor | None:
    """Additive float bias [B, Lq, kv_len] (columns = absolute position - first_visible), or None."""
    if mask is None:
        if lq == 1:
            return None
        cols = torch.arange(kv_len, device=device) + plan.first_visible
        qpos = torch.arange(lq, device=device) + plan.query_start
        ok = cols[None, :] <= qpos[:, None]
        return torch.zeros(1, lq, kv_len, device=device).masked_fill(~ok, NEG_INF)
    m = mask[:, 0]
    if m.dtype == torch.bool:
        return torch.zeros(m.shape, device=device).masked_fill(~m, NEG_INF)
    return m.float()


def _fp_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, col0: int,
                lq: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(max, sum, weighted values) of q [B, Hkv, R, D] over a small full-precision segment, in torch."""
    s = torch.matmul(q, k.float().transpose(-1, -2))  # [B, Hkv, R, n]
    if bias is not None:
        blk = bias[:, :, col0:col0 + k.shape[2]]  # [B|1, Lq, n]
        rep = q.shape[2] // lq
        s = s + blk.repeat(1, rep, 1)[:, None]
    m = s.amax(-1)
    safe = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    p = torch.exp(s - safe[..., None])
    return m, p.sum(-1), torch.matmul(p, v.float())


def path(query: torch.Tensor, plan: SegmentPlan) -> str:
    """The path :func:`attend` takes for this step, for reports: ``triton``, ``triton-prefill`` or ``reference``."""
    d = query.shape[-1]
    if not available() or not supports(plan) or d & (d - 1) or plan.new is None:
        return "reference"
    if query.shape[2] > MAX_QUERIES:  # prefill on top of a cache: query tiles (lazy: it imports this module)
        from .triton_prefill import supports_query

        return "triton-prefill" if supports_query(d) else "reference"
    return "triton"


def attend(query: torch.Tensor, plan: SegmentPlan, mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """Attention of ``query`` [B, Hq, Lq, D] over everything the plan holds."""
    b, hq, lq, d = query.shape
    new = plan.new
    route = path(query, plan)
    if route == "reference":
        return reference.attend(query, plan, mask, scaling)
    if route == "triton-prefill":
        from .triton_prefill import attend_prefill

        return attend_prefill(query, plan, mask, scaling)
    hkv = new.k.shape[1]
    rep = hq // hkv
    r = rep * lq
    q = (query.float() * scaling).reshape(b, hkv, r, d).contiguous()
    kv_len = plan.kv_length(lq)
    plan.check_mask(mask, lq)
    bias = _bias(plan, mask, b, lq, kv_len, query.device)
    first = plan.first_visible
    parts_m, parts_l, parts_acc = [], [], []

    def fp(start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        m, l_, acc = _fp_partial(q, k, v, bias, start - first, lq)
        parts_m.append(m.reshape(b * hkv, 1, r))
        parts_l.append(l_.reshape(b * hkv, 1, r))
        parts_acc.append(acc.reshape(b * hkv, 1, r, d))

    def stored(blocks) -> None:
        kf, vf = plan.key_format, plan.value_format
        ks, vs = _side(kf), _side(vf)
        chunk, bt = CHUNK, min(BLOCK_T, CHUNK)  # module attributes, so tests can shrink them for the interpreter
        n_chunks = [triton.cdiv(seg.length, chunk) for seg in blocks]
        total = sum(n_chunks)
        m_buf = torch.empty(b * hkv, total, r, device=query.device)
        l_buf = torch.empty_like(m_buf)
        acc_buf = torch.empty(b * hkv, total, r, d, device=query.device)
        bias_arg = bias if bias is not None else m_buf
        part0 = 0
        for seg, nch in zip(blocks, n_chunks):
            kx, ksc, kz = _parts(kf, seg.k_parts)
            vx, vsc, vz = _parts(vf, seg.v_parts)
            for t in (kx, ksc, kz, vx, vsc, vz):  # the kernel indexes [B*H, rows, X] rows contiguously
                assert t.is_contiguous()
            _decode_block_kernel[(b * hkv, nch)](
                q, bias_arg, m_buf, l_buf, acc_buf,
                kx, ksc, kz, vx, vsc, vz,
                kx.stride(1), kx.stride(2), ksc.stride(1), ksc.stride(2),
                vx.stride(1), vx.stride(2), vsc.stride(1), vsc.stride(2),
                seg.length, seg.start - first, bias.stride(0) if bias is not None and bias.shape[0] > 1 else 0,
                bias.stride(1) if bias is not None else 0, part0, total,
                R=r, RP=triton.next_power_of_2(r), D=d, LQ=lq, HKV=hkv, CH=chunk, BT=bt,
                HAS_BIAS=bias is not None,
                KKIND=ks[0], KBITS=ks[1], KG=ks[2], KSYM=ks[3], VKIND=vs[0], VBITS=vs[1], VG=vs[2], VSYM=vs[3],
            )
            part0 += nch
        parts_m.append(m_buf)
        parts_l.append(l_buf)
        parts_acc.append(acc_buf)

    # token order is kept (sinks, the stored blocks in one launch each, window, new): the merge below is exact
    blocks: list = []
    for seg in plan.segments:
        if seg.kind != EXACT:
            blocks.append(seg)
            continue
        if blocks:
            stored(blocks)
            blocks = []
        if seg.length:
            fp(seg.start, seg.k, seg.v)
    if blocks:
        stored(blocks)
    m = torch.cat(parts_m, 1)
    l_ = torch.cat(parts_l, 1)
    acc = torch.cat(parts_acc, 1)
    big = m.amax(1, keepdim=True)
    safe = torch.where(torch.isinf(big), torch.zeros_like(big), big)
    w = torch.exp(m - safe)  # chunks with max -inf get weight 0
    out = (w[..., None] * acc).sum(1) / (w * l_).sum(1).clamp_min(1e-30)[..., None]
    return out.reshape(b, hq, lq, d).to(query.dtype)
