"""Shared builders and checks for kernel tests: a filled LayerKV, queries, masks, comparison with the reference."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvsqueeze.cache.layer import LayerKV
from kvsqueeze.kernels import reference
from kvsqueeze.spec import CacheSpec, preset

ROOT = Path(__file__).resolve().parents[2]


def script_env(**overrides: str | None) -> dict[str, str]:
    """This process's environment for a script of the repository run in a subprocess: its src on PYTHONPATH, and
    ``overrides`` set (None: removed, e.g. TRITON_INTERPRET for scripts that compile)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    for key, value in overrides.items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


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
    b, _, d = layer.shape
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, q_heads, new, d, generator=g).to(layer.store.device, layer.dtype)


def assert_half_precision_matches(attend: Callable, spec: str, dtype: torch.dtype, new: int) -> None:
    """A model in fp16/bf16: ``attend`` returns its dtype and stays within 2e-2 of the reference."""
    layer = filled_layer(spec, batch=1, kv_heads=2, stored=300, new=new, dtype=dtype)
    q = query_for(layer, 4, new)
    ref = reference.attend(q, layer.plan(), None, 0.125)
    got = attend(q, layer.plan(), None, 0.125)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


def padding_mask(layer: LayerKV, new: int, pads: list[int]) -> torch.Tensor:
    """Bool mask [B, 1, new, kv_len]: sequence i ignores its first pads[i] columns; new tokens causal."""
    kv_len, _ = layer.n_total - layer.first_visible + new, layer.first_visible
    cols = torch.arange(kv_len)
    rows = torch.arange(new) + (kv_len - new)
    causal = cols[None, :] <= rows[:, None]
    m = torch.stack([causal & (cols[None, :] >= p) for p in pads])
    return m[:, None].to(layer.store.device)


HAS_TRITON = importlib.util.find_spec("triton") is not None
# Triton tests run on the GPU when there is one (the interpreter is only switched on without one)
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def require_triton_runtime() -> None:
    """Skip unless Triton kernels can run here: on a GPU, or on CPU under the interpreter (tests/kernels/conftest.py
    switches it on when there is no GPU)."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and the interpreter is off")


# The C++ kernel's integer key scores round the query to ~15 bits (AVX-512: two int8 parts; AVX2 and 8-bit codes:
# int16; the same step either way): on these O(1) outputs that moves results by up to ~5.5e-4 (measured over this
# table: 2-bit keys at head_dim 256, int16 query; two int8 parts gave 2.9e-4 on the same case and more on others),
# against float32 rounding (< 5e-6) elsewhere; test_integer_scores_add_a_small_share_of_the_quantization_error
# bounds it against each format's own error.
INT_DOT_ATOL = 8e-4


def assert_matches_reference(attend: Callable, layer: LayerKV, q_heads: int, new: int,
                             mask: torch.Tensor | None = None, atol: float | None = None) -> None:
    """``attend(q, layer.plan(), mask, 0.125)`` equals the block-by-block reference: same shape and dtype (the query's),
    values within ``atol`` (default 5e-5, or INT_DOT_ATOL where the C++ kernel takes integer key scores)."""
    if atol is None:
        from kvsqueeze.kernels import cpu

        atol = INT_DOT_ATOL if attend is cpu.attend and cpu.integer_scores(layer.plan()) else 5e-5
    q = query_for(layer, q_heads, new)
    ref = reference.attend(q, layer.plan(), mask, 0.125)
    got = attend(q, layer.plan(), mask, 0.125)
    assert got.shape == ref.shape and got.dtype == ref.dtype == q.dtype
    torch.testing.assert_close(got.float(), ref.float(), atol=atol, rtol=0)
