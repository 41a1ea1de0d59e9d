"""The quantized cache inside transformers: exactness where it must be exact, bounded error elsewhere,
beam search, crop, padding, sliding layers, accounting and bad input."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from kvsqueeze import QuantizedCache, preset
from kvsqueeze.adapter import cache_kwargs
from kvsqueeze.cache.emulate import fake_quantize_cache
from kvsqueeze.kernels import reference
from kvsqueeze.spec import CacheSpec, QuantSpec

SMALL_KIVI = CacheSpec(key=QuantSpec(bits=2, axis="channel", group=8), value=QuantSpec(bits=2, axis="token", group=32),
                       window=16, sinks=3, block_tokens=32, name="small-kivi-2")


def _ids(n, batch=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 256, (batch, n), generator=g)


def _decode(model, ids, cache, prefix):
    """Prefill ``prefix`` tokens, then feed the rest one at a time; return all logits [B, T, V]."""
    with torch.no_grad():
        out = [model(ids[:, :prefix], **cache_kwargs(model, cache)).logits]
        for t in range(prefix, ids.shape[1]):
            out.append(model(ids[:, t:t + 1], **cache_kwargs(model, cache)).logits)
    return torch.cat(out, dim=1)


def test_full_preset_is_exact(tiny_llama):
    ids = _ids(120)
    with torch.no_grad():
        ref = tiny_llama(ids).logits
    got = _decode(tiny_llama, ids, QuantizedCache(tiny_llama.config, "full"), 50)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["int8", "int4", "kivi-4", "kivi-2-sink4", "fp8-e4m3", "fp8-e5m2"])
def test_prompt_logits_are_exact_and_decode_error_is_bounded(tiny_llama, name):
    ids = _ids(230)
    with torch.no_grad():
        ref = tiny_llama(ids).logits
    cache = QuantizedCache(tiny_llama.config, name)
    got = _decode(tiny_llama, ids, cache, 200)
    # the prompt attends to its own exact K/V
    torch.testing.assert_close(got[:, :200], ref[:, :200], atol=2e-5, rtol=1e-4)
    err = (got[:, 200:] - ref[:, 200:]).abs().max().item()
    assert 0 < err < {"int8": 0.02, "fp8-e4m3": 0.05, "fp8-e5m2": 0.1}.get(name, 0.5)
    assert cache.get_seq_length() == 230


@pytest.mark.parametrize("chunks", [[1] * 150, [40, 1, 1, 70, 38], [150]])
def test_cache_stores_what_emulation_predicts(chunks):
    """However tokens arrive, the layer quantizes exactly spec.quantized_count of them, with the values the
    one-pass emulation computes (what the `window` perplexity protocol relies on)."""
    from kvsqueeze.cache.layer import LayerKV

    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 2, 150, 64, generator=g), torch.randn(1, 2, 150, 64, generator=g)
    layer, pos = LayerKV(SMALL_KIVI), 0
    for n in chunks:
        layer.stage(k[:, :, pos:pos + n], v[:, :, pos:pos + n])
        layer.commit()
        pos += n
    assert layer.n_history == SMALL_KIVI.quantized_count(150) == 128
    ks, vs = zip(*[(sk.float(), sv.float()) for _, sk, sv, _ in layer.plan().decoded()])
    k_hat, v_hat = fake_quantize_cache(k, v, SMALL_KIVI)
    s, n = SMALL_KIVI.sinks, layer.n_history
    assert torch.equal(torch.cat(ks, 2)[:, :, s:s + n], k_hat[:, :, s:s + n])
    assert torch.equal(torch.cat(vs, 2)[:, :, s:s + n], v_hat[:, :, s:s + n])
    assert torch.equal(torch.cat(ks, 2)[:, :, :s], k[:, :, :s])
    assert torch.equal(torch.cat(vs, 2)[:, :, s + n:], v[:, :, s + n:])


def test_each_token_quantized_once(tiny_llama, monkeypatch):
    """Append-only: every quantized token passes through the encoder exactly once."""
    from kvsqueeze.cache.blocks import BlockStore

    encoded = []
    orig = BlockStore.append

    def spy(self, k, v, base=0):
        encoded.append(k.shape[2])
        return orig(self, k, v, base)

    monkeypatch.setattr(BlockStore, "append", spy)
    cache = QuantizedCache(tiny_llama.config, SMALL_KIVI)
    _decode(tiny_llama, _ids(130), cache, 70)
    layers = len(cache.layers)
    assert sum(encoded) == layers * cache.layers[0].kv.n_history
    assert all(n % SMALL_KIVI.flush_tokens == 0 for n in encoded)


def test_attention_reads_history_one_block_at_a_time(tiny_llama, monkeypatch):
    """No decode step materialises more than one block of dequantized history."""
    from kvsqueeze.cache import codecs

    seen = []
    for cls in (codecs.IntChannelCodec, codecs.IntTokenCodec):
        orig = cls.decode

        def spy(self, parts, start=0, shared=None, _orig=orig):
            out = _orig(self, parts, start, shared)
            seen.append(out.shape[2])
            return out

        monkeypatch.setattr(cls, "decode", spy)
    cache = QuantizedCache(tiny_llama.config, SMALL_KIVI, backend="torch")  # the reference reads via decode()
    _decode(tiny_llama, _ids(400), cache, 300)
    assert cache.layers[0].kv.n_history > 8 * SMALL_KIVI.block_tokens
    assert seen and max(seen) <= SMALL_KIVI.block_tokens


def test_generate_full_preset_matches_dynamic_cache(tiny_llama):
    ids = _ids(40)
    with torch.no_grad():
        ref = tiny_llama.generate(ids, max_new_tokens=32, do_sample=False)
        got = tiny_llama.generate(ids, max_new_tokens=32, do_sample=False,
                                  **cache_kwargs(tiny_llama, QuantizedCache(tiny_llama.config, "full")))
    assert got.tolist() == ref.tolist()


def test_embedded_int8_generates_the_same_tokens_as_dynamic_cache(embedded):
    """The int8 preset (no window: every token quantized) on the real model: same 64 greedy tokens as
    transformers' DynamicCache, and every logit within 0.5 of the reference (mean error below 0.06: the int8 codes'
    own error, which the pure-torch reference attention over the same codes measures at 0.053)."""
    model, tok = embedded
    text = ("The history of the city begins with a small fishing village on the northern bank of the river. "
            "Over the following centuries it grew into a trading port, and by the eighteenth century")
    ids = tok(text, return_tensors="pt").input_ids
    kw = dict(max_new_tokens=64, do_sample=False, output_scores=True, return_dict_in_generate=True,
              pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        ref = model.generate(ids, **kw)
        got = model.generate(ids, **cache_kwargs(model, QuantizedCache(model.config, "int8")), **kw)
    assert got.sequences.tolist() == ref.sequences.tolist()
    diffs = torch.stack([(a - b).abs() for a, b in zip(got.scores, ref.scores)])
    assert diffs.max() < 0.5 and diffs.mean() < 0.06


def test_beam_search_full_preset_matches_dynamic(tiny_llama):
    ids = _ids(24)
    kw = dict(max_new_tokens=12, num_beams=3, do_sample=False, num_return_sequences=2)
    with torch.no_grad():
        ref = tiny_llama.generate(ids, **kw)
        got = tiny_llama.generate(ids, **cache_kwargs(tiny_llama, QuantizedCache(tiny_llama.config, "full")), **kw)
    assert got.tolist() == ref.tolist()


def test_beam_search_quantized_runs_and_reorders(tiny_llama):
    ids = _ids(60)
    cache = QuantizedCache(tiny_llama.config, SMALL_KIVI)
    with torch.no_grad():
        out = tiny_llama.generate(ids, **cache_kwargs(tiny_llama, cache), max_new_tokens=40, num_beams=3, do_sample=False)
    assert out.shape == (1, 100)
    assert cache.layers[0].kv.shape[0] == 3 and cache.layers[0].kv.n_history > 0


def test_batch_with_left_padding_matches_unpadded_rows(tiny_llama):
    """Row 0 is left-padded; its logits must equal an unpadded run of the same tokens (full preset), and the
    quantized cache must run the same padded batch without error."""
    a, b = _ids(20, seed=1)[0], _ids(28, seed=2)[0]
    pad = torch.ones(8, dtype=torch.long)
    ids = torch.stack([torch.cat([pad, a]), b])
    mask = torch.stack([torch.cat([torch.zeros(8), torch.ones(20)]), torch.ones(28)]).long()
    with torch.no_grad():
        ref_a = tiny_llama.generate(a[None], max_new_tokens=10, do_sample=False)[0, 20:]
        got = tiny_llama.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                                  **cache_kwargs(tiny_llama, QuantizedCache(tiny_llama.config, "full")))
        tiny_llama.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                            **cache_kwargs(tiny_llama, QuantizedCache(tiny_llama.config, SMALL_KIVI)))
    assert got[0, 28:].tolist() == ref_a.tolist()


@pytest.mark.parametrize("remove", [3, 20, 60, 130])
def test_crop(tiny_llama, remove):
    """Cropping then re-feeding the same tokens gives the cache the same length; inside the window and
    sinks the result is exact."""
    ids = _ids(150)
    cache = QuantizedCache(tiny_llama.config, SMALL_KIVI)
    _decode(tiny_llama, ids, cache, 100)
    cache.crop(-remove)
    assert cache.get_seq_length() == 150 - remove
    with torch.no_grad():
        tiny_llama(ids[:, 150 - remove:], **cache_kwargs(tiny_llama, cache))
    assert cache.get_seq_length() == 150
    if remove <= SMALL_KIVI.window:
        full = QuantizedCache(tiny_llama.config, SMALL_KIVI)
        _decode(tiny_llama, ids, full, 100)
        nb1, nb2 = cache.nbytes(), full.nbytes()
        assert nb1.elements == nb2.elements


def test_mixed_sliding_and_full_layers(tiny_mixed_sliding):
    """Sliding layers keep their window (evicting whole blocks), full layers quantize; the full preset is exact
    against the model's own DynamicCache."""
    model = tiny_mixed_sliding
    ids = _ids(200)
    ref = _decode(model, ids, DynamicCache(config=model.config), 60)
    got = _decode(model, ids, QuantizedCache(model.config, CacheSpec(block_tokens=16, name="full16")), 60)
    torch.testing.assert_close(got, ref, atol=3e-5, rtol=1e-4)
    cache = QuantizedCache(model.config, SMALL_KIVI)
    q = _decode(model, ids, cache, 60)
    assert (q[:, :60] - ref[:, :60]).abs().max() < 3e-5
    sliding, full = cache.layers[0].kv, cache.layers[1].kv
    assert sliding.sliding_window == 16 and sliding.n_total == 200
    assert sliding.n_history + sliding.window.length <= 16 + 2 * SMALL_KIVI.block_tokens
    assert full.n_history > 0 and sliding.spec.key.fmt == "none"
    qs = QuantizedCache(model.config, CacheSpec(key=SMALL_KIVI.key, value=SMALL_KIVI.value, window=16,
                                                quantize_sliding=True, block_tokens=32))
    _decode(model, ids, qs, 60)
    assert qs.layers[0].kv.spec.key.quantized


def test_nbytes_equals_the_arithmetic(tiny_llama):
    spec = preset("kivi-2")
    cache = QuantizedCache(tiny_llama.config, spec)
    _decode(tiny_llama, _ids(300), cache, 299)
    nb = cache.nbytes()
    layers, b, h, d = 2, 1, 2, 64
    n_q = spec.quantized_count(300)  # 160
    n_fp = 300 - n_q
    codes = layers * b * h * n_q * d * 2 // 8 * 2  # keys and values, 2 bits each
    key_params = layers * b * h * (n_q // 32) * d * 2 * 2  # scale+zero fp16 per channel per 32-token group
    value_params = layers * b * h * n_q * (d // 32) * 2 * 2  # scale+zero fp16 per token per 32 channels
    assert nb.codes == codes
    assert nb.params == key_params + value_params
    assert nb.full_precision == layers * b * h * n_fp * d * 4 * 2
    assert nb.elements == layers * b * h * 300 * d * 2
    assert nb.quantized_bits_per_element == pytest.approx(3.0)
    assert nb.allocated >= nb.total


@pytest.mark.parametrize("kwargs, message", [
    (dict(fmt="int", bits=9), "allowed: 1, 2"),
    (dict(fmt="int", bits=4, axis="token", group=48), "does not divide head_dim"),
    (dict(fmt="int", bits=4, axis="diagonal"), "allowed: token, channel"),
    (dict(fmt="int4"), "allowed: none, int"),
])
def test_bad_quant_settings(tiny_llama, kwargs, message):
    with pytest.raises(ValueError, match=message):
        q = QuantSpec(**kwargs)
        QuantizedCache(tiny_llama.config, CacheSpec(key=q, value=q))


def test_bad_cache_settings(tiny_llama):
    with pytest.raises(ValueError, match="not a multiple"):
        CacheSpec(key=QuantSpec(bits=2, axis="channel", group=32), window=100)
    with pytest.raises(ValueError, match=r"unknown cache 'kivi-9'.*allowed: a preset \(full"):
        QuantizedCache(tiny_llama.config, "kivi-9")


def test_unsupported_attention_layout_is_refused():
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=96, num_attention_heads=2, num_key_value_heads=1, head_dim=48,
                      num_hidden_layers=1, vocab_size=32)
    with pytest.raises(ValueError, match="does not divide head_dim 48"):
        QuantizedCache(cfg, "int4")
    cfg.layer_types = ["linear_attention"]
    with pytest.raises(ValueError, match="serves full_attention, sliding_attention"):
        QuantizedCache(cfg, "int8")


def test_failed_update_leaves_cache_unchanged(tiny_llama):
    cache = QuantizedCache(tiny_llama.config, SMALL_KIVI)
    _decode(tiny_llama, _ids(100), cache, 99)
    before = (cache.get_seq_length(), cache.nbytes())
    with pytest.raises(ValueError, match="holds batch=1"):
        cache.update(torch.zeros(2, 2, 1, 64), torch.zeros(2, 2, 1, 64), 0)
    with pytest.raises(ValueError, match=r"\[batch, kv_heads, tokens, head_dim\]"):
        cache.update(torch.zeros(1, 2, 64), torch.zeros(1, 2, 64), 0)
    # an exception inside attention (here: the kernel of the last layer) discards the step in every layer
    def boom(*args):
        raise RuntimeError("kernel failure")

    cache.layers[-1].kv.attend = boom
    with pytest.raises(RuntimeError, match="kernel failure"), torch.no_grad():
        tiny_llama(_ids(1), **cache_kwargs(tiny_llama, cache))
    assert (cache.get_seq_length(), cache.nbytes()) == before


def test_batch_rows_are_independent(tiny_llama):
    """Two sequences decoded as a batch give each row the logits it gets alone (no parameter is shared
    across rows)."""
    ids = torch.cat([_ids(90, seed=3), _ids(90, seed=4)])
    both = _decode(tiny_llama, ids, QuantizedCache(tiny_llama.config, SMALL_KIVI), 40)
    for row in range(2):
        alone = _decode(tiny_llama, ids[row:row + 1], QuantizedCache(tiny_llama.config, SMALL_KIVI), 40)
        torch.testing.assert_close(both[row:row + 1], alone, atol=1e-4, rtol=1e-4)


def test_multi_query_attention():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=1, head_dim=64, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).eval()
    ids = _ids(80)
    with torch.no_grad():
        ref = model(ids).logits
    got = _decode(model, ids, QuantizedCache(model.config, "full"), 30)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
    q = _decode(model, ids, QuantizedCache(model.config, SMALL_KIVI), 30)
    assert q.shape == ref.shape and (q - ref).abs().max() < 0.5


def test_each_layer_commits_right_after_its_attention(tiny_llama):
    """A chunk's full-precision K/V never outlive their layer: when layer i attends, every earlier layer has
    already quantized what left its window."""
    cache = QuantizedCache(tiny_llama.config, SMALL_KIVI)
    with torch.no_grad():
        tiny_llama(_ids(40), **cache_kwargs(tiny_llama, cache))
    seen = []
    for i, layer in enumerate(cache.layers):
        inner = layer.kv.attend or reference.attend

        def spy(query, plan, mask, scaling, i=i, inner=inner):
            seen.append([(lay.kv.pending is None, lay.kv.n_total) for lay in cache.layers])
            return inner(query, plan, mask, scaling)

        layer.kv.attend = spy
    with torch.no_grad():
        tiny_llama(_ids(64, seed=1), **cache_kwargs(tiny_llama, cache))
    n = len(cache.layers)
    assert len(seen) == n
    for i, state in enumerate(seen):
        assert state == [(True, 104)] * i + [(False, 40)] + [(True, 40)] * (n - i - 1)


@pytest.mark.parametrize("failing", ["first", "last"])
def test_a_step_failing_after_earlier_layers_committed_is_rolled_back(tiny_llama, failing):
    """Earlier layers have already quantized the step's tokens (flushing the window into new blocks) when a later
    layer fails: the whole step is undone, and the cache then continues exactly as one that never saw it."""
    ids = _ids(150)
    ref = QuantizedCache(tiny_llama.config, SMALL_KIVI)
    cache = QuantizedCache(tiny_llama.config, SMALL_KIVI)
    with torch.no_grad():
        for c in (ref, cache):
            tiny_llama(ids[:, :50], **cache_kwargs(tiny_llama, c))
    before = (cache.get_seq_length(), cache.nbytes())

    def boom(*args):
        raise RuntimeError("kernel failure")

    cache.layers[0 if failing == "first" else -1].kv.attend = boom
    with pytest.raises(RuntimeError, match="kernel failure"), torch.no_grad():
        tiny_llama(_ids(70, seed=5), **cache_kwargs(tiny_llama, cache))  # 70 tokens: several groups leave the window
    assert (cache.get_seq_length(), cache.nbytes()) == before
    cache.layers[0 if failing == "first" else -1].kv.attend = None
    got = _decode(tiny_llama, ids[:, 50:], cache, 60)
    want = _decode(tiny_llama, ids[:, 50:], ref, 60)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_a_copied_cache_reuses_a_prompt(tiny_llama):
    """transformers' docs reuse a prompt's cache through copy.deepcopy: the copy routes the same model (it used to
    route copies of its configs, and the model ran SDPA over the cache), commits its own layers, owns its blocks,
    and both caches then go on as one never copied."""
    import copy

    import psutil

    ids = _ids(400, seed=1)
    ref = QuantizedCache(tiny_llama.config, "kivi-2")
    cache = QuantizedCache(tiny_llama.config, "kivi-2")
    with torch.no_grad():
        tiny_llama(ids[:, :300], **cache_kwargs(tiny_llama, ref))
        want = tiny_llama(ids[:, 300:], **cache_kwargs(tiny_llama, ref)).logits
        tiny_llama(ids[:, :300], **cache_kwargs(tiny_llama, cache))
        rss = psutil.Process().memory_info().rss
        twin = copy.deepcopy(cache)
        # the copy holds copies of the blocks (~0.4 MB here), not of the arena slabs they were carved from (4 MiB
        # and more, which a copy by tensors wrote out in full); a huge page touched in the copy's slab costs 2 MiB
        assert psutil.Process().memory_info().rss - rss < 4 << 20
        assert twin.layers[0].kv.step.layers[0] is twin.layers[0].kv
        blk, blk2 = cache.layers[0].kv.store.blocks[0], twin.layers[0].kv.store.blocks[0]
        assert blk2.parts["k.codes"].data_ptr() != blk.parts["k.codes"].data_ptr()
        got_twin = tiny_llama(ids[:, 300:], **cache_kwargs(tiny_llama, twin)).logits
        got = tiny_llama(ids[:, 300:], **cache_kwargs(tiny_llama, cache)).logits
    torch.testing.assert_close(got_twin, want, atol=0, rtol=0)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
