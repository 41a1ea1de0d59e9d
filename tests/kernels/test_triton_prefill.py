"""Triton prefill (many queries over a packed cache) against the block-by-block reference.

Under TRITON_INTERPRET=1 on CPU with tiny tiles (tests/kernels/conftest.py), on CUDA when present.  Tolerance:
atol 5e-5 (float32 products, accumulated in a different order than the reference).
"""

from __future__ import annotations

import pytest
import torch

from kvsqueeze.cache.layer import LayerKV
from kvsqueeze.kernels import reference
from kvsqueeze.spec import CacheSpec, preset

from ._helpers import (
    HAS_TRITON,
    TRITON_DEVICE,
    assert_matches_reference,
    filled_layer,
    padding_mask,
    query_for,
    require_triton_runtime,
)

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


@pytest.fixture(params=["tiled", "dense"])
def td(request, monkeypatch):
    """The Triton attend, each prefill test run through both routes (KVSQUEEZE_TRITON_PREFILL_DENSE 0 / 1)."""
    from kvsqueeze.kernels import triton_decode, triton_prefill

    require_triton_runtime()
    monkeypatch.setattr(triton_prefill, "BLOCK_M", 16)
    monkeypatch.setattr(triton_prefill, "BLOCK_N", 16)
    monkeypatch.setattr(triton_prefill, "UNPACK_T", 16)
    monkeypatch.setenv("KVSQUEEZE_TRITON_PREFILL_DENSE", "1" if request.param == "dense" else "0")
    return triton_decode



def _routed(td, monkeypatch) -> list:
    """Record that attend really went through the prefill kernel (not the reference)."""
    from kvsqueeze.kernels import triton_prefill

    calls = []
    real = triton_prefill.attend_prefill
    monkeypatch.setattr(triton_prefill, "attend_prefill", lambda *a: calls.append(1) or real(*a))
    return calls


# per-channel keys + per-token values (KIVI), 2/4/8 bits, sinks, GQA, windows that end mid-group
@pytest.mark.parametrize("spec,kv_heads,q_heads,stored,pads", [
    ("k2c16-v2t16-w16-s4", 1, 2, 90, [0, 21]),
    ("k4c16-v4t16-w16", 2, 4, 75, None),
    ("k8t16-v8t32-w0", 2, 2, 64, [3, 0]),
    ("k4t16-v2c16-w32-s2", 1, 4, 101, [0, 40]),
])
def test_prefill_matches_reference(td, monkeypatch, spec, kv_heads, q_heads, stored, pads):
    calls = _routed(td, monkeypatch)
    new = 37  # > MAX_QUERIES, not a multiple of any tile
    layer = filled_layer(spec, batch=2, kv_heads=kv_heads, head_dim=32, stored=stored, new=new, steps=3, device=TRITON_DEVICE)
    assert layer.n_history > 0 and len(layer.store.blocks) >= 1
    mask = padding_mask(layer, new, pads) if pads else None
    assert_matches_reference(td.attend, layer, q_heads, new, mask)
    assert calls == [1]


def test_prefill_float_mask_fp16(td):
    new = 20
    layer = filled_layer("k2c16-v4t16-w16", batch=2, kv_heads=1, head_dim=16, stored=150, new=new,
                         dtype=torch.float16, device=TRITON_DEVICE)
    bool_mask = padding_mask(layer, new, [0, 33])
    fmask = torch.zeros(bool_mask.shape, dtype=torch.float16, device=bool_mask.device).masked_fill(
        ~bool_mask, torch.finfo(torch.float16).min)
    assert_matches_reference(td.attend, layer, 3, new, fmask, atol=2e-3)  # output rounded to fp16


def test_prefill_on_empty_history_and_multi_block(td):
    # a first prompt: nothing stored yet, causal among the new tokens only
    layer = filled_layer("k4c16-v4t16-w16", batch=1, kv_heads=1, head_dim=32, stored=0, new=24, device=TRITON_DEVICE)
    assert_matches_reference(td.attend, layer, 2, 24)
    # several packed blocks (block_tokens 32), mask None: history fully visible, new tokens causal
    spec = preset("k2c16-v2t16-w16")
    layer = LayerKV(CacheSpec(key=spec.key, value=spec.value, window=16, block_tokens=32))
    g = torch.Generator().manual_seed(3)
    layer.stage(torch.randn(1, 2, 120, 32, generator=g).to(TRITON_DEVICE),
                torch.randn(1, 2, 120, 32, generator=g).to(TRITON_DEVICE))
    layer.commit()
    layer.stage(torch.randn(1, 2, 18, 32, generator=g).to(TRITON_DEVICE),
                torch.randn(1, 2, 18, 32, generator=g).to(TRITON_DEVICE))
    assert len(layer.store.blocks) >= 3
    assert_matches_reference(td.attend, layer, 4, 18)


def test_prefill_sliding_layer_after_eviction(td):
    new = 17
    layer = filled_layer("k2c16-v2t16-w16", batch=1, kv_heads=1, head_dim=16, stored=600, new=new, steps=2,
                         sliding=300, device=TRITON_DEVICE)
    assert layer.first_visible > 0
    assert_matches_reference(td.attend, layer, 2, new, padding_mask(layer, new, [0]))


def test_dense_route_is_taken_where_the_history_is_short_next_to_the_queries(monkeypatch):
    """auto: the dense route when 2 x kv heads x kv_len <= DENSE_RATIO x query heads x Lq; 0 / 1 force it; any
    other value is refused naming the allowed ones."""
    from kvsqueeze.kernels import triton_prefill

    require_triton_runtime()
    monkeypatch.delenv("KVSQUEEZE_TRITON_PREFILL_DENSE", raising=False)
    layer = filled_layer("k4c16-v4t16-w16", batch=1, kv_heads=2, head_dim=32, stored=100, new=30, device=TRITON_DEVICE)
    kv_len = layer.plan().kv_length(30)
    assert kv_len == 130
    # 2 x 2 x 130 = 520 rows of keys and values: dense from 520 / 4 = 130 query rows (heads x 30) on
    assert not triton_prefill.dense(query_for(layer, 4, 30), layer.plan())  # 120 query rows
    assert triton_prefill.dense(query_for(layer, 6, 30), layer.plan())  # 180
    monkeypatch.setenv("KVSQUEEZE_TRITON_PREFILL_DENSE", "1")
    assert triton_prefill.dense(query_for(layer, 4, 30), layer.plan())
    monkeypatch.setenv("KVSQUEEZE_TRITON_PREFILL_DENSE", "0")
    assert not triton_prefill.dense(query_for(layer, 6, 30), layer.plan())
    monkeypatch.setenv("KVSQUEEZE_TRITON_PREFILL_DENSE", "yes")
    with pytest.raises(ValueError, match="auto, 1, 0"):
        triton_prefill.dense(query_for(layer, 4, 30), layer.plan())


@pytest.mark.parametrize("spec,pooled", [("k3r-v2.5r-w16", True), ("fp8-e4m3", False), ("k1c16-v8t16-w0-s3", True)])
def test_prefill_formats_stores_and_a_row_that_sees_nothing(td, spec, pooled):
    """Both routes: rotated codebooks (the dense one turns them back from the rotated space after unpacking), fp8,
    1- and 8-bit codes with sinks, over a pool and over separate blocks; a sequence whose mask hides everything
    gives 0."""
    new = 24
    layer = filled_layer(spec, batch=2, kv_heads=2, head_dim=32, stored=130, new=new, steps=2, pooled=pooled,
                         device=TRITON_DEVICE)
    mask = padding_mask(layer, new, [0, 7])
    assert_matches_reference(td.attend, layer, 4, new, mask)
    mask[1] = False
    q = query_for(layer, 4, new)
    assert td.attend(q, layer.plan(), mask, 0.125)[1].abs().max() == 0


def test_small_head_dim_falls_back(td, monkeypatch):
    calls = _routed(td, monkeypatch)
    layer = filled_layer("k4c16-v4t8-w16", batch=1, kv_heads=1, head_dim=8, stored=40, new=20, device=TRITON_DEVICE)
    q = query_for(layer, 1, 20)
    assert torch.equal(td.attend(q, layer.plan(), None, 0.125), reference.attend(q, layer.plan(), None, 0.125))
    assert calls == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("route", ["0", "1"], ids=["tiled", "dense"])
@pytest.mark.parametrize("spec", ["kivi-4", "kivi-2-sink4", "int8"])
def test_prefill_on_gpu(spec, route, monkeypatch):
    from kvsqueeze.kernels import triton_decode, triton_prefill

    monkeypatch.setenv("KVSQUEEZE_TRITON_PREFILL_DENSE", route)
    monkeypatch.setattr(triton_prefill, "BLOCK_M", 32)
    monkeypatch.setattr(triton_prefill, "BLOCK_N", 32)
    layer = filled_layer(spec, batch=2, kv_heads=8, head_dim=128, stored=3000, new=300, steps=2, device="cuda")
    assert_matches_reference(triton_decode.attend, layer, 32, 300, padding_mask(layer, 300, [0, 1000]), atol=1e-4)
