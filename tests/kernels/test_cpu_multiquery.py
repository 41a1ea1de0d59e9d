"""The C++ kernel's multi-query path (steps of more than ``cpu.MAX_QUERIES`` new tokens: chunked prefill over a
packed history) against the pure-torch reference.

Same tolerance as test_cpu_kernel.py: outputs are O(1), the kernel accumulates in float32 in another order (tiles,
BLAS) with a polynomial exp, so differences stay near 1e-6; we assert atol 5e-5 (2e-2 relative for fp16/bf16
models).  Query and key tiles are shrunk in some tests so that small shapes still span several tiles of both.
"""

from __future__ import annotations

import pytest
import torch

from kvsqueeze.adapter import QuantizedCache, cache_kwargs
from kvsqueeze.kernels import cpu, reference

from ._helpers import (
    assert_half_precision_matches,
    assert_matches_reference,
    filled_layer,
    padding_mask,
    query_for,
)

pytestmark = [pytest.mark.skipif(not cpu.available(), reason="C++ kernel could not be built here"),
              pytest.mark.usefixtures("cpu_isa")]

SPECS = [
    "full", "int8", "int4", "int2", "kivi-4", "kivi-3", "kivi-2", "kivi-2-sink4", "fp8-e4m3", "fp8-e5m2",
    "k1c32-v1t32-w64-s3",  # 1-bit both sides, odd sink count
    "k8t16-v3c16-w32",  # per-token 8-bit keys, per-channel 3-bit values
    "k1t4-v2t2",  # groups smaller than a packing unit, no window
    "k4c16-v8t8-w16-s1",
    "k2t32-v4c64-w64",
    "rot-3", "k2.75r-v2.75r-w64-s3", "k3.25r-v2c32-w32", "k2c32-v3.5r-w32-s1",  # rotated codebooks
    "k3rc32-v2.375rc32-w64-s3", "k2.5rc16-v2c16-w32",  # centred rotated sides (a mean per channel per group)
]


def _no_reference(monkeypatch) -> None:
    """Fail if cpu.attend hands the step to the reference (the multi-query kernel must serve it)."""
    def refuse(*args, **kwargs):
        raise AssertionError("the step went to the reference")
    monkeypatch.setattr(cpu.reference, "attend", refuse)


def _check(layer, q_heads: int, new: int, mask=None, atol: float = 5e-5, monkeypatch=None) -> None:
    q = query_for(layer, q_heads, new)
    ref = reference.attend(q, layer.plan(), mask, 0.125)
    if monkeypatch is not None:
        _no_reference(monkeypatch)
    got = cpu.attend(q, layer.plan(), mask, 0.125)
    if monkeypatch is not None:
        monkeypatch.undo()
    assert got.shape == ref.shape and got.dtype == ref.dtype == q.dtype
    torch.testing.assert_close(got.float(), ref.float(), atol=atol, rtol=0)


@pytest.mark.parametrize("spec", SPECS)
def test_every_format_gqa_batch_padding(spec, monkeypatch):
    # 600 stored tokens: packed blocks, a partial block and the window; 70 new tokens over two query tiles of 64
    layer = filled_layer(spec, batch=2, kv_heads=2, stored=600, new=70, steps=3)
    assert cpu.supports(layer.plan())
    _check(layer, 6, 70, monkeypatch=monkeypatch)  # GQA 3:1, no mask: causal among the new tokens
    _check(layer, 6, 70, padding_mask(layer, 70, [0, 45]), monkeypatch=monkeypatch)


@pytest.mark.parametrize(("q_tile", "k_tile"), [(1, 7), (5, 48), (16, 100), (64, 256), (200, 1000)])
@pytest.mark.parametrize("spec", ["kivi-2-sink4", "k3c32-v3t32-w32-s5", "rot-3"])
def test_tiles_not_dividing_queries_or_blocks(spec, q_tile, k_tile, monkeypatch):
    monkeypatch.setattr(cpu, "Q_TILE", q_tile)
    monkeypatch.setattr(cpu, "K_TILE", k_tile)
    layer = filled_layer(spec, batch=2, kv_heads=1, stored=530, new=41, steps=2)
    _check(layer, 4, 41)
    _check(layer, 4, 41, padding_mask(layer, 41, [3, 300]))


@pytest.mark.parametrize("stored", [1, 31, 127, 128, 129, 255, 256, 257, 385, 700])
@pytest.mark.parametrize("spec", ["kivi-2-sink4", "int4", "k3c32-v3t32-w32-s5"])
def test_window_sink_and_block_boundaries(spec, stored, monkeypatch):
    layer = filled_layer(spec, batch=1, kv_heads=1, stored=stored, new=cpu.MAX_QUERIES + 1, steps=min(stored, 3))
    _check(layer, 4, cpu.MAX_QUERIES + 1, monkeypatch=monkeypatch)  # the shortest step this path serves


@pytest.mark.parametrize("head_dim", [32, 40, 128])
@pytest.mark.parametrize("spec", ["full", "k4c32-v4t8-w32", "k8t8-v2t8", "fp8-e4m3", "k1c32-v1t8"])
def test_head_dims(spec, head_dim):
    layer = filled_layer(spec, batch=1, kv_heads=2, head_dim=head_dim, stored=300, new=33)
    _check(layer, 2, 33)  # no GQA


@pytest.mark.parametrize("head_dim", [16, 32, 128])  # rotated formats need a power-of-two head_dim
def test_rotated_head_dims(head_dim):
    layer = filled_layer("k2.5r-v3r-w32-s2", batch=1, kv_heads=2, head_dim=head_dim, stored=300, new=33)
    _check(layer, 2, 33)


def test_float_mask_and_fully_masked_rows():
    layer = filled_layer("kivi-4", batch=2, kv_heads=2, stored=400, new=40)
    bool_mask = padding_mask(layer, 40, [0, 10])
    bool_mask[1] = False  # sequence 1 sees nothing: its rows must come out 0
    bool_mask[0, :, 3] = False  # and one query row of sequence 0
    assert_matches_reference(cpu.attend, layer, 4, 40, bool_mask)
    q = query_for(layer, 4, 40)
    out = cpu.attend(q, layer.plan(), bool_mask, 0.125)
    assert out[1].abs().max() == 0 and out[0, :, 3].abs().max() == 0
    float_mask = torch.zeros(bool_mask.shape).masked_fill(~padding_mask(layer, 40, [0, 10]), float("-inf"))
    float_mask[0, ..., 5:9] += 0.7  # a real additive bias, inside one tile
    float_mask[1, ..., 200:] -= 0.3
    assert_matches_reference(cpu.attend, layer, 4, 40, float_mask)


def test_broadcast_mask_batch_dim():
    layer = filled_layer("int4", batch=3, kv_heads=1, stored=300, new=20)
    assert_matches_reference(cpu.attend, layer, 2, 20, padding_mask(layer, 20, [17]))


@pytest.mark.parametrize("spec", ["full", "kivi-2", "k4c32-v4t32-w32"])
def test_sliding_window_layer_after_eviction(spec, monkeypatch):
    window, new = 96, 50
    layer = filled_layer(spec, batch=1, kv_heads=2, stored=900, new=new, steps=40, sliding=window)
    assert layer.first_visible > 0  # blocks were evicted
    kv_len = layer.n_total - layer.first_visible + new
    qpos = (layer.n_total + torch.arange(new))[:, None]
    cols = (torch.arange(kv_len) + layer.first_visible)[None, :]
    mask = ((cols > qpos - window) & (cols <= qpos))[None, None]
    _check(layer, 4, new, mask, monkeypatch=monkeypatch)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("spec", ["full", "kivi-4", "fp8-e5m2"])
def test_half_precision_models(spec, dtype):
    assert_half_precision_matches(cpu.attend, spec, dtype, new=24)


def test_calibrated_formats_still_use_the_reference():
    layer = filled_layer("k2rq-v2r", batch=1, kv_heads=1, stored=200, new=30)  # residual sign sketch
    assert not cpu.supports(layer.plan())
    q = query_for(layer, 2, 30)
    assert torch.equal(cpu.attend(q, layer.plan(), None, 0.125), reference.attend(q, layer.plan(), None, 0.125))


# ---------------------------------------------------------------------------------------------- chunked prefill
def _chunked_logits(model, spec: str, backend: str, ids, mask, chunk: int) -> torch.Tensor:
    """Logits of every position, the prompt fed ``chunk`` tokens at a time into one QuantizedCache."""
    cache = QuantizedCache(model.config, spec, backend=backend)
    out = []
    with torch.no_grad():
        for s in range(0, ids.shape[1], chunk):
            m = None if mask is None else mask[:, :s + chunk]
            out.append(model(input_ids=ids[:, s:s + chunk], attention_mask=m, **cache_kwargs(model, cache),
                             use_cache=True).logits)
    return torch.cat(out, dim=1)


@pytest.mark.parametrize("spec", ["kivi-2-sink4", "int4", "full", "rot-3"])
def test_chunked_prefill_matches_reference_tiny_llama(tiny_llama, spec, monkeypatch):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(2, 256, (1, 400), generator=g)  # chunks of 100 over a history packed past the window
    ref = _chunked_logits(tiny_llama, spec, "torch", ids, None, 100)
    _no_reference(monkeypatch)  # every chunk after the first must go through the multi-query kernel
    got = _chunked_logits(tiny_llama, spec, "cpu", ids, None, 100)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("spec", ["kivi-4", "int8"])
def test_chunked_prefill_matches_reference_mixed_sliding_batch(tiny_mixed_sliding, spec):
    g = torch.Generator().manual_seed(6)
    ids = torch.randint(2, 256, (2, 300), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :37] = 1  # left padding in the second sequence
    mask[1, :37] = 0
    ref = _chunked_logits(tiny_mixed_sliding, spec, "torch", ids, mask, 64)
    got = _chunked_logits(tiny_mixed_sliding, spec, "cpu", ids, mask, 64)
    torch.testing.assert_close(got[:, 37:], ref[:, 37:], atol=1e-4, rtol=1e-4)  # padded positions are undefined
    torch.testing.assert_close(got[0], ref[0], atol=1e-4, rtol=1e-4)


@pytest.mark.default_isa
def test_chunked_prefill_matches_reference_embedded(embedded):
    """The real model, 700 tokens in chunks of 256.  Unquantized storage: logits agree to float32 noise (measured
    max 5e-5).  kivi-2: a 1e-6 difference in one layer's output moves a few of the next layers' inputs across a
    2-bit rounding boundary, and each such code moves one value by a whole quantization step, so a few logits
    differ by up to ~1e-2 (measured max 6.6e-3, mean 6e-5); a wrong mask or tile would move them by O(1)."""
    model, _ = embedded
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(100, 40000, (1, 700), generator=g)
    ref = _chunked_logits(model, "full", "torch", ids, None, 256)
    got = _chunked_logits(model, "full", "cpu", ids, None, 256)
    torch.testing.assert_close(got, ref, atol=5e-4, rtol=0)
    ref = _chunked_logits(model, "kivi-2", "torch", ids, None, 256)
    got = _chunked_logits(model, "kivi-2", "cpu", ids, None, 256)
    diff = (got - ref).abs()
    assert diff.max() < 5e-2 and diff.mean() < 5e-4
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.99
