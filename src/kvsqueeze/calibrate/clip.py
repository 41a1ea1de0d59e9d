"""Searches over a calibration grid that minimise the error of the attention output (SKVQ's clip ratio α,
KVQuant-style range quantiles).

The error of one layer is measured per KV head (each KV head's output depends on its own K/V only), so one pass
over the grid gives the best value per layer, per head, or - by coordinate descent - per group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..cache.emulate import quantized_mask

DEFAULT_CLIP_GRID = (1.0, 0.975, 0.95, 0.925, 0.9, 0.875, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6, 0.55, 0.5)
CLIP_MODES = ("none", "layer", "head", "group")


def query_positions(length: int, n: int = 128, start: int = 16) -> torch.Tensor:
    """Evenly spaced query positions used by the objective (attention over all keys before them); queries
    that would see no quantized token (``start`` = window + sinks) are skipped when the samples are long enough."""
    start = min(start, length - 1)
    return torch.linspace(start, length - 1, steps=min(n, length - start)).round().long().unique()


def attention_out(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, qpos: torch.Tensor, scaling: float,
                  k_hat: torch.Tensor | None = None, v_hat: torch.Tensor | None = None, window: int = 0,
                  sinks: int = 0, q_selected: bool = False, flush: int = 1, visible: int | None = None,
                  softcap: float | None = None) -> torch.Tensor:
    """Causal attention of the queries at ``qpos``: q [N, Hq, L, D], k/v [N, Hkv, L, D] -> [N, Hkv, rep*|qpos|, D]
    (query heads grouped by KV head).  ``q_selected``: q is already [N, Hq, |qpos|, D] (the queries at qpos).

    With ``k_hat``/``v_hat`` (the quantized K/V), each query sees exactly what the cache would give it when
    decoding position p (p tokens stored): the cache's own split (:func:`kvsqueeze.cache.emulate.quantized_mask`,
    with ``window``, ``sinks`` and the cache's ``flush`` granularity) - sinks, the window and its own token exact,
    older tokens quantized.  ``visible``: a sliding layer's window (queries see only their last ``visible`` keys);
    ``softcap``: the model's attention-logit soft-capping."""
    n, hq, _, d = q.shape
    length, hkv = k.shape[2], k.shape[1]
    rep = hq // hkv
    qs = (q if q_selected else q[:, :, qpos]).float().reshape(n, hkv, -1, d)  # [N, Hkv, rep*P, D]
    kpos = torch.arange(length)
    allowed = kpos[None, :] <= qpos[:, None]
    if visible is not None:
        allowed = allowed & (kpos[None, :] > qpos[:, None] - visible)
    allowed = allowed.repeat(rep, 1)  # [rep*P, L]
    s = torch.matmul(qs, k.float().transpose(-1, -2)) * scaling
    exact = None
    if k_hat is not None or v_hat is not None:
        exact = (~quantized_mask(window, sinks, flush, qpos, length)).repeat(rep, 1)
        if k_hat is not None:
            s = torch.where(exact, s, torch.matmul(qs, k_hat.float().transpose(-1, -2)) * scaling)
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1)
    if v_hat is None or exact is None:
        return torch.matmul(p, v.float())
    return torch.matmul(p * exact, v.float()) + torch.matmul(p * ~exact, v_hat.float())


def layer_scope(acts, sinks: int) -> tuple[int, dict]:
    """(sinks, attention_out keywords) of one layer's objective: a sliding layer keeps no sinks (the cache masks
    them out of the window) and each query sees only its window; soft-capping as the model applies it."""
    sliding = getattr(acts, "sliding_window", None)
    return (sinks if sliding is None else 0), {"visible": sliding, "softcap": getattr(acts, "softcap", None)}


def head_error(ref: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Squared error of the attention output per KV head [Hkv], relative to the reference's energy."""
    return ((out - ref) ** 2).sum(dim=(0, 2, 3)) / (ref ** 2).sum(dim=(0, 2, 3)).clamp_min(1e-30)


def grid_search(errors_of: Callable[[float], torch.Tensor], grid: Sequence[float], per_head: bool
                ) -> tuple[torch.Tensor, dict[float, torch.Tensor]]:
    """Evaluate ``errors_of(value) -> [H]`` on the grid; return the best value per head ([H]; all equal unless
    ``per_head``) and the errors.  Ties go to the earlier grid value."""
    errs = {g: errors_of(g) for g in grid}
    table = torch.stack([errs[g] for g in grid])  # [G, H]
    vals = torch.tensor(list(grid), dtype=torch.float32)
    if per_head:
        best = vals[table.argmin(0)]
    else:
        best = vals[table.sum(1).argmin()].expand(table.shape[1]).clone()
    return best, errs


def search_clip(errors_of: Callable[[torch.Tensor], torch.Tensor], heads: int, n_groups: int, mode: str,
                grid: Sequence[float] = DEFAULT_CLIP_GRID, rounds: int = 1) -> torch.Tensor:
    """Clip ratios [H, n_groups] minimising ``errors_of(clip [H, n_groups]) -> [H]``.

    mode "none": all 1; "layer": one ratio for the layer; "head": one per KV head; "group": per head, then each
    group refined in turn (coordinate descent, ``rounds`` passes) with the other groups fixed.
    """
    if mode not in CLIP_MODES:
        raise ValueError(f"unknown clip mode {mode!r}; allowed: {', '.join(CLIP_MODES)}")
    clip = torch.ones(heads, n_groups)
    if mode == "none":
        return clip
    best, _ = grid_search(lambda a: errors_of(torch.full((heads, n_groups), a)), grid, per_head=mode != "layer")
    clip = best[:, None].expand(heads, n_groups).clone()
    if mode == "group" and n_groups > 1:
        for _ in range(rounds):
            for j in range(n_groups):
                def err_j(a: float, j: int = j) -> torch.Tensor:
                    c = clip.clone()
                    c[:, j] = a
                    return errors_of(c)

                clip[:, j], _ = grid_search(err_j, grid, per_head=True)
    return clip
