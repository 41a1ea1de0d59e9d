"""Balanced k-means over channels: SKVQ's channel reordering, written in torch (no scikit-learn needed).

Every quantization group must hold exactly ``group`` channels, so plain k-means (clusters of any size) is
followed by a capacity-constrained assignment: (channel, cluster) pairs are taken nearest first and a cluster
stops accepting channels once full.  Channels are described by features such as their (min, max) over the
calibration tokens, so each group ends up with channels of similar range.
"""

from __future__ import annotations

import torch


def _balanced_assign(dist: torch.Tensor, capacity: int) -> torch.Tensor:
    """Assign each row of ``dist`` [N, K] to a column, at most ``capacity`` rows per column, nearest pairs first."""
    n, k = dist.shape
    order = torch.argsort(dist.flatten())
    assign = torch.full((n,), -1, dtype=torch.long)
    fill = [0] * k
    left = n
    for flat in order.tolist():
        i, j = divmod(flat, k)
        if assign[i] < 0 and fill[j] < capacity:
            assign[i] = j
            fill[j] += 1
            left -= 1
            if left == 0:
                break
    return assign


def balanced_kmeans(features: torch.Tensor, group: int, iters: int = 20) -> torch.Tensor:
    """Cluster N rows of ``features`` [N, F] into N // group clusters of exactly ``group`` rows.

    Deterministic: centroids start from the rows sorted by their feature sum, cut into equal chunks (the optimal
    answer for one feature), then alternate balanced assignment and centroid update.  Returns the cluster of
    each row [N] (long).
    """
    n = features.shape[0]
    if n % group:
        raise ValueError(f"group size {group} does not divide the {n} channels")
    k = n // group
    x = features.float()
    x = (x - x.mean(0)) / x.std(0).clamp_min(1e-8)  # features on one scale
    init = torch.argsort(x.sum(-1))
    assign = torch.empty(n, dtype=torch.long)
    assign[init] = torch.arange(n) // group
    for _ in range(iters):
        cent = torch.stack([x[assign == j].mean(0) for j in range(k)])
        new = _balanced_assign(torch.cdist(x, cent), group)
        if torch.equal(new, assign):
            break
        assign = new
    return assign


def reorder_permutation(ch_min: torch.Tensor, ch_max: torch.Tensor, group: int) -> torch.Tensor:
    """Channel order [D] so that each run of ``group`` stored channels is one balanced cluster of channels with
    similar (min, max) range; clusters are ordered by their mean range, channels within one by index."""
    d = ch_min.numel()
    if group >= d:
        return torch.arange(d)
    assign = balanced_kmeans(torch.stack([ch_min.float(), ch_max.float()], -1), group)
    rng = (ch_max - ch_min).float()
    k = d // group
    order = sorted(range(k), key=lambda j: float(rng[assign == j].mean()))
    return torch.cat([torch.nonzero(assign == j).flatten() for j in order])


def kmeans_1d(values: torch.Tensor, levels: int, weights: torch.Tensor | None = None, iters: int = 25
              ) -> torch.Tensor:
    """Weighted 1-D k-means (Lloyd) of ``values`` into ``levels`` sorted levels, started from a uniform grid
    over [min, max].  Used for non-uniform codebooks."""
    v = values.float().flatten()
    w = torch.ones_like(v) if weights is None else weights.float().flatten()
    cb = torch.linspace(float(v.min()), float(v.max()), levels)
    for _ in range(iters):
        idx = torch.searchsorted((cb[1:] + cb[:-1]) / 2, v)
        num = torch.zeros(levels).index_add_(0, idx, v * w)
        den = torch.zeros(levels).index_add_(0, idx, w)
        new = torch.where(den > 0, num / den.clamp_min(1e-30), cb)
        new, _ = torch.sort(new)
        if torch.allclose(new, cb, atol=1e-7):
            break
        cb = new
    return cb
