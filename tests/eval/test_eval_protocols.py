"""The perplexity protocols agree where they must, and none of them lets a query see the future."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kvsqueeze import QuantizedCache
from kvsqueeze.cache.emulate import fake_quantize_cache
from kvsqueeze.eval import protocols as P
from kvsqueeze.eval.ppl import run_ppl
from kvsqueeze.spec import CacheSpec, QuantSpec

# KIVI layout scaled down to the tiny models: 2-bit keys per channel over 8-token groups, values per token,
# a 16-token full-precision window and 3 sinks, so short texts exercise every region of the cache
SMALL_KIVI = CacheSpec(key=QuantSpec(bits=2, axis="channel", group=8), value=QuantSpec(bits=2, axis="token", group=32),
                       window=16, sinks=3, block_tokens=32, name="small-kivi-2")


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(2, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return abs(math.exp(float(a.mean())) / math.exp(float(b.mean())) - 1)


@pytest.mark.parametrize("prefix,prefill_chunk", [(0, 0), (30, 0), (50, 24), (50, 16)])
def test_window_equals_decode_through_the_real_cache(tiny_llama, prefix, prefill_chunk):
    """Also with a chunked prefill of the prefix: chunks after the first see the earlier ones as stored."""
    ids = _ids(72)
    window = P.nll_window(tiny_llama, ids, SMALL_KIVI, prefix, prefill_chunk)
    decode = P.nll_decode(tiny_llama, ids, QuantizedCache(tiny_llama.config, SMALL_KIVI), prefix, prefill_chunk)
    assert window.shape == decode.shape == (72 - max(prefix, 1),)
    assert _rel(window, decode) < 1e-3
    torch.testing.assert_close(window, decode, atol=1e-3, rtol=0)
    # and the quantization is really there: the same text at full precision scores differently
    assert (window - P.nll_reference(tiny_llama, ids, prefix)).abs().max() > 1e-3


def test_a_chunked_prefill_is_seen_by_the_prefix_queries(tiny_llama):
    """A prefill chunk after the first attends over quantized history (16-token window, groups of 8), so the K/V
    it leaves in deeper layers, and every score after it, differ from a one-pass prefill's."""
    ids = _ids(72)
    one = P.nll_decode(tiny_llama, ids, QuantizedCache(tiny_llama.config, SMALL_KIVI), 50, 0)
    chunked = P.nll_decode(tiny_llama, ids, QuantizedCache(tiny_llama.config, SMALL_KIVI), 50, 24)
    assert (one - chunked).abs().max() > 1e-4
    assert P.committed_tokens(8, 5, 2) == [0, 0, 2, 2, 4, 5, 6, 7]
    assert P.committed_tokens(8, 5, 0) == [0, 0, 0, 0, 0, 5, 6, 7]


def test_window_equals_decode_with_sliding_layers(tiny_mixed_sliding):
    spec = dataclasses.replace(SMALL_KIVI, window=8, quantize_sliding=True)
    ids = _ids(60, seed=1)
    window = P.nll_window(tiny_mixed_sliding, ids, spec, 20)
    decode = P.nll_decode(tiny_mixed_sliding, ids, QuantizedCache(tiny_mixed_sliding.config, spec), 20)
    torch.testing.assert_close(window, decode, atol=1e-3, rtol=0)


def test_full_preset_equals_transformers_loss(tiny_llama):
    chunks = _ids(2 * 64, seed=2).view(2, 64)
    with torch.no_grad():
        losses = [tiny_llama(c[None], labels=c[None]).loss for c in chunks]  # mean NLL of targets 1..63
    expected = math.exp(float(torch.stack(losses).mean()))
    for protocol in ("window", "all-quantized"):
        r = run_ppl(tiny_llama, chunks, "full", protocol)
        assert r["tokens_scored"] == 2 * 63
        assert r["ppl"] == pytest.approx(expected, rel=1e-5)
    r = run_ppl(tiny_llama, chunks, "hf-dynamic", "decode", prefix=50)
    with torch.no_grad():
        tail = torch.cat([torch.nn.functional.cross_entropy(tiny_llama(c[None]).logits[0, 49:-1], c[50:],
                                                            reduction="none") for c in chunks])
    assert r["ppl"] == pytest.approx(math.exp(float(tail.mean())), rel=1e-5)


@pytest.mark.parametrize("protocol", ["window", "all-quantized"])
def test_no_query_sees_the_future(tiny_llama, protocol):
    """Two texts sharing their first 40 tokens get identical scores for targets 1..39, although the
    all-quantized protocol quantizes per-channel key groups that straddle position 40."""
    a, b = _ids(72, seed=3), _ids(72, seed=4)
    b[:, :40] = a[:, :40]
    spec = dataclasses.replace(SMALL_KIVI, key=QuantSpec(bits=2, axis="channel", group=16))
    score = (lambda x: P.nll_window(tiny_llama, x, spec)) if protocol == "window" else (
        lambda x: P.nll_all_quantized(tiny_llama, x, spec))
    na, nb = score(a), score(b)
    torch.testing.assert_close(na[:39], nb[:39], atol=1e-6, rtol=0)  # targets 1..39: positions 0..39 only
    assert (na[40:] - nb[40:]).abs().max() > 1e-3


def _brute_force_all_quantized(q, k, v, spec, scaling):
    """Query by query: complete groups before the query's group quantized whole, its own group quantized from
    its tokens up to the query; every token, the query's included, quantized."""
    g = spec.flush_tokens
    out = torch.empty_like(q)
    rep = q.shape[1] // k.shape[1]
    for t in range(q.shape[2]):
        g0 = t // g * g
        kh, vh = fake_quantize_cache(k[:, :, :g0], v[:, :, :g0], spec) if g0 else (k[:, :, :0], v[:, :, :0])
        part = CacheSpec(key=dataclasses.replace(spec.key, group=t - g0 + 1), value=spec.value,
                         block_tokens=t - g0 + 1)
        ko, vo = fake_quantize_cache(k[:, :, g0:t + 1], v[:, :, g0:t + 1], part)
        kk = torch.cat([kh, ko], 2).repeat_interleave(rep, 1)
        vv = torch.cat([vh, vo], 2).repeat_interleave(rep, 1)
        p = torch.softmax(q[:, :, t:t + 1] @ kk.transpose(-1, -2) * scaling, -1)
        out[:, :, t:t + 1] = p @ vv
    return out


@pytest.mark.parametrize("key", [
    QuantSpec(bits=3, axis="channel", group=8),  # range-based parameters: the one-pass path
    QuantSpec(bits=1, axis="channel", group=8, symmetric=True),  # mean-based 1-bit: the per-prefix-length path
])
def test_all_quantized_attention_matches_a_query_by_query_reference(key):
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 40, 64), torch.randn(1, 2, 40, 64), torch.randn(1, 2, 40, 64)
    spec = CacheSpec(key=key, value=QuantSpec(bits=3, axis="token", group=16))
    got = P.all_quantized_attend(q, k, v, None, 0.125, spec)
    torch.testing.assert_close(got, _brute_force_all_quantized(q, k, v, spec, 0.125), atol=1e-5, rtol=1e-5)

def test_all_quantized_per_token_layouts_are_plain_attention_over_quantized_kv():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 40, 64), torch.randn(1, 2, 40, 64), torch.randn(1, 2, 40, 64)
    per_token = CacheSpec(key=QuantSpec(bits=4, group=32), value=QuantSpec(bits=4, group=32))
    kh, vh = fake_quantize_cache(k, v, per_token)
    expected = torch.nn.functional.scaled_dot_product_attention(q, kh, vh, is_causal=True, scale=0.125,
                                                                enable_gqa=True)
    torch.testing.assert_close(P.all_quantized_attend(q, k, v, None, 0.125, per_token), expected,
                               atol=1e-5, rtol=1e-5)


def test_protocol_note_and_prefix_checks(tiny_llama):
    assert "partial group quantized causally" in P.protocol_note("all-quantized", SMALL_KIVI)
    with pytest.raises(ValueError, match="prefix must be in"):
        P.nll_window(tiny_llama, _ids(10), SMALL_KIVI, prefix=9)
    with pytest.raises(ValueError, match="only be measured with --protocol decode"):
        run_ppl(tiny_llama, _ids(20).view(1, 20), "hf-dynamic", "window")
