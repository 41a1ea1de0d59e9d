"""Reference attention over a segment plan, one chunk at a time (online softmax / log-sum-exp merge).

:func:`attend` reads a :class:`~kvsqueeze.cache.plan.SegmentPlan` in token order - sinks, history blocks decoded
one at a time by the plan's decoders, the window, and the new tokens of this step - so only one segment's scores
exist at a time and no full-precision copy of the whole history is ever built.  Every fast kernel is tested
against this.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..cache.plan import SegmentPlan

NEG_INF = float("-inf")
MAX_COLUMNS = 1024  # a long segment (e.g. a prompt's own tokens) is scored this many keys at a time


def attend(query: torch.Tensor, plan: SegmentPlan, mask: torch.Tensor | None, scaling: float,
           softcap: float | None = None) -> torch.Tensor:
    """Attention of ``query`` [B, Hq, Lq, D] over everything the plan holds (see :func:`attend_segments`)."""
    return attend_segments(query, plan.decoded(), mask, scaling, kv_offset=plan.first_visible,
                           query_start=plan.query_start, softcap=softcap)


def available() -> bool:
    return True


def path(query: torch.Tensor, plan: SegmentPlan) -> str:
    return "reference"


def attend_segments(
    query: torch.Tensor,
    segments: Iterable[tuple[int, torch.Tensor, torch.Tensor, bool]],
    mask: torch.Tensor | None,
    scaling: float,
    kv_offset: int = 0,
    query_start: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of ``query`` [B, Hq, Lq, D] over the segments; returns [B, Hq, Lq, D] in the query's dtype.

    mask:        bool [B or 1, 1, Lq, kv_len] (True = attend) or an additive float mask, whose columns are
                 absolute positions minus ``kv_offset``; or None, meaning every stored token is visible and the
                 new tokens are causal among themselves.
    query_start: absolute position of the first query (needed only when mask is None).
    softcap:     attention-logit soft-capping (Gemma-2): scores become ``softcap * tanh(scores / softcap)``.
    """
    b, hq, lq, d = query.shape
    q = None
    m = l_ = acc = None
    rep = 1
    for start, k, v, is_new in _split(segments):
        if q is None:
            rep = hq // k.shape[1]
            # group query heads by KV head: [B, Hkv, rep*Lq, D]
            q = query.float().reshape(b, k.shape[1], rep * lq, d)
            m = torch.full((b, k.shape[1], rep * lq, 1), NEG_INF, device=query.device)
            l_ = torch.zeros_like(m)
            acc = torch.zeros((b, k.shape[1], rep * lq, v.shape[-1]), device=query.device)
        n = k.shape[2]
        if n == 0:
            continue
        s = torch.matmul(q, k.float().transpose(-1, -2)) * scaling  # [B, Hkv, rep*Lq, n]
        if softcap is not None:
            s = torch.tanh(s / softcap) * softcap
        bias = _segment_mask(mask, start - kv_offset, n, b, rep, lq, is_new, start, query_start, query.device)
        if bias is not None:
            s = s.masked_fill(~bias, NEG_INF) if bias.dtype == torch.bool else s + bias
        m_new = torch.maximum(m, s.amax(dim=-1, keepdim=True))
        safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # fully masked rows stay zero
        p = torch.exp(s - safe)
        corr = torch.exp(m - safe)
        l_ = l_ * corr + p.sum(dim=-1, keepdim=True)
        acc = acc * corr + torch.matmul(p, v.float())
        m = m_new
    if q is None:
        raise ValueError("attention over an empty cache with no new tokens")
    out = acc / l_.clamp_min(1e-30)
    return out.reshape(b, hq, lq, -1).to(query.dtype)


def _split(segments):
    for start, k, v, is_new in segments:
        for c in range(0, k.shape[2], MAX_COLUMNS):
            yield start + c, k[:, :, c:c + MAX_COLUMNS], v[:, :, c:c + MAX_COLUMNS], is_new


def _segment_mask(mask, col, n, b, rep, lq, is_new, start, query_start, device):
    """The mask block for one segment, shaped to broadcast against [B, Hkv, rep*Lq, n]."""
    if mask is not None:
        blk = mask[:, :, :, col:col + n]  # [B|1, 1, Lq, n]
        if rep > 1:
            blk = blk.unsqueeze(2).expand(blk.shape[0], 1, rep, lq, n).reshape(blk.shape[0], 1, rep * lq, n)
        return blk
    if not is_new or lq == 1:
        return None
    # mask None: new tokens are causal among themselves (queries are the new tokens, bottom-right aligned)
    if query_start is None:
        raise ValueError("query_start is needed when the mask is None")
    qpos = torch.arange(lq, device=device) + query_start
    kpos = torch.arange(n, device=device) + start
    causal = (kpos[None, :] <= qpos[:, None])  # [Lq, n]
    return causal.repeat(rep, 1).view(1, 1, rep * lq, n)
