"""KVQuant-style keys: per-channel quantization before RoPE with static calibrated ranges, dense-and-sparse
outliers (a fixed number of channels per token and head kept exactly), optional non-uniform codebooks.

The range of each channel is a pair of quantiles of its calibration values; the quantile is searched (per layer
and KV head) to minimise the attention-output error with the outlier structure active.  Non-uniform codebooks
come from a 1-D k-means of the normalised values of each layer, weighted by the energy of the query channel pair
that multiplies the key channel after RoPE (a sensitivity weight in the spirit of KVQuant's Fisher weighting,
computed from activations only).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..artifact import Side
from ..cache.codecs_calibrated import PreRopeKeyCodec
from ..quant.extras import PreRopeExtras
from ..rope import pair_partner
from ..spec import QuantSpec
from .clip import attention_out, grid_search, head_error, layer_scope, query_positions
from .collect import Activations, LayerActivations
from .kmeans import kmeans_1d

DEFAULT_QUANTILES = (0.0, 0.001, 0.003, 0.01, 0.03)
MAX_CODEBOOK_SAMPLES = 200_000


def query_pair_energy(q: torch.Tensor, kv_heads: int, rotary_dim: int | None = None) -> torch.Tensor:
    """[Hkv, D]: mean of q_c^2 + q_p(c)^2 over tokens and the query heads of each KV head, p(c) the channel RoPE
    rotates c with (c +- D/2 for full rotary; :func:`kvsqueeze.rope.pair_partner`)."""
    n, hq, length, d = q.shape
    e = (q.float() ** 2).mean(dim=(0, 2))  # [Hq, D]
    if rotary_dim is None or rotary_dim == d:
        e = e + torch.roll(e, d // 2, dims=-1)
    else:
        e = e + e[:, pair_partner(d, rotary_dim)]
    return e.reshape(kv_heads, hq // kv_heads, d).mean(1)


def layer_codebook(pre: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int,
                   weights: torch.Tensor | None) -> torch.Tensor:
    """Sorted 2**bits levels in [0, 1] for one layer from normalised pre-RoPE keys [N, H, L, D]."""
    u = ((pre - lo[None, :, None]) / (hi - lo).clamp_min(1e-8)[None, :, None]).clamp(0, 1)
    w = None if weights is None else weights[None, :, None, :].expand_as(u)
    flat = u.flatten()
    step = max(1, flat.numel() // MAX_CODEBOOK_SAMPLES)
    return kmeans_1d(flat[::step], 2 ** bits, None if w is None else w.flatten()[::step]).clamp(0, 1)


def calibrate_prerope_keys(acts: LayerActivations, inv_freq: torch.Tensor, rope_scaling: float, bits: int,
                           outliers: int = 1, nuq: bool = False, quantiles: Sequence[float] = DEFAULT_QUANTILES,
                           param_dtype: str = "fp16", max_queries: int = 128, window: int = 0,
                           sinks: int = 0) -> Side:
    """One layer's pre-RoPE key ranges (and codebook).  As for SKVQ, the objective keeps sinks and the window
    exact, and the ranges ignore the sink tokens (attention sinks have atypical keys the cache never quantizes)."""
    pre = acts.k_pre
    if pre is None:
        raise ValueError("pre-RoPE keys were not collected (collect(..., pre_rope=True))")
    sinks, scope = layer_scope(acts, sinks)
    n, h, length, d = pre.shape
    flat = pre[:, :, min(sinks, length - 1):].transpose(0, 1).reshape(h, -1, d)  # [H, N*(L-sinks), D]
    weights = query_pair_energy(acts.q, h, acts.rope.rotary_dim if acts.rope is not None else None) if nuq else None
    qpos = query_positions(length, max_queries, start=window + sinks if window + sinks < length // 2 else 16)
    ref = attention_out(acts.q, acts.k, acts.v, qpos, acts.scaling, **scope)
    quant = QuantSpec(fmt="int", bits=bits, axis="token", param_dtype=param_dtype)
    ranges = {}

    def build(lo: torch.Tensor, hi: torch.Tensor) -> PreRopeExtras:
        cb = layer_codebook(pre[:, :, min(sinks, length - 1):], lo, hi, bits, weights) if nuq else None
        return PreRopeExtras(lo, hi, inv_freq, rope_scaling, cb, outliers, bits, param_dtype)

    def errors_of(qt: float) -> torch.Tensor:
        lo = torch.quantile(flat, qt, dim=1) if qt > 0 else flat.amin(1)
        hi = torch.quantile(flat, 1 - qt, dim=1) if qt > 0 else flat.amax(1)
        ranges[qt] = (lo, hi)
        codec = PreRopeKeyCodec(quant, d, build(lo, hi))
        k_hat = codec.decode(codec.encode(acts.k))  # samples start at position 0: the codec's default
        return head_error(ref, attention_out(acts.q, acts.k, acts.v, qpos, acts.scaling, k_hat, None, window,
                                             sinks, **scope))

    best, errs = grid_search(errors_of, quantiles, per_head=True)
    chosen = [min(quantiles, key=lambda g, b=b: abs(g - b)) for b in best.tolist()]  # back to exact grid keys
    lo = torch.stack([ranges[qt][0][i] for i, qt in enumerate(chosen)])
    hi = torch.stack([ranges[qt][1][i] for i, qt in enumerate(chosen)])
    ex = build(lo, hi)
    tensors = {"lo": ex.lo, "hi": ex.hi}
    if ex.codebook is not None:
        tensors["codebook"] = ex.codebook
    settings = {"bits": bits, "outliers": outliers, "non_uniform": nuq, "quantile": chosen,
                "error_by_quantile": {str(k): [float(x) for x in v] for k, v in errs.items()}}
    return Side("prerope", quant, tensors, settings)


def calibrate_kvquant_keys(acts: Activations, bits: int, outliers: int = 1, nuq: bool = False,
                           quantiles: Sequence[float] = DEFAULT_QUANTILES, param_dtype: str = "fp16",
                           progress: bool = True, window: int = 0, sinks: int = 0) -> list[Side]:
    from tqdm.auto import tqdm

    out = []
    for la in tqdm(acts.layers, desc="KVQuant pre-RoPE keys", disable=not progress):
        if la is not None and la.rope is None:
            raise ValueError("pre-RoPE keys need the layer's RoPE table (collect(..., pre_rope=True))")
        out.append(Side("none", QuantSpec(fmt="none")) if la is None else
                   calibrate_prerope_keys(la, la.rope.inv_freq, la.rope.attention_scaling, bits, outliers, nuq,
                                          quantiles, param_dtype, window=window, sinks=sinks))
    return out
