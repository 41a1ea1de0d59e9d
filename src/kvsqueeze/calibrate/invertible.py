"""Learned invertible transforms of keys and values (the method of the seed document on invariant projections).

Attention is unchanged by ``W_q -> W_q X``, ``W_k -> W_k X^-T``, ``W_v -> W_v Y``, ``W_o -> Y^-1 W_o``; the
cache then stores ``k X^-T`` and ``v Y``.  Per layer and KV head we choose ``A = X^-T`` (keys) and ``B = Y``
(values) so that the *quantized* cache changes the attention output as little as possible:

* ``learned-folded``: keys in the RoPE-commuting family (per-pair scale and rotation,
  :func:`kvsqueeze.transforms.matrices.rope_commuting`; folds into ``W_q``/``W_k`` before RoPE), initialised at
  SmoothAttention's scales; values any invertible ``B`` (Hadamard start, Woodbury updates; folds into
  ``W_v``/``W_o``).
* ``learned-online``: keys any invertible ``A`` applied after RoPE (cannot be folded; the codec applies it), values
  as above.
* baselines in the same code path: ``none``, ``hadamard`` (QuaRot-style: keys online, values folded) and
  ``smooth`` (SmoothAttention-style per-pair key scaling ``max|k|^0.5``, folded).

Objective: relative squared error of each layer's attention output over the calibration queries, every key and
value quantized with the target quantizer (the all-quantized case, the strictest), through a straight-through
estimator of rounding whose group ranges stay differentiable (so the gradient sees outliers widening a range).
Adam, a fixed number of steps, deterministic for a seed.  With SKVQ grouping, reordering and clip search run
afterwards on the transformed activations.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..artifact import Side
from ..quant.affine import affine_ste
from ..rope import pair_order
from ..spec import QuantSpec
from ..transforms.matrices import GeneralTransform, RopeCommutingTransform, condition_number, hadamard
from .clip import attention_out, head_error, layer_scope, query_positions
from .collect import Activations, LayerActivations

TRANSFORMS = ("none", "hadamard", "smooth", "learned-folded", "learned-online")
GROUPINGS = ("token", "kivi", "skvq")
TRANSFORM_HELP = {"none": "no transform (the grouping alone)", "hadamard": "fixed normalised Hadamard (keys online)",
                  "smooth": "SmoothAttention-style per-pair key scaling (folded)",
                  "learned-folded": "learned RoPE-commuting keys + learned values, both folded into the weights",
                  "learned-online": "learned keys after RoPE (online) + learned values (folded)"}
GROUPING_DEFAULTS = {  # group sizes and parameter dtype of each grouping (as the RTN, KIVI and SKVQ rows)
    "token": {"key_group": 64, "value_group": 64, "param_dtype": "fp16"},
    "kivi": {"key_group": 32, "value_group": 32, "param_dtype": "fp16"},
    "skvq": {"key_group": 32, "value_group": 32, "param_dtype": "fp8-e4m3"},
}
SMOOTH_ALPHA = 0.5


@dataclass(frozen=True)
class LearnSettings:
    steps: int = 150
    rank: int = 8
    lr: float = 0.01
    seed: int = 0
    max_queries: int = 96


def grouping_quants(grouping: str, key_bits: int, value_bits: float, key_group: int | None,
                    value_group: int | None, param_dtype: str) -> tuple[QuantSpec, QuantSpec]:
    """The target (key, value) quantizers of a grouping: per-token groups, or KIVI's per-channel keys."""
    if grouping not in GROUPINGS:
        raise ValueError(f"unknown grouping {grouping!r}; allowed: {', '.join(GROUPINGS)}")
    kaxis = "channel" if grouping == "kivi" else "token"
    key = QuantSpec(fmt="int", bits=key_bits, axis=kaxis, group=key_group, param_dtype=param_dtype)
    if value_bits == 1.5:
        value = QuantSpec(fmt="ternary", bits=2, axis="token", group=value_group, param_dtype=param_dtype)
    else:
        value = QuantSpec(fmt="int", bits=int(value_bits), axis="token", group=value_group, param_dtype=param_dtype)
    return key, value


# ------------------------------------------------------------------------------------------------ STE quantizer
def fake_quant_ste(x: torch.Tensor, q: QuantSpec) -> torch.Tensor:
    """Differentiable stand-in for the cache's asymmetric min/max quantizer of x [N, H, L, D]: rounding passes
    the gradient straight through, group minima/maxima keep theirs.  Per-channel groups take ``q.group``
    consecutive tokens; a trailing partial group stays exact (the cache keeps it in full precision too)."""
    levels = 3 if q.fmt == "ternary" else 2 ** q.bits
    n, h, length, d = x.shape
    if q.axis == "token":
        g = d if q.group is None else q.group
        xg = x.reshape(n, h, length, d // g, g)
        return _fq(xg, levels).reshape(n, h, length, d)
    g = q.group or length
    full = length // g * g
    if full == 0:
        return x
    xg = x[:, :, :full].reshape(n, h, full // g, g, d).transpose(-1, -2)
    out = _fq(xg, levels).transpose(-1, -2).reshape(n, h, full, d)
    return torch.cat([out, x[:, :, full:]], dim=2)


def _fq(xg: torch.Tensor, levels: int) -> torch.Tensor:
    """The one affine quantizer's straight-through variant with float32 min/max parameters of each group."""
    mn = xg.amin(-1, keepdim=True)
    scale = ((xg.amax(-1, keepdim=True) - mn) / (levels - 1)).clamp_min(1e-8)
    return affine_ste(xg, scale, mn, 0, levels - 1, "float")


# ------------------------------------------------------------------------------------------------ per layer
def smooth_log_scales(k: torch.Tensor, alpha: float = SMOOTH_ALPHA) -> torch.Tensor:
    """SmoothAttention-style per-pair log-scales [H, D/2]: ``alpha * log max|k|`` over the pair (a RoPE pair must
    share one scale), centred so the scales' geometric mean is 1."""
    d = k.shape[-1]
    amax = k.abs().amax(dim=(0, 2))  # [H, D]
    pair = torch.maximum(amax[:, : d // 2], amax[:, d // 2:]).clamp_min(1e-6)
    u = alpha * torch.log(pair)
    return u - u.mean(dim=-1, keepdim=True)


class _Fixed(torch.nn.Module):
    def __init__(self, m: torch.Tensor, inv: torch.Tensor):
        super().__init__()
        self.register_buffer("m", m)
        self.register_buffer("inv", inv)

    def matrix(self) -> torch.Tensor:
        return self.m

    def inverse(self) -> torch.Tensor:
        return self.inv


class _Paired(torch.nn.Module):
    """A transform written for the full half-split pairing (i, i + D/2), moved to a partial rotary layout by the
    channel permutation of :func:`kvsqueeze.rope.pair_order`: ``A = A_c[inv][:, inv]``."""

    def __init__(self, inner: Any, order: torch.Tensor):
        super().__init__()
        self.inner = inner
        self.register_buffer("inv", torch.argsort(order))

    def matrix(self) -> torch.Tensor:
        return self.inner.matrix()[..., self.inv, :][..., :, self.inv]

    def inverse(self) -> torch.Tensor:
        return self.inner.inverse()[..., self.inv, :][..., :, self.inv]


def _modules(transform: str, acts: LayerActivations, learn: LearnSettings, shared_key_scales: bool = False
             ) -> tuple[Any, Any, str, str]:
    """(key module, value module, key family, value family); a module is None for no transform.

    RoPE-commuting key transforms follow the layer's RoPE pairing (partial rotary included); with
    ``shared_key_scales`` (a per-head q/k norm sits between W_k and RoPE) ``smooth`` uses one set of scales for
    every head, so the diagonal transform folds into the norm's shared weight."""
    h, d = acts.k.shape[1], acts.k.shape[-1]
    if transform == "none":
        return None, None, "", ""
    if transform == "hadamard":
        hd = hadamard(d).expand(h, d, d).clone()
        return _Fixed(hd, hd.transpose(-1, -2)), _Fixed(hd, hd.transpose(-1, -2)), "general", "general"
    rotary = acts.rope.rotary_dim if acts.rope is not None else d
    order = pair_order(d, rotary)

    def commuting() -> Any:
        u = smooth_log_scales(acts.k[..., order])
        if shared_key_scales:
            u = u.mean(0, keepdim=True).expand_as(u)
        m = RopeCommutingTransform(h, d, u)
        return m if rotary == d else _Paired(m, order)

    if transform == "smooth":
        return commuting(), None, "rope-commuting", ""
    value = GeneralTransform(h, d, learn.rank, base="hadamard", seed=learn.seed + 1)
    if transform == "learned-folded":
        return commuting(), value, "rope-commuting", "general"
    if transform == "learned-online":
        return GeneralTransform(h, d, learn.rank, base="hadamard", seed=learn.seed), value, "general", "general"
    raise ValueError(f"unknown transform {transform!r}; allowed: {', '.join(TRANSFORMS)}")


def _per_head(x: torch.Tensor, m: torch.Tensor, rep: int = 1) -> torch.Tensor:
    """x [N, H*rep, T, D] @ m[h] for the KV head h of each (query) head."""
    return torch.matmul(x, m.repeat_interleave(rep, 0)[None])


def transformed_error(acts: LayerActivations, qs: torch.Tensor, qpos: torch.Tensor, ref: torch.Tensor,
                      kq: QuantSpec, vq: QuantSpec, kmod: Any, vmod: Any) -> torch.Tensor:
    """Relative attention-output error per KV head [H] with every token quantized (STE quantizer)."""
    rep = qs.shape[1] // acts.k.shape[1]
    k, v, q = acts.k, acts.v, qs
    if kmod is not None:
        a = kmod.matrix()
        k = _per_head(k, a)
        q = _per_head(q, kmod.inverse().transpose(-1, -2), rep)  # X = A^-T
    if vmod is not None:
        v = _per_head(v, vmod.matrix())
    out = attention_out(q, fake_quant_ste(k, kq), fake_quant_ste(v, vq), qpos, acts.scaling, q_selected=True,
                        **layer_scope(acts, 0)[1])
    if vmod is not None:
        out = _per_head(out, vmod.inverse())  # grouped [N, Hkv, rep*P, D]: one Y^-1 per KV head
    return head_error(ref, out)


def learn_layer(acts: LayerActivations, transform: str, kq: QuantSpec, vq: QuantSpec, learn: LearnSettings,
                shared_key_scales: bool = False) -> tuple[dict[str, torch.Tensor | None], dict[str, Any]]:
    """Transforms of one layer: {"key": (A, A^-1) or None, "value": ...} and a record of errors/conditioning."""
    length = acts.k.shape[2]
    qpos = query_positions(length, learn.max_queries, start=16)
    qs = acts.q[:, :, qpos]
    with torch.no_grad():
        ref = attention_out(acts.q, acts.k, acts.v, qpos, acts.scaling, **layer_scope(acts, 0)[1])
        base_err = transformed_error(acts, qs, qpos, ref, kq, vq, None, None)
    kmod, vmod, kfam, vfam = _modules(transform, acts, learn, shared_key_scales)
    params = [p for m in (kmod, vmod) if m is not None for p in m.parameters()]
    with torch.no_grad():
        init_err = transformed_error(acts, qs, qpos, ref, kq, vq, kmod, vmod)
    if transform.startswith("learned") and params:
        opt = torch.optim.Adam(params, lr=learn.lr)
        for _ in range(learn.steps):
            opt.zero_grad(set_to_none=True)
            err = transformed_error(acts, qs, qpos, ref, kq, vq, kmod, vmod)
            err.sum().backward()
            opt.step()
    with torch.no_grad():
        final_err = transformed_error(acts, qs, qpos, ref, kq, vq, kmod, vmod)
        mats: dict[str, Any] = {}
        record: dict[str, Any] = {"error_no_transform": base_err.tolist(), "error_init": init_err.tolist(),
                                  "error_after": final_err.tolist()}
        for side, mod, fam in (("key", kmod, kfam), ("value", vmod, vfam)):
            if mod is None:
                mats[side] = None
                continue
            m, inv = mod.matrix().detach().float(), mod.inverse().detach().float()
            mats[side] = (m, inv, fam)
            record[f"{side}_condition"] = condition_number(m).tolist()
    return mats, record


def calibrate_invertible(acts: Activations, transform: str, grouping: str, kq: QuantSpec, vq: QuantSpec,
                         learn: LearnSettings, window: int = 0, sinks: int = 0, progress: bool = True,
                         shared_key_scales: bool = False) -> list[dict[str, Side]]:
    """Every layer's sides: the grouping's codec (plain, or SKVQ-calibrated on the transformed activations) with
    the transform's tensors attached (``transform`` = A, ``transform_inv`` = A^-1).  ``shared_key_scales``: see
    :func:`_modules` (models with a per-head q/k norm)."""
    from tqdm.auto import tqdm

    from .skvq import calibrate_group_side

    if transform not in TRANSFORMS:
        raise ValueError(f"unknown transform {transform!r}; allowed: {', '.join(TRANSFORMS)}")
    out = []
    bar = tqdm(acts.layers, desc=f"learning transforms ({transform}, {grouping})", disable=not progress)
    for la in bar:
        if la is None:
            out.append({s: Side("none", QuantSpec(fmt="none")) for s in ("key", "value")})
            continue
        mats, record = learn_layer(la, transform, kq, vq, learn, shared_key_scales)
        if progress:
            bar.set_postfix(err=f"{sum(record['error_no_transform']):.3g}->{sum(record['error_after']):.3g}")
        lay = {}
        for side, quant in (("key", kq), ("value", vq)):
            t = mats[side]
            settings: dict[str, Any] = {"transform": {"name": transform, "family": t[2] if t else None,
                                                      "condition": record.get(f"{side}_condition")},
                                        "objective": record}
            tensors: dict[str, torch.Tensor] = {} if t is None else {"transform": t[0], "transform_inv": t[1]}
            if grouping == "skvq":
                moved = _transformed_acts(la, mats)
                s = calibrate_group_side(moved, side, quant, True, "layer", window=window, sinks=sinks)
                lay[side] = Side("group", quant, {**s.tensors, **tensors}, {**s.settings, **settings})
            else:
                lay[side] = Side("plain", quant, tensors, settings)
        out.append(lay)
    return out


def _transformed_acts(la: LayerActivations, mats: dict[str, Any]) -> LayerActivations:
    """The activations the inner codec sees after the transforms (queries moved by X = A^-T)."""
    from dataclasses import replace

    k, q, v = la.k, la.q, la.v
    rep = q.shape[1] // k.shape[1]
    if mats["key"] is not None:
        k = _per_head(k, mats["key"][0])
        q = _per_head(q, mats["key"][1].transpose(-1, -2), rep)
    if mats["value"] is not None:
        v = _per_head(v, mats["value"][0])
    return replace(la, q=q, k=k, v=v)


def describe_conditioning(layers: list[dict[str, Side]]) -> dict[str, float]:
    """Largest condition number of the keys' and values' transforms over all layers (1.0 for none)."""
    res = {}
    for side in ("key", "value"):
        conds = [c for lay in layers for c in (lay[side].settings.get("transform", {}).get("condition") or [])]
        res[side] = max(conds) if conds else 1.0
    return res

