"""Synthetic layers for checking and timing the attention kernels (no model): a layer holding random committed tokens and a
step's pending ones, the step's query, and a padding mask.  The kernel tests use them (re-exported by
tests/kernels/_helpers.py) and so do the offline GPU tools (benchmarks/triton_compile_check.py,
benchmarks/decode_loop_cost.py), which never import from tests/."""

from __future__ import annotations

import torch

from ..spec import CacheSpec, preset
from .layer import LayerKV


def filled_layer(spec: CacheSpec | str, batch: int = 1, kv_heads: int = 2, head_dim: int = 64, stored: int = 300,
                 new: int = 1, steps: int = 1, dtype: torch.dtype = torch.float32, sliding: int | None = None,
                 seed: int = 0, device: str = "cpu", fast_encode=None, pooled: bool | None = None) -> LayerKV:
    """A layer holding ``stored`` committed tokens (a prompt then ``steps - 1`` smaller appends) and ``new``
    pending tokens; ``fast_encode`` is handed to its block store as the adapter does, ``pooled`` too (None: the
    store keeps a pool on devices other than the CPU)."""
    g = torch.Generator().manual_seed(seed)
    layer = LayerKV(preset(spec), sliding_window=sliding)
    layer.fast_encode = fast_encode
    layer.pooled = pooled

    def kv(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        k = torch.randn(batch, kv_heads, n, head_dim, generator=g) * 2 + 0.5
        v = torch.randn(batch, kv_heads, n, head_dim, generator=g)
        return k.to(device, dtype), v.to(device, dtype)

    first = stored - (steps - 1)
    if first > 0:
        layer.stage(*kv(first))
        layer.commit()
    for _ in range(steps - 1):
        layer.stage(*kv(1))
        layer.commit()
    layer.stage(*kv(new))
    return layer


def query_for(layer: LayerKV, q_heads: int, new: int, seed: int = 1) -> torch.Tensor:
    """A random query [B, q_heads, new, D] for ``layer``'s step, on its device and in its dtype."""
    b, _, d = layer.shape
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, q_heads, new, d, generator=g).to(layer.store.device, layer.dtype)


def padding_mask(layer: LayerKV, new: int, pads: list[int]) -> torch.Tensor:
    """Bool mask [B, 1, new, kv_len]: sequence i ignores its first pads[i] columns; new tokens causal."""
    kv_len = layer.n_total - layer.first_visible + new
    cols = torch.arange(kv_len)
    rows = torch.arange(new) + (kv_len - new)
    causal = cols[None, :] <= rows[:, None]
    m = torch.stack([causal & (cols[None, :] >= p) for p in pads])
    return m[:, None].to(layer.store.device)
