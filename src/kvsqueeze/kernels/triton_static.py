"""Decode attention of a static cache layer (cache/static.py) with nothing read on the host: CUDA-graph safe.

:mod:`triton_decode` sizes its launches from the plan's token counts, Python ints that a recorded CUDA graph would
replay unchanged.  Here every launch argument is fixed for the layer: the split-K grid covers all its packed rows
(programs past the stored tokens write empty partials), and the counts of the step (stored tokens, the window's and
the new token's positions in the ring, the sinks held) are computed from the layer's ``count`` tensor by device ops
and read by the kernels (``NDEV`` / ``RING`` in :mod:`triton_decode`'s kernels).  The arithmetic is
:mod:`triton_decode`'s.
"""

from __future__ import annotations

import torch

from . import triton_decode
from .triton_common import (
    HAS_TRITON,
    codes16,
    device_table,
    dot_head_dim,
    mask_args,
    rotate_query,
    side,
    side_args,
    table_width,
    unrotate_rows,
)
from .triton_decode import _chunk_tokens, exact_strides, partial_buffers

if HAS_TRITON:
    import triton

    from .triton_decode import _finish_kernel, _partials_kernel


def supports(key_format, value_format, head_dim: int) -> bool:
    return side(key_format) is not None and side(value_format) is not None and dot_head_dim(head_dim)


def step_counts(count: torch.Tensor, sinks: int, window: int, group: int) -> torch.Tensor:
    """int32 [stored body tokens, window tokens, window's first position, new tokens in the ring, new token's
    position, sinks held] of a decode step whose token is the ``count``-th (device ops only).  A token that is
    itself one of the first ``sinks`` is attended among the sinks, not from the ring."""
    n0 = count - 1
    m0 = torch.clamp(n0 - sinks, min=0)
    nq = torch.clamp(torch.div(m0 - window, group, rounding_mode="floor"), min=0) * group
    in_ring = (n0 >= sinks).to(count.dtype)
    return torch.stack([nq, m0 - nq, nq + sinks, in_ring, n0, torch.clamp(count, max=sinks)]).to(torch.int32)


def attend(query: torch.Tensor, mask: torch.Tensor | None, scaling: float, layer, tensors: list[torch.Tensor]
           ) -> torch.Tensor:
    """One query token [B, Hq, 1, D] over a static layer (cache/static.py; ``tensors`` as the step hands them
    over): its sinks, packed rows [0, nq), the ring's window and new token."""
    count, ring_k, ring_v, k_parts, v_parts = layer.split(tensors)
    sink_k, sink_v = tensors[3:5]
    key_format, value_format = layer.codecs["k"].fmt, layer.codecs["v"].fmt
    b, hq, lq, d = query.shape
    hkv = ring_k.shape[1]
    r = (hq // hkv) * lq
    q = query.contiguous()
    dev = q.device
    cnt = step_counts(count, layer.S, layer.W, layer.G)
    ks, vs = side(key_format), side(value_format)
    bt = triton_decode.tile_tokens(ks, vs)  # read at call time: benchmarks sweep them
    (kt, kst, kpr), (vt, vst, vpr) = side_args(key_format, k_parts), side_args(value_format, v_parts)
    kf, vf, unit = triton_decode.fold_plan(ks, vs, kpr, vpr, d, bt, 0, 0)
    ch = _chunk_tokens(layer.rows, b * hkv, triton_decode.CHUNK, unit)  # fixed by the layer's length, not the step's
    nsp = triton.cdiv(layer.rows, ch)
    m_buf, l_buf, acc_buf = partial_buffers(b * hkv, nsp, r, d, dev)
    rp, dot = triton_decode.query_rows(r), triton_decode.dot_kind(q.dtype)
    mask_t, mst, mkind = mask_args(mask, q)
    k_tab, v_tab = device_table(ks, dev), device_table(vs, dev)
    q_rot = rotate_query(q, k_tab) if ks.rotated else q
    _partials_kernel[(b * hkv, nsp)](
        q_rot, m_buf, l_buf, acc_buf, mask_t, m_buf, *kt, *vt,
        k_tab if ks.rotated else m_buf, v_tab if vs.rotated else m_buf, *kst, *vst, *mst,
        0, 0, layer.S, 0, nsp, float(scaling), cnt,
        CH=ch, R=r, RP=rp, LQ=lq, D=d, HKV=hkv, BT=bt, PAGED=False, BLK=1, MASK=mkind, W=table_width(d), NDEV=True,
        DOT=dot, KFOLD=kf, VFOLD=vf,
        **ks.consts("K"), KPR=kpr, **vs.consts("V"), VPR=vpr, **codes16(dot), **triton_decode.launch_options(),
    )
    if vs.rotated:
        acc_buf = unrotate_rows(acc_buf, v_tab)
    out = torch.empty_like(q)
    sinks = [sink_k, sink_v] if layer.S else [m_buf, m_buf]
    strides = exact_strides((*sinks, ring_k, ring_v, ring_k, ring_v), m_buf)
    _finish_kernel[(b * hkv,)](
        q, m_buf, l_buf, acc_buf, out, mask_t, *sinks, ring_k, ring_v, ring_k, ring_v, *strides,
        0, 0, 0, 0, 0, 0, nsp, float(scaling), *mst, cnt,
        R=r, RP=rp, LQ=lq, D=d, HKV=hkv, BT=bt, MASK=mkind, NEW_MASK=mkind, RING=ring_k.shape[2], RING0=layer.S,
        DOT=dot,
    )
    return out
