"""Peers are selectable by name, fail clearly when their library is missing, and are charged for every byte."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvsqueeze import QuantizedCache
from kvsqueeze.adapter import cache_kwargs
from kvsqueeze.errors import CacheSpecError, MissingDependencyError, UnknownCacheError
from kvsqueeze.eval import peers
from kvsqueeze.resolve import registered_peers, resolve_kv
from kvsqueeze.spec import CacheSpec


def _fill(model, cache, n, seed=0, chunk=0):
    ids = torch.randint(2, 256, (1, n), generator=torch.Generator().manual_seed(seed))
    peers.prefill(model, ids[:, :-1], cache, chunk)
    with torch.no_grad():
        model(ids[:, -1:], **cache_kwargs(model, cache))  # one decode step: the quanto residual holds 1 token
    return cache


def test_names_resolve_to_caches(tiny_llama):
    import transformers

    assert isinstance(peers.make_cache(tiny_llama, "hf-dynamic"), DynamicCache)
    assert isinstance(peers.make_cache(tiny_llama, "hf-quanto-int2-axis1"), transformers.QuantizedCache)
    assert isinstance(peers.make_cache(tiny_llama, "kivi-2"), QuantizedCache)
    assert isinstance(resolve_kv("k2c32-v2t32-w128-s4"), CacheSpec)
    assert isinstance(peers.make_cache(tiny_llama, "hf-static", max_len=64), transformers.StaticCache)
    with pytest.raises(ValueError, match="hf-static preallocates its length"):  # ppl, bench: no length to size it
        peers.make_cache(tiny_llama, "hf-static")


def test_every_peer_is_registered_with_the_resolver():
    assert list(registered_peers()) == list(peers.PEERS)  # importing kvsqueeze.eval.peers registers them
    for name, peer in peers.PEERS.items():
        if peer.available:
            assert resolve_kv(name) is peer


def test_unknown_name_lists_presets_and_peers():
    with pytest.raises(UnknownCacheError, match=r"unknown cache 'hf-quanto-int8'.*a peer \(hf-dynamic, "):
        resolve_kv("hf-quanto-int8")
    with pytest.raises(CacheSpecError, match="unsupported bits 9"):  # a malformed spec string keeps its message
        resolve_kv("k9t32-v2t32")


def test_missing_optional_peer_library_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(peers, "_importable", lambda module: False)
    with pytest.raises(MissingDependencyError) as err:
        resolve_kv("hf-quanto-int4")
    assert str(err.value) == ("the peer hf-quanto-int4 needs the optional library optimum-quanto, which is not "
                              "installed: pip install 'kvsqueeze[peers]' (or: pip install optimum-quanto)")
    assert resolve_kv("hf-dynamic").backend == "dynamic"  # transformers alone


def test_quanto_bytes_are_counted_from_its_tensors(tiny_llama):
    """int4, axis 0, groups of 64: packed codes (half a byte each), one fp32 scale and one fp32 shift per 64
    elements, and the full-precision residual."""
    cache = _fill(tiny_llama, peers.make_cache(tiny_llama, "hf-quanto-int4"), 129)
    f = peers.footprint(cache)
    layers, heads, dim = 2, 2, 64
    q_elements = 2 * layers * heads * 128 * dim  # K and V of the 128 prefilled tokens
    assert f.quantized_elements == q_elements
    assert f.codes == q_elements // 2
    assert f.params == q_elements // 64 * 2 * 4
    assert f.full_precision == 2 * layers * heads * 1 * dim * 4  # the decoded token, fp32
    assert f.quantized_bits_per_element == pytest.approx(4 + 64 / 64)
    assert f.tokens == 129 and f.elements == 2 * layers * heads * 129 * dim


def test_dynamic_fp8_and_our_cache_bytes(tiny_llama):
    dyn = peers.footprint(_fill(tiny_llama, DynamicCache(config=tiny_llama.config), 40))
    assert dyn.bits_per_element == 32 and dyn.bytes_per_token == 2 * 2 * 2 * 64 * 4
    fp8 = peers.footprint(_fill(tiny_llama, peers.make_cache(tiny_llama, "hf-fp8"), 40))
    assert fp8.codes == fp8.elements and fp8.params == 2 * 2 * 4  # one fp32 scale for K and V per layer
    ours = _fill(tiny_llama, QuantizedCache(tiny_llama.config, "int8"), 40)
    assert peers.footprint(ours).total == ours.nbytes().total


def test_quanto_axis1_prompts_are_split_at_group_boundaries(tiny_llama):
    cache = peers.make_cache(tiny_llama, "hf-quanto-int2-axis1")
    # 2 KV heads: quanto groups 64 rows of the flattened (batch x heads x tokens) axis -> 32-token steps
    assert peers.prefill_pieces(tiny_llama, cache, 100) == [96, 4]
    assert peers.prefill_pieces(tiny_llama, cache, 96) == [96]
    assert peers.prefill_pieces(tiny_llama, peers.make_cache(tiny_llama, "hf-quanto-int2"), 100) == [100]
    _fill(tiny_llama, cache, 101)  # would raise inside quanto if the prompt were not split
    assert cache.get_seq_length() == 101
    with pytest.raises(ValueError, match="at least 32 tokens"):
        peers.prefill_pieces(tiny_llama, cache, 20, chunk=0)
    # chunks are multiples of the alignment too (rounded down, at least one alignment), the remainder last
    assert peers.prefill_pieces(tiny_llama, cache, 100, chunk=40) == [32, 32, 32, 4]
    assert peers.prefill_pieces(tiny_llama, cache, 100, chunk=10) == [32, 32, 32, 4]
    assert peers.prefill_pieces(tiny_llama, cache, 100, chunk=0) == [96, 4]
    cache = _fill(tiny_llama, peers.make_cache(tiny_llama, "hf-quanto-int2-axis1"), 101, chunk=40)
    assert cache.get_seq_length() == 101


def test_prompts_are_split_into_chunks(tiny_llama):
    cache = QuantizedCache(tiny_llama.config, "kivi-2")
    assert peers.prefill_pieces(tiny_llama, cache, 1100) == [512, 512, 76]
    assert peers.prefill_pieces(tiny_llama, cache, 1100, chunk=0) == [1100]
    assert peers.prefill_pieces(tiny_llama, cache, 300, chunk=100) == [100, 100, 100]
    for bad in (-1, 1.5):
        with pytest.raises(ValueError, match="must be 0 .* or a positive number of tokens"):
            peers.prefill_pieces(tiny_llama, cache, 10, chunk=bad)


@pytest.mark.parametrize("kv", ["full", "hf-dynamic"])
def test_chunked_prefill_of_an_exact_cache_equals_one_pass(tiny_llama, kv):
    ids = torch.randint(2, 256, (2, 90), generator=torch.Generator().manual_seed(1))
    one = peers.prefill(tiny_llama, ids, peers.make_cache(tiny_llama, kv), chunk=0)
    chunked = peers.prefill(tiny_llama, ids, peers.make_cache(tiny_llama, kv), chunk=16)
    torch.testing.assert_close(chunked, one, atol=1e-5, rtol=1e-4)
