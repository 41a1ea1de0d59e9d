"""Shared builders and checks for kernel tests: a filled LayerKV, queries, masks, comparison with the reference."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from kvsqueeze.cache.layer import LayerKV
from kvsqueeze.cache.synthetic import filled_layer, padding_mask, query_for  # noqa: F401 (re-exported)
from kvsqueeze.kernels import reference

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


def bits_view(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bits as integers of its width, so that equality is bit for bit (NaN, -0.0)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def wild_rows(gen: torch.Generator, shape: tuple[int, ...], nonfinite: bool = False) -> torch.Tensor:
    """Rows of very different magnitudes (fp16 subnormal to beyond fp16's range), constant rows and ties for an
    encoder; ``nonfinite`` also -0.0, NaN, +-inf, a row without a finite value and one beyond the 2^50 limit (the
    random draws are the same either way)."""
    x = torch.randn(*shape, generator=gen)
    mag = 10 ** (torch.rand(*shape[:-1], 1, generator=gen) * 16 - 10)
    x = x * mag + torch.randn(*shape[:-1], 1, generator=gen) * mag
    x[..., 0, :] = 0.0
    x[..., 1, :] = 3.0
    x[..., 2, :] = torch.arange(shape[-1]).float() / 2 - 4  # codes land exactly on .5: round half to even
    if nonfinite:
        x[..., 3, :] = -0.0
        x[..., 4, 1] = float("nan")
        x[..., 5, 2] = float("inf")
        x[..., 6, 3] = float("-inf")
        x[..., 7, :] = float("inf")  # no finite value at all
        x[..., 8, 0] = 3e15
    return x


def assert_half_precision_matches(attend: Callable, spec: str, dtype: torch.dtype, new: int) -> None:
    """A model in fp16/bf16: ``attend`` returns its dtype and stays within 2e-2 of the reference."""
    layer = filled_layer(spec, batch=1, kv_heads=2, stored=300, new=new, dtype=dtype)
    q = query_for(layer, 4, new)
    ref = reference.attend(q, layer.plan(), None, 0.125)
    got = attend(q, layer.plan(), None, 0.125)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-2, rtol=2e-2)


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
# bounds it against each format's own error.  The AVX-512 builds' integer values (weights rounded to 16 bits per
# work item) move them by ~3e-5 more (test_integer_values_add_a_small_share_of_the_quantization_error).
INT_DOT_ATOL = 8e-4


def kernel_and_own_error(spec: str, head_dim: int) -> tuple[LayerKV, torch.Tensor, torch.Tensor]:
    """A layer of preset ``spec`` over 600 random tokens (599 stored, one new; batch 2, 2 KV heads, 6 query heads,
    seed ``head_dim``) and one decode step's outputs: the layer, the C++ kernel's largest difference from the
    reference over the same codes, and the reference's own from exact attention over the unquantized K/V."""
    from kvsqueeze.spec import preset

    g = torch.Generator().manual_seed(head_dim)
    k = torch.randn(2, 2, 600, head_dim, generator=g) * 2 + 0.5
    v = torch.randn(2, 2, 600, head_dim, generator=g)
    return _step_errors(LayerKV(preset(spec)), k, v, g, 6)


def exact_keys_kernel_and_own_error(value, head_dim: int, n: int, q_heads: int,
                                    seed: int) -> tuple[LayerKV, torch.Tensor, torch.Tensor]:
    """:func:`kernel_and_own_error` with exact keys and values stored as ``value`` (a QuantSpec), so that only the
    values are rounded: ``n`` random tokens (n - 1 stored, one new; batch 2, 2 KV heads, ``q_heads`` query heads;
    per-token value magnitudes up to 3), seed ``seed``."""
    from kvsqueeze.spec import CacheSpec, QuantSpec

    g = torch.Generator().manual_seed(seed)
    k = torch.randn(2, 2, n, head_dim, generator=g) * 2 + 0.5
    v = torch.randn(2, 2, n, head_dim, generator=g) * torch.rand(1, 1, n, 1, generator=g) * 3
    return _step_errors(LayerKV(CacheSpec(key=QuantSpec(fmt="none"), value=value)), k, v, g, q_heads)


def _step_errors(layer: LayerKV, k: torch.Tensor, v: torch.Tensor, g: torch.Generator,
                 q_heads: int) -> tuple[LayerKV, torch.Tensor, torch.Tensor]:
    """Store all but the last of the tokens ``k``/``v`` in ``layer`` and stage the last; one decode step of a query
    drawn from ``g``: the layer, the C++ kernel's largest difference from the reference and the reference's own
    from exact attention."""
    from kvsqueeze.kernels import cpu

    n, head_dim = k.shape[2], k.shape[3]
    layer.stage(k[:, :, : n - 1], v[:, :, : n - 1])
    layer.commit()
    layer.stage(k[:, :, n - 1:], v[:, :, n - 1:])
    q = torch.randn(2, q_heads, 1, head_dim, generator=g)
    scale = head_dim ** -0.5
    exact = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
    ref = reference.attend(q, layer.plan(), None, scale)
    got = cpu.attend(q, layer.plan(), None, scale)
    return layer, (got - ref).abs().max(), (ref - exact).abs().max()


def kernel_rounds(plan) -> bool:
    """Whether the selected C++ path rounds this plan's keys or values to integers (results within INT_DOT_ATOL of
    the reference rather than float32 rounding)."""
    from kvsqueeze.kernels import cpu

    return cpu.integer_scores(plan) or cpu.integer_values(plan)


def assert_matches_reference(attend: Callable, layer: LayerKV, q_heads: int, new: int,
                             mask: torch.Tensor | None = None, atol: float | None = None) -> None:
    """``attend(q, layer.plan(), mask, 0.125)`` equals the block-by-block reference: same shape and dtype (the query's),
    values within ``atol`` (default 5e-5, or INT_DOT_ATOL where the C++ kernel takes integer key scores or values)."""
    if atol is None:
        from kvsqueeze.kernels import cpu

        atol = INT_DOT_ATOL if attend is cpu.attend and kernel_rounds(layer.plan()) else 5e-5
    q = query_for(layer, q_heads, new)
    ref = reference.attend(q, layer.plan(), mask, 0.125)
    got = attend(q, layer.plan(), mask, 0.125)
    assert got.shape == ref.shape and got.dtype == ref.dtype == q.dtype
    torch.testing.assert_close(got.float(), ref.float(), atol=atol, rtol=0)
