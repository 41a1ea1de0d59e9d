"""The method registry and --method auto: a per-layer, per-side format assignment at an average bit budget."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvsqueeze import QuantizedCache
from kvsqueeze.cache.emulate import fake_quantize_cache
from kvsqueeze.calibrate import calibrate, load_artifact
from kvsqueeze.calibrate.auto import candidates, causal_attention_out, cost_units, knapsack, window_kl
from kvsqueeze.calibrate.clip import attention_out
from kvsqueeze.calibrate.collect import CalibrationData
from kvsqueeze.calibrate.methods import REGISTRY, settings_from
from kvsqueeze.calibrate.methods.auto import AutoSettings
from kvsqueeze.eval.protocols import nll_decode, nll_window
from kvsqueeze.quant import bits_per_element
from kvsqueeze.spec import CacheSpec, QuantSpec


def _ids(n: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(2, 256, (n, length), generator=torch.Generator().manual_seed(seed))


def test_registry_settings_are_frozen_and_refuse_foreign_options():
    for m in REGISTRY.values():
        s = m.settings()
        assert s.method == m.name
        with pytest.raises(AttributeError):  # frozen dataclass
            object.__getattribute__(s, "__setattr__")(m.fields()[0].name, None)
    with pytest.raises(ValueError, match="takes no --clip"):
        settings_from("kvquant", {"clip": "group"})
    assert settings_from("kvquant", {"key_bits": 3}).value_bits == 3.0  # values as wide as the keys
    assert settings_from("invertible", {"grouping": "kivi"}, cli=True).key_group == 32


def test_knapsack_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    costs = torch.rand(5, 4, generator=g).tolist()
    units = torch.randint(1, 6, (5, 4), generator=g).tolist()
    for budget in (8, 12, 17):
        picks = knapsack(costs, units, budget)
        best = min((sum(costs[i][j] for i, j in enumerate(p)), p) for p in itertools.product(range(4), repeat=5)
                   if sum(units[i][j] for i, j in enumerate(p)) <= budget)
        assert sum(units[i][j] for i, j in enumerate(picks)) <= budget
        assert sum(costs[i][j] for i, j in enumerate(picks)) == pytest.approx(best[0])


def test_candidate_costs_count_every_parameter():
    for side in ("key", "value"):
        for q in candidates(side, 64):
            assert cost_units(q, 64) == pytest.approx(bits_per_element(q, 64) * 8)
    assert cost_units(QuantSpec(fmt="rot", bits=2.875, axis="channel", group=128), 64) == 26  # rot-3's keys
    # head_dim 256: a rotated side's fp16 norm is 1/16 bit per element, so the knapsack counts in sixteenths
    from kvsqueeze.calibrate.auto import cost_unit

    for d, unit in ((64, 8), (128, 8), (256, 16)):
        quants = candidates("key", d) + candidates("value", d)
        assert cost_unit(quants, d) == unit
        for q in quants:
            assert cost_units(q, d, unit) == pytest.approx(bits_per_element(q, d) * unit, abs=1e-9)


@pytest.fixture(scope="module")
def auto_artifact(tiny_llama, tmp_path_factory):
    data = CalibrationData(_ids(2, 320), {"source": "random ids (test)"})
    art = calibrate(tiny_llama, data, AutoSettings(bits=3.0, window=128, sinks=2), "tiny", progress=False)
    return art, art.save(tmp_path_factory.mktemp("art"))


def test_auto_meets_the_budget_and_loads(auto_artifact, tiny_llama):
    art, path = auto_artifact
    loaded = load_artifact(path)
    spec = loaded.cache_spec()
    bits = [bits_per_element(q, 64) for pair in spec.layer_overrides for q in pair]
    assert sum(bits) / len(bits) <= 3.0 + 1e-9
    rec = art.layers[0]["key"].settings["auto"]
    assert rec["first"]["kl"] is not None and rec["first"]["kl"] >= 0
    # the artifact serves in both backends and the window protocol equals the real cache
    ids = _ids(1, 300, seed=5)
    w = nll_window(tiny_llama, ids, spec, prefix=150)
    for backend in ("torch", "auto"):
        d = nll_decode(tiny_llama, ids, QuantizedCache(tiny_llama.config, str(path), backend=backend), prefix=150)
        assert torch.allclose(w, d, rtol=1e-4, atol=1e-4)


def test_window_kl_is_zero_without_quantization_and_grows_with_fewer_bits(tiny_llama):
    ids = _ids(1, 300, seed=3)
    assert window_kl(tiny_llama, ids, [None, None]) == pytest.approx(0.0, abs=1e-7)
    kl = []
    for b in (4, 2):
        q = QuantSpec(fmt="int", bits=b, axis="token", group=32)
        kl.append(window_kl(tiny_llama, ids, [CacheSpec(key=q, value=q, window=128, sinks=2)] * 2))
    assert 0 < kl[0] < kl[1]


@pytest.mark.parametrize("chunk", [7, 64, 1000])
def test_causal_attention_out_in_query_chunks_equals_one_pass(monkeypatch, chunk):
    """window_kl's attention, a chunk of queries at a time against the keys up to the chunk's last, gives what one
    pass over every [query, key] pair gives (window, sinks and flush granularity included)."""
    from kvsqueeze.calibrate import auto

    monkeypatch.setattr(auto, "QUERY_CHUNK", chunk)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, h, 150, 16, generator=g) for h in (4, 2, 2))
    spec = CacheSpec(key=QuantSpec(fmt="int", bits=2, axis="channel", group=16),
                     value=QuantSpec(fmt="int", bits=3, axis="token", group=16), window=32, sinks=3)
    k_hat, v_hat = fake_quantize_cache(k, v, spec)
    whole = attention_out(q, k, v, torch.arange(150), 0.25, k_hat, v_hat, spec.window, spec.sinks,
                          flush=spec.flush_tokens, softcap=30.0)
    got = causal_attention_out(q, k, v, 0.25, k_hat, v_hat, spec, softcap=30.0)
    torch.testing.assert_close(got.reshape(whole.shape), whole, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(k_hat, k)  # the quantized keys are in play


def test_window_kl_keeps_sliding_layers_to_their_window(tiny_mixed_sliding):
    """With a window longer than the sequence nothing is quantized, so the emulated attention must be the model's
    own - sliding layers (window 16 here) seeing only their last keys - and the KL zero."""
    q = QuantSpec(fmt="int", bits=2, axis="token", group=32)
    spec = CacheSpec(key=q, value=q, window=128, sinks=0)
    assert window_kl(tiny_mixed_sliding, _ids(1, 100, seed=4), [spec] * 4) == pytest.approx(0.0, abs=1e-7)


def test_budget_weights_follow_the_tokens_each_layer_holds():
    from types import SimpleNamespace

    from kvsqueeze.calibrate.auto import budget_weights, held_tokens

    glob, slid = SimpleNamespace(sliding_window=None), SimpleNamespace(sliding_window=512)
    # Gemma-3-like at 2048 tokens, all quantized: a sliding layer keeps the 2 blocks of 256 its window sees
    assert [held_tokens(la, 2048, 0, 0) for la in (glob, slid)] == [2048, 512]
    assert held_tokens(slid, 1790, 0, 0) == 766  # a block is dropped only once no query sees any of it
    assert held_tokens(slid, 1791, 0, 0) == 511
    assert held_tokens(slid, 600, 0, 0) == 600  # nothing evicted yet
    assert budget_weights([2048, 512, 512]) == [4, 1, 1]
    # window protocol: the window and sinks stay exact (a sliding layer keeps no sinks)
    assert [held_tokens(la, 2048, 128, 4) for la in (glob, slid)] == [1916, 384]
    assert budget_weights([1916, 384]) == [479, 96]
    w = budget_weights([100_003, 50_000], limit=64)  # no useful divisor: rounded, the ratio kept
    assert w == [64, 32]
    assert budget_weights([0, 0]) == [1, 1] and budget_weights([2048, 2048]) == [1, 1]


def test_weighted_knapsack_holds_the_budget_over_held_elements():
    """Two layers x two sides, the first holding 4x the tokens of the second: with equal weights the cheapest-loss
    pick gives the big layer 4 bits and the small one 2, and the element average exceeds the budget; weighted, it
    holds."""
    from kvsqueeze.calibrate.auto import budget_weights

    units = [[16, 24, 32]] * 4  # 2, 3, 4 bits in eighths
    costs = [[9.0, 5.0, 0.0], [9.0, 5.0, 0.0], [0.5, 0.2, 0.0], [0.5, 0.2, 0.0]]  # the big layer's sides first
    held = [2048, 2048, 512, 512]
    weight = budget_weights(held)
    budget = 24 * sum(weight)
    picks = knapsack(costs, [[u * w for u in us] for us, w in zip(units, weight)], budget)
    avg = sum(units[g][j] * held[g] for g, j in enumerate(picks)) / sum(held) / 8
    assert avg <= 3.0 + 1e-9
    unweighted = knapsack(costs, units, 24 * 4)
    assert sum(units[g][j] * held[g] for g, j in enumerate(unweighted)) / sum(held) / 8 > 3.0


def test_auto_on_a_sliding_model_holds_the_budget_in_the_real_cache(tiny_mixed_sliding, tmp_path):
    """A hybrid model's sliding layers hold only the blocks their window sees: weighted by the tokens each layer
    holds, the planned average is what the real cache holds after the calibration length (equal weights planned
    3.0 b here and the cache held 2.875; on Gemma-3-270M 4.0 b planned, 4.080 held)."""
    from kvsqueeze.adapter import cache_kwargs

    data = CalibrationData(_ids(2, 768), {"source": "random ids (test)"})  # sliding layers hold 256 of 768
    settings = AutoSettings(bits=3.0, window=0, sinks=0, refine=False)
    art = calibrate(tiny_mixed_sliding, data, settings, "tiny-sliding", progress=False)
    path = art.save(tmp_path)
    cache = QuantizedCache(tiny_mixed_sliding.config, str(path))
    with torch.no_grad():
        tiny_mixed_sliding(_ids(1, 768, seed=3), **cache_kwargs(tiny_mixed_sliding, cache), use_cache=True)
    planned = art.layers[1]["key"].settings["auto"]["bits"]  # the knapsack's average over held elements
    assert planned <= 3.0 + 1e-9
    assert cache.nbytes().quantized_bits_per_element == pytest.approx(planned, abs=1e-9)
