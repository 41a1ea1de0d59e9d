"""Triton GPU kernels over the packed cache: fused decode attention (prefill and packing in sibling modules).

Imported lazily by :mod:`kvsqueeze.kernels.dispatch`; ``import kvsqueeze`` never needs Triton.  Under
``TRITON_INTERPRET=1`` the kernels also run on CPU tensors (slowly), which is how they are tested without a GPU.

Decode (``attend_layer``): every history block is read in place by one launch whose programs each own a
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

import torch

from ..cache.codecs import Codec, FullCodec, IntChannelCodec, IntTokenCodec
from .dispatch import reference_attend_layer
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


def _side(codec: Codec) -> tuple[int, int, int, bool] | None:
    """(kind, bits, group, symmetric) for the kernel, or None when the layout needs the reference."""
    if isinstance(codec, FullCodec):
        return 0, 16, 1, False
    if isinstance(codec, IntTokenCodec | IntChannelCodec) and codec.spec.bits in _FAST_BITS \
            and codec.pdtype in _PARAM_DTYPES:
        return (1 if isinstance(codec, IntTokenCodec) else 2), codec.spec.bits, codec.group, codec.spec.symmetric
    return None


def supports(layer) -> bool:
    store = layer.store
    if store is None:
        return True
    return _side(store.codecs["k"]) is not None and _side(store.codecs["v"]) is not None


def _parts(codec: Codec, parts: dict[str, torch.Tensor], side: str) -> tuple[torch.Tensor, ...]:
    if isinstance(codec, FullCodec):
        x = parts[f"{side}.x"]
        return x, x, x
    s = parts[f"{side}.scale"]
    return parts[f"{side}.codes"], s, parts.get(f"{side}.zero", s)


def _bias(layer, mask, b: int, lq: int, kv_len: int, device) -> torch.Tensor | None:
    """Additive float bias [B, Lq, kv_len] (columns = absolute position - first_visible), or None."""
    if mask is None:
        if lq == 1:
            return None
        cols = torch.arange(kv_len, device=device) + layer.first_visible
        qpos = torch.arange(lq, device=device) + layer.n_total
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


def attend_layer(query: torch.Tensor, layer, mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """Attention of ``query`` [B, Hq, Lq, D] over everything ``layer`` stores plus its pending tokens."""
    b, hq, lq, d = query.shape
    if not available() or not supports(layer) or d & (d - 1) or layer.pending is None:
        return reference_attend_layer(query, layer, mask, scaling)
    if lq > MAX_QUERIES:  # prefill on top of a cache: query tiles with tl.dot (lazy: it imports this module)
        from .triton_prefill import attend_prefill, supports_query

        if supports_query(d):
            return attend_prefill(query, layer, mask, scaling)
        return reference_attend_layer(query, layer, mask, scaling)
    hkv = layer.pending[0].shape[1]
    rep = hq // hkv
    r = rep * lq
    q = (query.float() * scaling).reshape(b, hkv, r, d).contiguous()
    kv_len = layer.n_total - layer.first_visible + lq
    if mask is not None and (mask.dim() != 4 or mask.shape[-1] < kv_len or mask.shape[-2] != lq):
        raise RuntimeError(f"attention mask of shape {tuple(mask.shape)} does not cover {lq} queries x {kv_len} "
                           f"key positions")
    bias = _bias(layer, mask, b, lq, kv_len, query.device)
    first = layer.first_visible
    parts_m, parts_l, parts_acc = [], [], []

    def fp(start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        m, l_, acc = _fp_partial(q, k, v, bias, start - first, lq)
        parts_m.append(m.reshape(b * hkv, 1, r))
        parts_l.append(l_.reshape(b * hkv, 1, r))
        parts_acc.append(acc.reshape(b * hkv, 1, r, d))

    if layer.sink_k is not None and layer.sink_k.shape[2]:
        fp(0, layer.sink_k, layer.sink_v)
    store = layer.store
    if store is not None and store.blocks:
        kc, vc = store.codecs["k"], store.codecs["v"]
        ks, vs = _side(kc), _side(vc)
        blocks = [blk for blk in store.blocks if blk.used]
        chunk, bt = CHUNK, min(BLOCK_T, CHUNK)  # module attributes, so tests can shrink them for the interpreter
        n_chunks = [triton.cdiv(blk.used, chunk) for blk in blocks]
        total = sum(n_chunks)
        m_buf = torch.empty(b * hkv, total, r, device=query.device)
        l_buf = torch.empty_like(m_buf)
        acc_buf = torch.empty(b * hkv, total, r, d, device=query.device)
        bias_arg = bias if bias is not None else m_buf
        part0 = 0
        for blk, nch in zip(blocks, n_chunks):
            kx, ksc, kz = _parts(kc, blk.parts, "k")
            vx, vsc, vz = _parts(vc, blk.parts, "v")
            for t in (kx, ksc, kz, vx, vsc, vz):  # the kernel indexes [B*H, rows, X] rows contiguously
                assert t.is_contiguous()
            col0 = layer.n_sinks + blk.start - first
            _decode_block_kernel[(b * hkv, nch)](
                q, bias_arg, m_buf, l_buf, acc_buf,
                kx, ksc, kz, vx, vsc, vz,
                kx.stride(1), kx.stride(2), ksc.stride(1), ksc.stride(2),
                vx.stride(1), vx.stride(2), vsc.stride(1), vsc.stride(2),
                blk.used, col0, bias.stride(0) if bias is not None and bias.shape[0] > 1 else 0,
                bias.stride(1) if bias is not None else 0, part0, total,
                R=r, RP=triton.next_power_of_2(r), D=d, LQ=lq, HKV=hkv, CH=chunk, BT=bt,
                HAS_BIAS=bias is not None,
                KKIND=ks[0], KBITS=ks[1], KG=ks[2], KSYM=ks[3], VKIND=vs[0], VBITS=vs[1], VG=vs[2], VSYM=vs[3],
            )
            part0 += nch
        parts_m.append(m_buf)
        parts_l.append(l_buf)
        parts_acc.append(acc_buf)
    if store is not None and layer.window.length:
        wk, wv = layer.window.view()
        fp(layer.n_sinks + store.end, wk, wv)
    fp(layer.n_total, layer.pending[0], layer.pending[1])
    m = torch.cat(parts_m, 1)
    l_ = torch.cat(parts_l, 1)
    acc = torch.cat(parts_acc, 1)
    big = m.amax(1, keepdim=True)
    safe = torch.where(torch.isinf(big), torch.zeros_like(big), big)
    w = torch.exp(m - safe)  # chunks with max -inf get weight 0
    out = (w[..., None] * acc).sum(1) / (w * l_).sum(1).clamp_min(1e-30)[..., None]
    return out.reshape(b, hq, lq, d).to(query.dtype)
