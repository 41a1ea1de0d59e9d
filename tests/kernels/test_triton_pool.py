"""Blocks kept in one pool per part (cache/pool.py) and the Triton kernels that walk it through the block table.

The pool must hold exactly what separate blocks hold (every edit: growth, rollback, crop, eviction, batch
re-indexing, copies), and the Triton decode and prefill must read the whole stored history in one launch and agree
with the reference (under TRITON_INTERPRET=1 here: small blocks, so a few hundred tokens span many slots).
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from kvsqueeze.kernels import reference
from kvsqueeze.spec import preset

from ._helpers import (
    HAS_TRITON,
    TRITON_DEVICE,
    assert_matches_reference,
    filled_layer,
    padding_mask,
    query_for,
    require_triton_runtime,
)


def small_blocks(spec: str, tokens: int = 32):
    return dataclasses.replace(preset(spec), block_tokens=tokens)


def _pool_layer(spec: str, stored: int, **kw):
    return filled_layer(small_blocks(spec), batch=2, kv_heads=2, head_dim=32, stored=stored, pooled=True,
                        device=TRITON_DEVICE, **kw)


def _twin_outputs_equal(a, b, q_heads: int = 4, new: int = 1) -> None:
    q = query_for(a, q_heads, new)
    torch.testing.assert_close(reference.attend(q, a.plan(), None, 0.125), reference.attend(q, b.plan(), None, 0.125),
                               atol=0, rtol=0)


def _check_table(layer) -> None:
    """Every block's parts are views of its slot, and the table sends its index there."""
    store = layer.store
    pool = store.pool
    table = pool.table.cpu()
    for blk in store.blocks:
        assert int(table[blk.start // store.block_tokens]) == blk.slot
        for key, t in blk.parts.items():
            assert t.data_ptr() == pool.tensors[key][blk.slot].data_ptr()
    slots = [blk.slot for blk in store.blocks]
    assert len(set(slots)) == len(slots) and not set(slots) & set(pool.free)


def test_pool_holds_what_separate_blocks_hold_through_growth_and_edits():
    kw = dict(batch=2, kv_heads=2, head_dim=32, stored=300, steps=40)
    pooled = filled_layer(small_blocks("kivi-2-sink4"), pooled=True, **kw)
    plain = filled_layer(small_blocks("kivi-2-sink4"), pooled=False, **kw)
    assert plain.store.pool is None and pooled.store.pool.slots > 4  # grew from 4 slots
    assert pooled.store.pool.generation > 0
    _check_table(pooled)
    _twin_outputs_equal(pooled, plain)
    run = pooled.plan().pool
    assert run.n_tokens == pooled.n_history and run.start == pooled.n_sinks
    # a step rolled back: its new block gives its slot back
    for lay in (pooled, plain):
        lay.commit()
        state = lay.checkpoint()
        lay.stage(torch.randn(2, 2, 70, 32), torch.randn(2, 2, 70, 32))
        lay.commit()
        lay.restore(state)
        lay.stage(torch.ones(2, 2, 1, 32), torch.ones(2, 2, 1, 32))
    _check_table(pooled)
    _twin_outputs_equal(pooled, plain)
    # crop into the history, batch re-indexing, a deep copy
    for lay in (pooled, plain):
        lay.crop(150)
        lay.map_batch(lambda t: t.index_select(0, torch.tensor([1, 0, 1])))
        lay.stage(torch.ones(3, 2, 1, 32), torch.ones(3, 2, 1, 32))
    _check_table(pooled)
    assert pooled.store.pool.batch == 3
    _twin_outputs_equal(pooled, plain)
    twin = copy.deepcopy(pooled)
    _check_table(twin)
    assert twin.store.pool.tensors["k.codes"].data_ptr() != pooled.store.pool.tensors["k.codes"].data_ptr()
    _twin_outputs_equal(twin, plain)


def test_sliding_layer_evicts_by_moving_where_the_walk_starts():
    kw = dict(batch=1, kv_heads=2, head_dim=32, stored=400, steps=30, sliding=100)
    pooled = filled_layer(small_blocks("kivi-4"), pooled=True, **kw)
    plain = filled_layer(small_blocks("kivi-4"), pooled=False, **kw)
    run = pooled.plan().pool
    assert run.first > 0 and run.first == pooled.store.begin and run.n_tokens < 200
    assert len(pooled.store.pool.owners) == len(pooled.store.blocks)  # evicted blocks gave their slots back
    _check_table(pooled)
    _twin_outputs_equal(pooled, plain)


# ------------------------------------------------------------------------------------------------- Triton
@pytest.fixture
def td(monkeypatch):
    """triton_decode, interpreting on CPU unless a GPU is present, with small chunks; records its launches."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    from kvsqueeze.kernels import triton_decode

    require_triton_runtime()
    monkeypatch.setattr(triton_decode, "CHUNK", 64)
    monkeypatch.setattr(triton_decode, "BLOCK_T", 32)
    launches = []
    kernel = triton_decode._partials_kernel

    class Recorder:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    monkeypatch.setattr(triton_decode, "_partials_kernel", Recorder())
    monkeypatch.setattr(triton_decode, "launches", launches, raising=False)
    return triton_decode


@pytest.mark.parametrize("spec,new,masked", [("kivi-4", 1, False), ("kivi-2-sink4", 1, True),
                                             ("k8t16-v4c16-w16", 2, True), ("k4t32-v2t16-w8-s2", 3, False),
                                             ("full", 1, False)])
def test_pooled_decode_reads_the_history_in_one_launch(td, spec, new, masked):
    layer = _pool_layer(spec, stored=330, steps=3, new=new)
    plan = layer.plan()
    assert plan.pool is not None and plan.pool.n_tokens > 3 * plan.pool.block_tokens
    mask = padding_mask(layer, new, [0, 37]) if masked else None
    assert_matches_reference(td.attend, layer, 4, new, mask)
    # the stored history: one launch whatever the number of blocks (the full-precision tokens go to the finishing
    # launch that merges the partials)
    assert td.launches == [(2 * 2, -(-plan.pool.n_tokens // td.CHUNK))]


def test_long_chunks_when_the_batch_fills_the_gpu(td, monkeypatch):
    """Past TARGET_PROGRAMS programs the chunks grow (fewer partials): one chunk per (sequence, kv head) here."""
    monkeypatch.setattr(td, "TARGET_PROGRAMS", 4)
    layer = _pool_layer("kivi-4", stored=330, steps=3)
    assert_matches_reference(td.attend, layer, 4, 1, padding_mask(layer, 1, [0, 37]))
    assert td.launches == [(2 * 2, 1)]


def test_pooled_decode_after_eviction_and_in_half_precision(td):
    layer = filled_layer(small_blocks("kivi-4"), batch=1, kv_heads=2, head_dim=32, stored=300, steps=5,
                         sliding=90, pooled=True, device=TRITON_DEVICE, dtype=torch.float16)
    assert layer.plan().pool.first > 0
    q = query_for(layer, 4, 1)
    ref = reference.attend(q, layer.plan(), None, 0.125)
    got = td.attend(q, layer.plan(), None, 0.125)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), ref.float(), atol=2e-3, rtol=0)


def test_pooled_prefill_matches_reference(monkeypatch):
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    from kvsqueeze.kernels import triton_decode, triton_prefill

    require_triton_runtime()
    monkeypatch.setattr(triton_prefill, "BLOCK_M", 32)
    monkeypatch.setattr(triton_prefill, "BLOCK_N", 32)
    layer = _pool_layer("kivi-2-sink4", stored=200, new=20)
    assert triton_decode.path(query_for(layer, 4, 20), layer.plan()) == "triton-prefill"
    assert_matches_reference(triton_decode.attend, layer, 4, 20, padding_mask(layer, 20, [3, 0]))


@pytest.mark.parametrize("spec", ["kivi-2-sink4", "k8t16-v4c16-w16", "k3t32-v4t32-w8-s1"])
def test_pack_writes_straight_into_the_pool_bit_for_bit(monkeypatch, spec):
    """The Triton quantize-and-pack writes a pooled store's new tokens into their slots (no parts tensors, no
    copy): every stored byte equals the torch encoder's in separate blocks, across block and pool growth."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    require_triton_runtime()
    from kvsqueeze.adapter import fast_encoder
    from kvsqueeze.kernels import triton_pack

    monkeypatch.setenv("KVSQUEEZE_TRITON_ENCODE", "1")
    calls = []
    real = triton_pack.encode
    monkeypatch.setattr(triton_pack, "encode", lambda fmt, x, into=None: calls.append(into) or real(fmt, x, into))
    kw = dict(batch=2, kv_heads=2, head_dim=32, stored=300, steps=40, device=TRITON_DEVICE)
    pooled = filled_layer(small_blocks(spec), pooled=True, fast_encode=fast_encoder, **kw)
    plain = filled_layer(small_blocks(spec), pooled=False, **kw)
    assert calls and all(c is not None for c in calls)  # every append went into the pool
    assert pooled.store.pool.generation > 0
    _check_table(pooled)
    for a, b in zip(pooled.store.blocks, plain.store.blocks):
        assert a.used == b.used and a.start == b.start
        for key, t in b.parts.items():
            rows = a.used // dict(pooled.store._layouts())[key].tokens_per_row
            assert torch.equal(a.parts[key][:, :, :rows], t[:, :, :rows]), key
    _twin_outputs_equal(pooled, plain)


def test_generation_through_the_pool_matches_the_reference(tiny_mixed_sliding, monkeypatch):
    """A model (sliding and full layers, left padding) generating with backend="triton": its caches keep pools, the
    packer writes into them and the prefill and decode read them; the tokens equal the reference backend's."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    require_triton_runtime()
    from kvsqueeze.adapter import QuantizedCache, cache_kwargs
    from kvsqueeze.kernels import triton_decode

    monkeypatch.setenv("KVSQUEEZE_TRITON_ENCODE", "1")
    monkeypatch.setattr(triton_decode, "CHUNK", 64)
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(2, 256, (2, 150), generator=g)  # past the 128-token window: history is packed
    mask = torch.ones_like(ids)
    ids[1, :9], mask[1, :9] = 1, 0  # left padding in the second sequence
    spec = dataclasses.replace(preset("kivi-2-sink4"), block_tokens=128)
    model = copy.deepcopy(tiny_mixed_sliding).to(TRITON_DEVICE)  # on the GPU where there is one (no interpreter)
    ids, mask = ids.to(TRITON_DEVICE), mask.to(TRITON_DEVICE)
    out = {}
    for backend in ("torch", "triton"):
        cache = QuantizedCache(model.config, spec, backend=backend)
        with torch.no_grad():
            out[backend] = model.generate(ids, attention_mask=mask, **cache_kwargs(model, cache), max_new_tokens=6,
                                          do_sample=False, pad_token_id=1)
        stores = [layer.kv.store for layer in cache.layers]
        # the Triton backend always pools; on a GPU every cache does (cache/layer.py), on a CPU only Triton's
        assert all((s.pool is not None) == (backend == "triton" or ids.device.type != "cpu") for s in stores)
    assert out["triton"].tolist() == out["torch"].tolist()
