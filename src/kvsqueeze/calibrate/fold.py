"""Folding SKVQ's value channel permutation into the model's weights (exact, for export).

Values are only ever mixed by attention weights and then multiplied by W_o, so permuting the output rows of
W_v (and its bias) per KV head and the matching input columns of W_o for every query head of that KV head
leaves the model's function unchanged while the value cache is produced already in calibrated order.  Keys
cannot be folded this way: W_q/W_k rows feed RoPE, which pairs channel i with i + D/2 at a frequency that depends
on i, so only a gather (done by the codec) keeps RoPE exact.
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
