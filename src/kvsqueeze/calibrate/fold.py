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
    from ..layout import attention_modules

    mods = attention_modules(model)
    if not mods or any(_rows(m, "v") is None for m in mods):
        raise ValueError("folding needs attention modules with q/k/v/o projections (separate q_proj/k_proj/v_proj/"
                         "o_proj, or a fused [q; k; v] qkv_proj and o_proj); this model's attention has neither")
    return mods


def _rows(mod: Any, which: str) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight rows, bias rows or None) of the q, k or v projection as views into the module's parameters, so an
    in-place copy into them edits the model (a fused qkv_proj is sliced [q; k; v])."""
    lin = getattr(mod, f"{which}_proj", None)
    if lin is not None and hasattr(mod, "o_proj"):
        return lin.weight, lin.bias
    fused = getattr(mod, "qkv_proj", None)
    if fused is None or not hasattr(mod, "o_proj"):
        return None
    d = mod.head_dim
    hq = mod.o_proj.weight.shape[1] // d
    hkv = (fused.weight.shape[0] // d - hq) // 2
    lo, hi = {"q": (0, hq * d), "k": (hq * d, (hq + hkv) * d), "v": ((hq + hkv) * d, (hq + 2 * hkv) * d)}[which]
    return fused.weight[lo:hi], None if fused.bias is None else fused.bias[lo:hi]


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
        vw, vb = _rows(mod, "v")
        vw.copy_(vw[rows].clone())
        if vb is not None:
            vb.copy_(vb[rows].clone())
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
def fold_transforms(model: Any, keys: list[Any], values: list[Any],
                    inv_freq: torch.Tensor | list[torch.Tensor] | None = None) -> None:
    """Fold per-layer key transforms A (``k -> k @ A``, queries ``q -> q @ A^-T``) and value transforms B
    (``v -> v @ B``, ``o_proj`` input ``-> @ B^-1``) into the weights, in place.

    ``keys[i]`` / ``values[i]``: (A, A^-1, family) with A [Hkv, D, D], or None.  Key transforms are applied
    *before* RoPE, which is exact only for RoPE-commuting ones: with ``inv_freq`` (one table, or one per layer;
    fewer than D/2 frequencies = partial rotary) each is checked (a ValueError names the layer otherwise).  Where
    a per-head q/k norm sits between W_k and RoPE, a key transform must be diagonal and shared by every head; it
    then goes into the norms' weights (anything else is a ValueError: keep such a transform online)."""
    mods = _attn_modules(model)
    if len(keys) != len(mods) or len(values) != len(mods):
        raise ValueError(f"{len(keys)}/{len(values)} transforms for a model with {len(mods)} attention layers")
    tables = inv_freq if isinstance(inv_freq, (list, tuple)) else [inv_freq] * len(mods)
    for i, (mod, kt, vt) in enumerate(zip(mods, keys, values)):
        if kt is not None:
            a, a_inv = kt[0].double(), kt[1].double()
            if tables[i] is not None and tables[i].numel() and not rope_commutes(a, tables[i]):
                raise ValueError(f"layer {i}: the key transform does not commute with RoPE, so it cannot be folded "
                                 "before RoPE (use it online through the cache)")
            hkv, d = a.shape[0], a.shape[-1]
            if getattr(mod, "k_norm", None) is not None or getattr(mod, "q_norm", None) is not None:
                _fold_into_norms(mod, a, i)
            else:
                _fold_rows(*_rows(mod, "k"), a, hkv, d)
                qw, qb = _rows(mod, "q")
                rep = qw.shape[0] // d // hkv
                _fold_rows(qw, qb, a_inv.transpose(-1, -2).repeat_interleave(rep, 0), hkv * rep, d)
        if vt is not None:
            b, b_inv = vt[0].double(), vt[1].double()
            hkv, d = b.shape[0], b.shape[-1]
            _fold_rows(*_rows(mod, "v"), b, hkv, d)
            w = mod.o_proj.weight  # [hidden, Hq*D]: input columns of query head j get @ B^-T of its KV head
            hq = w.shape[1] // d
            m = b_inv.transpose(-1, -2).repeat_interleave(hq // hkv, 0)  # [Hq, D, D]
            wo = w.double().reshape(w.shape[0], hq, d)
            w.copy_(torch.matmul(wo.transpose(0, 1), m).transpose(0, 1).reshape_as(w).to(w.dtype))


def shared_diagonal(a: torch.Tensor, rtol: float = 1e-6) -> torch.Tensor | None:
    """The diagonal [D] of transforms a [H, D, D] that are diagonal and equal for every head, else None."""
    diag = a.diagonal(dim1=-2, dim2=-1)
    scale = float(a.abs().max())
    if float((a - torch.diag_embed(diag)).abs().max()) > rtol * scale:
        return None
    if float((diag - diag[:1]).abs().max()) > rtol * scale:
        return None
    return diag[0]


def _fold_into_norms(mod: Any, a: torch.Tensor, layer: int) -> None:
    """Keys scaled by ``s`` after a per-head norm: its weight takes ``s``, the query norm's weight ``1 / s``."""
    s = shared_diagonal(a)
    if s is None:
        raise ValueError(f"layer {layer}: a q/k norm sits between W_k and RoPE, and the key transform is not a "
                         "diagonal shared by all heads, so it cannot be folded (keep it online through the cache: "
                         "--transform learned-online)")
    for norm, factor in ((getattr(mod, "k_norm", None), s), (getattr(mod, "q_norm", None), 1.0 / s)):
        if norm is None or norm.weight.numel() != s.numel():
            raise ValueError(f"layer {layer}: the q/k norms do not carry one weight of head_dim channels; the key "
                             "transform cannot be folded into them (keep it online through the cache)")
        off = _norm_offset(norm)  # Gemma's RMSNorm multiplies by (1 + weight)
        w = norm.weight
        w.copy_(((w.double() + off) * factor - off).to(w.dtype))
        if getattr(norm, "bias", None) is not None:
            norm.bias.copy_((norm.bias.double() * factor).to(norm.bias.dtype))


def _norm_offset(norm: Any) -> float:
    """0 for a norm that multiplies by its weight, 1 for one that multiplies by (1 + weight): a copy with a zero
    weight gives zeros in the first case."""
    import copy

    probe = copy.deepcopy(norm)
    probe.weight.zero_()
    if getattr(probe, "bias", None) is not None:
        probe.bias.zero_()
    x = torch.linspace(-1.0, 1.0, norm.weight.numel(), dtype=norm.weight.dtype)[None]
    return 0.0 if float(probe(x).abs().max()) == 0.0 else 1.0


def _fold_rows(w: torch.Tensor, bias: torch.Tensor | None, m: torch.Tensor, heads: int, d: int) -> None:
    """Make a projection's per-head output ``y_h`` become ``y_h @ m[h]`` (weight rows and bias, in place)."""
    wh = w.double().reshape(heads, d, -1)  # [heads*D, in]; y_h = x W_h^T, so W_h -> m^T W_h
    w.copy_(torch.matmul(m.transpose(-1, -2), wh).reshape_as(w).to(w.dtype))
    if bias is not None:
        b = bias.double().reshape(heads, 1, d)
        bias.copy_(torch.matmul(b, m).reshape_as(bias).to(bias.dtype))
