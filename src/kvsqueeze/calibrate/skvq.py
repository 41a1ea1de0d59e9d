"""SKVQ side calibration: channel reordering (balanced k-means on channel ranges) and clip-ratio search.

Keys are reordered after RoPE by a gather inside the codec (exact; a weight fold would break RoPE pairs), values
likewise by default, or folded into W_v/W_o for export (:mod:`kvsqueeze.calibrate.fold`).  Clip ratios are chosen
on the calibration data to minimise the error of the attention output of each layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..artifact import Side
from ..cache.codecs_calibrated import PermutedGroupCodec
from ..quant.extras import GroupExtras
from ..spec import QuantSpec
from .clip import DEFAULT_CLIP_GRID, attention_out, head_error, layer_scope, query_positions, search_clip
from .collect import Activations, LayerActivations
from .kmeans import reorder_permutation


def side_quant(fmt: str, bits: int, group: int | None, param_dtype: str) -> QuantSpec:
    return QuantSpec(fmt=fmt, bits=bits if fmt == "int" else 2, axis="token", group=group, param_dtype=param_dtype)


def channel_order(x: torch.Tensor, group: int) -> torch.Tensor:
    """Per-head channel permutation [H, D] of activations x [N, H, L, D] (balanced clusters of ``group``)."""
    mn = x.amin(dim=(0, 2))
    mx = x.amax(dim=(0, 2))
    return torch.stack([reorder_permutation(mn[h], mx[h], group) for h in range(x.shape[1])])


def _fake(codec_spec: QuantSpec, head_dim: int, perm: torch.Tensor | None, clip: torch.Tensor | None,
          x: torch.Tensor) -> torch.Tensor:
    codec = PermutedGroupCodec(codec_spec, head_dim, GroupExtras(perm, clip))
    return codec.decode(codec.encode(x))


def calibrate_group_side(acts: LayerActivations, side: str, quant: QuantSpec, reorder: bool, clip_mode: str,
                         grid: Sequence[float] = DEFAULT_CLIP_GRID, max_queries: int = 128, window: int = 0,
                         sinks: int = 0) -> Side:
    """One layer's SKVQ keys or values: channel order, then clip ratios minimising the attention-output error
    (the other side kept exact).  The objective sees what the cache gives a query: ``sinks`` and the ``window``
    most recent tokens exact, older ones quantized; channel ranges ignore the sink tokens."""
    x = acts.k if side == "key" else acts.v
    sinks, scope = layer_scope(acts, sinks)
    _, h, length, d = x.shape
    g = d if quant.group is None else quant.group
    perm = channel_order(x[:, :, min(sinks, length - 1):], g) if reorder else None
    qpos = query_positions(length, max_queries, start=window + sinks if window + sinks < length // 2 else 16)
    ref = attention_out(acts.q, acts.k, acts.v, qpos, acts.scaling, **scope)

    def errors_of(clip: torch.Tensor) -> torch.Tensor:
        xh = _fake(quant, d, perm, clip, x)
        k_hat, v_hat = (xh, None) if side == "key" else (None, xh)
        return head_error(ref, attention_out(acts.q, acts.k, acts.v, qpos, acts.scaling, k_hat, v_hat, window,
                                             sinks, **scope))

    clip = search_clip(errors_of, h, d // g, clip_mode, grid)
    tensors = {}
    if perm is not None:
        tensors["perm"] = perm
    if clip_mode != "none":
        tensors["clip"] = clip
    settings = {"reorder": reorder, "clip_mode": clip_mode,
                "clip_min": float(clip.min()), "clip_max": float(clip.max()),
                "error_after": [float(e) for e in errors_of(clip)],
                "error_rtn": [float(e) for e in errors_of(torch.ones_like(clip))] if reorder or clip_mode != "none"
                else None}
    return Side("group", quant, tensors, settings)


def calibrate_skvq(acts: Activations, key: QuantSpec, value: QuantSpec, reorder: bool = True,
                   clip_mode: str = "layer", grid: Sequence[float] = DEFAULT_CLIP_GRID,
                   progress: bool = True, sides: tuple[str, ...] = ("key", "value"), window: int = 0,
                   sinks: int = 0) -> list[dict[str, Side]]:
    """``sides`` of every layer (full-precision entries for layers that were not collected, and for sides not
    asked for - the caller fills those in)."""
    from tqdm.auto import tqdm

    out = []
    quants = {"key": key, "value": value}
    for la in tqdm(acts.layers, desc="SKVQ reorder + clip search", disable=not progress):
        lay = {s: Side("none", QuantSpec(fmt="none")) for s in ("key", "value")}
        if la is not None:
            for s in sides:
                lay[s] = calibrate_group_side(la, s, quants[s], reorder, clip_mode, grid, window=window,
                                              sinks=sinks)
        out.append(lay)
    return out
