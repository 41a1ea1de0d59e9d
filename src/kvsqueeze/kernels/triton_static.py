"""Decode attention of a static cache layer (cache/static.py) with nothing read on the host: CUDA-graph safe.

:mod:`triton_decode` sizes its launches from the plan's token counts, Python ints that a recorded CUDA graph would
replay unchanged.  Here every launch argument is fixed for the layer: the split-K grid covers all ``max_len`` rows
(programs past the stored tokens write empty partials), and the counts of the step (stored tokens, the window's and
the new token's positions in the ring) are computed from the layer's ``count`` tensor by device ops and read by the
kernels (``NDEV`` / ``RING`` in :mod:`triton_decode`'s kernels).  The arithmetic is :mod:`triton_decode`'s.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..quant.format import StorageFormat
from .triton_common import (
    HAS_TRITON,
    device_table,
    mask_args,
    rotate_query,
    side,
    side_args,
    table_width,
    unrotate_rows,
)
from .triton_decode import BLOCK_T, CHUNK, _chunk_tokens

if HAS_TRITON:
    import triton

    from .triton_decode import _finish_kernel, _partials_kernel


def supports(key_format: StorageFormat, value_format: StorageFormat, head_dim: int) -> bool:
    return (side(key_format) is not None and side(value_format) is not None and not head_dim & (head_dim - 1))


def step_counts(count: torch.Tensor, window: int, group: int) -> torch.Tensor:
    """int32 [stored tokens, window tokens, window's first position, new tokens, new token's position] of a decode
    step whose token is the ``count``-th (device ops only)."""
    n0 = count - 1
    nq = torch.clamp(torch.div(n0 - window, group, rounding_mode="floor"), min=0) * group
    return torch.stack([nq, n0 - nq, nq, torch.ones_like(n0), n0]).to(torch.int32)


def attend(query: torch.Tensor, mask: torch.Tensor | None, scaling: float, count: torch.Tensor,
           ring_k: torch.Tensor, ring_v: torch.Tensor, k_parts: Mapping[str, torch.Tensor],
           v_parts: Mapping[str, torch.Tensor], key_format: StorageFormat, value_format: StorageFormat,
           window: int, group: int, max_len: int) -> torch.Tensor:
    """One query token [B, Hq, 1, D] over a static layer: packed rows [0, nq), the ring's window and new token."""
    b, hq, lq, d = query.shape
    hkv = ring_k.shape[1]
    r = (hq // hkv) * lq
    q = query.contiguous()
    dev = q.device
    cnt = step_counts(count, window, group)
    ks, vs = side(key_format), side(value_format)
    bt = min(BLOCK_T, CHUNK)
    ch = _chunk_tokens(max_len, b * hkv, CHUNK, bt)  # fixed by the layer's length, not the step's
    nsp = triton.cdiv(max_len, ch)
    m_buf = torch.empty(b * hkv, nsp, r, device=dev)
    l_buf = torch.empty_like(m_buf)
    acc_buf = torch.empty(b * hkv, nsp, r, d, device=dev)
    rp = triton.next_power_of_2(r)
    mask_t, mst, mkind = mask_args(mask, q)
    k_tab, v_tab = device_table(ks, dev), device_table(vs, dev)
    q_rot = rotate_query(q, k_tab) if ks.rotated else q
    (kt, kst, kpr), (vt, vst, vpr) = side_args(key_format, k_parts), side_args(value_format, v_parts)
    _partials_kernel[(b * hkv, nsp)](
        q_rot, m_buf, l_buf, acc_buf, mask_t, m_buf, *kt, *vt,
        k_tab if ks.rotated else m_buf, v_tab if vs.rotated else m_buf, *kst, *vst, *mst,
        0, 0, 0, 0, nsp, float(scaling), cnt,
        CH=ch, R=r, RP=rp, LQ=lq, D=d, HKV=hkv, BT=bt, PAGED=False, BLK=1, MASK=mkind, W=table_width(d), NDEV=True,
        **ks.consts("K"), KPR=kpr, **vs.consts("V"), VPR=vpr,
    )
    if vs.rotated:
        acc_buf = unrotate_rows(acc_buf, v_tab)
    out = torch.empty_like(q)
    strides = [0, 0, 0] * 2 + [ring_k.stride(0), ring_k.stride(1), ring_k.stride(2),
                                             ring_v.stride(0), ring_v.stride(1), ring_v.stride(2)] * 2
    _finish_kernel[(b * hkv,)](
        q, m_buf, l_buf, acc_buf, out, mask_t, m_buf, m_buf, ring_k, ring_v, ring_k, ring_v, *strides,
        0, 0, 0, 0, 0, 0, nsp, float(scaling), *mst, cnt,
        R=r, RP=rp, LQ=lq, D=d, HKV=hkv, BT=bt, MASK=mkind, NEW_MASK=mkind, RING=ring_k.shape[2],
    )
    return out
