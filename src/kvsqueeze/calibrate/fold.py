"""Folding calibrated transforms into the model's weights (exact, for export): SKVQ's value channel
permutation, and the invertible key/value transforms of the ``invertible`` method (:func:`fold_transforms`).

Values are only ever mixed by attention weights and then multiplied by W_o, so permuting the output rows of
W_v (and its bias) per KV head and the matching input columns of W_o for every query head of that KV head
leaves the model's function unchanged while the value cache is produced already in calibrated order.  Keys
cannot be folded this way: W_q/W_k rows feed RoPE, which pairs channel i with i + D/2 at a frequency that depends
on i, so only a gather (done by the codec) keeps RoPE exact - unless the key transform commutes with RoPE
(per-pair scaled rotations, :func:`kvsqueeze.transforms.matrices.rope_commuting`), which folds before RoPE.
"""

from __future__ import annotations

from typing import Any

import torch


def _attn_modules(model: Any) -> list[Any]:
    mods = [m for m in model.modules() if hasattr(m, "v_proj") and hasattr(m, "o_proj")]
    if not mods:
        raise ValueError("no attention modules with v_proj/o_proj found: value folding supports Llama-style models")
    return mods


@torch.no_grad()
def fold_value_permutation(model: Any, perms: list[torch.Tensor | None]) -> None:
    """Permute, in place, each layer's W_v rows and W_o columns by ``perms[layer]`` ([Hkv, D] or None).

    After folding, stored value channel j of KV head h is the old channel ``perms[layer][h, j]``; use the
    artifact with its value permutation dropped (:meth:`Artifact.with_values_folded`)."""
    mods = _attn_modules(model)
    if len(perms) != len(mods):
        raise ValueError(f"{len(perms)} permutations for a model with {len(mods)} attention layers")
    for mod, perm in zip(mods, perms):
        if perm is None:
            continue
        hkv, d = perm.shape
        rows = (torch.arange(hkv)[:, None] * d + perm.long()).flatten()  # new row r reads old row rows[r]
        mod.v_proj.weight.copy_(mod.v_proj.weight[rows])
        if mod.v_proj.bias is not None:
            mod.v_proj.bias.copy_(mod.v_proj.bias[rows])
        hq = mod.o_proj.weight.shape[1] // d
        rep = hq // hkv
        cols = (torch.arange(hq)[:, None] * d + perm.long().repeat_interleave(rep, 0)).flatten()
        mod.o_proj.weight.copy_(mod.o_proj.weight[:, cols])


def rope_commutes(matrix: torch.Tensor, inv_freq: torch.Tensor, positions: tuple[int, ...] = (1, 7, 100, 4099),
                  atol: float = 1e-5) -> bool:
    """Whether ``rope(x) @ A == rope(x @ A)`` for every x at the given positions (checked on the basis)."""
    from ..rope import apply_rope, rope_cos_sin

    d = matrix.shape[-1]
    eye = torch.eye(d, dtype=torch.float64)
    cos, sin = rope_cos_sin(torch.tensor(positions), inv_freq, 1.0)
    a = matrix.double()
    for i in range(len(positions)):
        r = apply_rope(eye, cos[i].double(), sin[i].double())  # rows: rope of each basis vector = R_p
        if not torch.allclose(r @ a, apply_rope(a, cos[i].double(), sin[i].double()), atol=atol):
            return False
    return True


@torch.no_grad()
def fold_transforms(model: Any, keys: list[Any], values: list[Any], inv_freq: torch.Tensor | None = None) -> None:
    """Fold per-layer key transforms A (``k -> k @ A``, queries ``q -> q @ A^-T``) and value transforms B
    (``v -> v @ B``, ``o_proj`` input ``-> @ B^-1``) into the weights, in place.

    ``keys[i]`` / ``values[i]``: (A, A^-1, family) with A [Hkv, D, D], or None.  Key transforms are applied to
    ``W_k`` *before* RoPE, which is exact only for RoPE-commuting ones: with ``inv_freq`` each is checked (a
    ValueError names the layer otherwise)."""
    mods = _attn_modules(model)
    if len(keys) != len(mods) or len(values) != len(mods):
        raise ValueError(f"{len(keys)}/{len(values)} transforms for a model with {len(mods)} attention layers")
    for i, (mod, kt, vt) in enumerate(zip(mods, keys, values)):
        if kt is not None:
            a, a_inv = kt[0].double(), kt[1].double()
            if inv_freq is not None and not rope_commutes(a, inv_freq):
                raise ValueError(f"layer {i}: the key transform does not commute with RoPE, so it cannot be folded "
                                 "before RoPE (use it online through the cache)")
            hkv, d = a.shape[0], a.shape[-1]
            _fold_out(mod.k_proj, a, hkv, d)
            rep = mod.q_proj.weight.shape[0] // d // hkv
            _fold_out(mod.q_proj, a_inv.transpose(-1, -2).repeat_interleave(rep, 0), hkv * rep, d)
        if vt is not None:
            b, b_inv = vt[0].double(), vt[1].double()
            hkv, d = b.shape[0], b.shape[-1]
            _fold_out(mod.v_proj, b, hkv, d)
            w = mod.o_proj.weight  # [hidden, Hq*D]: input columns of query head j get @ B^-T of its KV head
            hq = w.shape[1] // d
            m = b_inv.transpose(-1, -2).repeat_interleave(hq // hkv, 0)  # [Hq, D, D]
            wo = w.double().reshape(w.shape[0], hq, d)
            w.copy_(torch.matmul(wo.transpose(0, 1), m).transpose(0, 1).reshape_as(w).to(w.dtype))


def _fold_out(linear: Any, m: torch.Tensor, heads: int, d: int) -> None:
    """Make a projection's per-head output ``y_h`` become ``y_h @ m[h]`` (weight rows and bias)."""
    w = linear.weight  # [heads*D, in]; y_h = x W_h^T, so W_h -> m^T W_h
    wh = w.double().reshape(heads, d, -1)
    w.copy_(torch.matmul(m.transpose(-1, -2), wh).reshape_as(w).to(w.dtype))
    if linear.bias is not None:
        b = linear.bias.double().reshape(heads, 1, d)
        linear.bias.copy_(torch.matmul(b, m).reshape_as(linear.bias).to(linear.bias.dtype))
