"""Every common model family on tiny random models: RoPE tables, caches, calibrated methods, folding.

Families (tests/_families.py): Llama (GQA), Llama-3 / yarn / dynamic RoPE scaling, Mistral (sliding), Qwen2 (biases,
hybrid sliding), Qwen3 (q/k norm), Gemma-2 (hybrid, soft-capping), Gemma-3 (hybrid, per-layer-type RoPE, q/k norm),
Phi-3 (partial rotary, fused qkv).
"""

from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch
from transformers import DynamicCache

import kvsqueeze
from _families import FAMILIES, build, random_value_transform
from kvsqueeze.adapter import cache_kwargs
from kvsqueeze.calibrate import CalibrationSettings, calibrate, load_artifact
from kvsqueeze.calibrate.collect import CalibrationData, model_rope_tables
from kvsqueeze.calibrate.fold import fold_transforms
from kvsqueeze.calibrate.requirements import ModelRequirementError, refusal
from kvsqueeze.eval.protocols import nll_decode, nll_window
from kvsqueeze.layout import attention_facts
from kvsqueeze.quant.extras import PreRopeExtras
from kvsqueeze.rope import pair_order
from kvsqueeze.spec import QuantSpec
from kvsqueeze.transforms.matrices import rope_commuting, rope_commuting_inverse

FAMILY_NAMES = list(FAMILIES)
# method label -> settings (tiny: window 8, 2 sinks, 2 learning steps)
METHODS = {
    "skvq": {"method": "skvq"},
    "kvquant": {"method": "kvquant", "nuq": True},
    "hybrid": {"method": "hybrid"},
    "invertible-learned-folded": {"method": "invertible", "transform": "learned-folded", "key_bits": 4,
                                  "value_bits": 4, "key_group": 64, "value_group": 64},
    "invertible-smooth": {"method": "invertible", "transform": "smooth", "key_bits": 4, "value_bits": 4,
                          "key_group": 64, "value_group": 64},
    "invertible-learned-online": {"method": "invertible", "transform": "learned-online", "grouping": "skvq",
                                  "value_bits": 1.5},
}


@functools.cache
def model(family: str):
    return build(family)


def _ids(length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(2, 256, (1, length), generator=torch.Generator().manual_seed(seed))


def _run(m, ids, cache, prompt: int) -> torch.Tensor:
    with torch.no_grad():
        out = [m(ids[:, :prompt], **cache_kwargs(m, cache), use_cache=True).logits]
        for t in range(prompt, ids.shape[1]):
            out.append(m(ids[:, t:t + 1], **cache_kwargs(m, cache), use_cache=True).logits)
    return torch.cat(out, dim=1)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


# ------------------------------------------------------------------------------------------------ RoPE tables
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_rope_tables_are_the_models_own(family):
    m = model(family)
    tables = model_rope_tables(m)
    rot = m.model.rotary_emb
    pos = torch.arange(300)
    x = torch.zeros(1, 300, 4)
    for t in tables:
        cos, sin = rot(x, pos[None], t.label) if t.label else rot(x, pos[None])
        c, s = t.cos_sin(pos)
        assert torch.equal(cos[0], c) and torch.equal(sin[0], s)
    facts = attention_facts(m)
    assert facts.partial_rotary == (family == "phi3")
    assert facts.rope_tables == (2 if family == "gemma3" else 1)
    assert facts.qk_norm == ("per-head" if family in ("qwen3", "gemma3") else "none")


# ------------------------------------------------------------------------------------------------ caches
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_every_preset_runs_and_full_equals_the_models_own_attention(family):
    m = model(family)
    ids = _ids(40)
    with torch.no_grad():
        ref = m(ids, **cache_kwargs(m, DynamicCache(config=m.config)), use_cache=True).logits
    full = _run(m, ids, kvsqueeze.QuantizedCache(m.config, "full", backend="torch"), 24)
    assert _rel(full, ref) <= 1e-5
    window = [nll_window(m, ids, spec) for spec in (kvsqueeze.PRESETS["full"],)]
    from kvsqueeze.eval.protocols import nll_reference

    assert torch.allclose(window[0], nll_reference(m, ids), rtol=1e-4, atol=1e-5)
    for name in kvsqueeze.PRESETS:  # every preset runs through the cache on every family
        out = _run(m, ids[:, :16], kvsqueeze.QuantizedCache(m.config, name), 12)
        assert torch.isfinite(out).all(), name


def test_soft_capping_is_applied_by_the_cache():
    m = model("gemma2")
    ids = _ids(30, seed=1)
    capped = _run(m, ids, kvsqueeze.QuantizedCache(m.config, "int8", backend="torch"), 10)
    uncapped_model = copy.deepcopy(m)
    uncapped_model.config.attn_logit_softcapping = None
    for layer in uncapped_model.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    uncapped = _run(uncapped_model, ids, kvsqueeze.QuantizedCache(uncapped_model.config, "int8", backend="torch"), 10)
    assert _rel(capped, uncapped) > 1e-4  # the cap matters on this model, so the equality tests above see it


@pytest.mark.parametrize("family", ["gemma3", "phi3", "llama-yarn", "qwen2"])
def test_pre_rope_keys_without_quantization_reproduce_the_plain_cache(family):
    """Per-layer-type tables, partial rotary and attention scaling: un-rotating and re-rotating is exact."""
    m = model(family)
    tables = model_rope_tables(m)
    facts = attention_facts(m)
    h, d = facts.layout.num_kv_heads, facts.layout.head_dim
    overrides = tuple((QuantSpec(extras=PreRopeExtras(torch.zeros(h, d), torch.ones(h, d), t.inv_freq,
                                                      t.attention_scaling, bits=None)), QuantSpec(fmt="none"))
                      for t in tables)
    spec = dataclasses.replace(kvsqueeze.PRESETS["full"], key=overrides[0][0], window=4, sinks=0,
                               name="prerope-fp", layer_overrides=overrides, quantize_sliding=True,
                               meta={"model_layout": {"num_layers": facts.layout.num_layers, "num_kv_heads": h,
                                                      "head_dim": d}})
    ids = _ids(40, seed=2)
    with torch.no_grad():
        ref = m(ids).logits
    cache = kvsqueeze.QuantizedCache(m.config, spec)
    got = _run(m, ids, cache, 12)
    assert any(layer.kv.n_history > 0 for layer in cache.layers)
    assert _rel(got, ref) <= 1e-4


# ------------------------------------------------------------------------------------------------ calibrated methods
@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_calibrated_method_works_or_refuses(family, method, tmp_path):
    m = model(family)
    kw = METHODS[method]
    settings = CalibrationSettings(window=8, sinks=2, steps=2, **kw)
    data = CalibrationData(_ids(32, seed=3), {"source": "random ids (test)"})
    reason = refusal(attention_facts(m), settings.method, settings.transform if kw["method"] == "invertible" else None)
    if reason is not None:
        with pytest.raises(ModelRequirementError) as err:
            calibrate(m, data, settings, family, progress=False)
        assert str(err.value) == reason and "\n" not in reason
        return
    art = calibrate(m, data, settings, family, progress=False)
    path = art.save(tmp_path)
    loaded = load_artifact(path)
    spec = loaded.cache_spec()
    ids = _ids(24, seed=4)
    cache = kvsqueeze.QuantizedCache(m.config, str(path))
    out = _run(m, ids, cache, 12)
    assert torch.isfinite(out).all()
    assert sum(layer.kv.n_history > 0 for layer in cache.layers) >= 1  # something was quantized
    # the one-pass window protocol reproduces the real cache (positions, per-layer tables, sliding layers)
    w = nll_window(m, ids, spec, prefix=12)
    d = nll_decode(m, ids, kvsqueeze.QuantizedCache(m.config, spec), prefix=12)
    assert torch.allclose(w, d, rtol=1e-3, atol=1e-3)


def test_refusals_name_the_reason():
    assert "changes its table with the sequence length" in refusal(attention_facts(model("llama-dynamic")), "kvquant")
    assert "k_norm" in refusal(attention_facts(model("qwen3")), "invertible", "learned-folded")
    assert refusal(attention_facts(model("qwen3")), "invertible", "smooth") is None
    assert refusal(attention_facts(model("gemma3")), "hybrid") is None


# ------------------------------------------------------------------------------------------------ folding
def _transforms(m, seed: int = 0):
    """Random foldable (A, A^-1, family) for keys and values of every layer of ``m``."""
    facts = attention_facts(m)
    hkv, d, n = facts.layout.num_kv_heads, facts.layout.head_dim, facts.layout.num_layers
    rotary = facts.rope[0][1]
    order = torch.argsort(pair_order(d, rotary))
    g = torch.Generator().manual_seed(seed)
    keys, values = [], []
    for _ in range(n):
        u, phi = torch.randn(hkv, d // 2, generator=g) * 0.5, torch.rand(hkv, d // 2, generator=g) * 6
        if facts.qk_norm != "none":  # only a diagonal shared by all heads folds into the norm
            u, phi = u[:1].expand_as(u), torch.zeros_like(phi)
        a, a_inv = rope_commuting(u, phi), rope_commuting_inverse(u, phi)
        keys.append((a[..., order, :][..., order], a_inv[..., order, :][..., order], "rope-commuting"))
        values.append(random_value_transform(hkv, d, seed, g))
    return keys, values


@pytest.mark.parametrize("family", [f for f in FAMILY_NAMES if f not in ("llama3-scaled", "llama-dynamic")])
def test_folding_is_exact_where_allowed(family):
    m = model(family)
    folded = copy.deepcopy(m)
    keys, values = _transforms(m)
    fold_transforms(folded, keys, values, [t.inv_freq for t in model_rope_tables(m)])
    ids = _ids(40, seed=5)
    with torch.no_grad():
        assert _rel(folded(ids).logits, m(ids).logits) <= 1e-4


def test_folding_a_non_diagonal_key_transform_through_a_qk_norm_is_refused():
    m = model("qwen3")
    keys, values = _transforms(model("llama"))  # rotations inside pairs, different per head
    with pytest.raises(ValueError, match="q/k norm sits between W_k and RoPE"):
        fold_transforms(copy.deepcopy(m), keys, values, [t.inv_freq for t in model_rope_tables(m)])


# ------------------------------------------------------------------------------------------------ static engine
@pytest.mark.parametrize("family", ["llama", "llama3-scaled", "llama-yarn", "qwen3", "phi3", "gemma2"])
def test_static_step_rotates_with_the_models_tables_or_refuses(family):
    from kvsqueeze.engines.static_step import StaticStep

    m = model(family)
    if family in ("phi3", "gemma2"):  # fused qkv projection; sliding layers
        with pytest.raises(ValueError, match="static export"):
            StaticStep(m, 25, "prefill")
        return
    ids = _ids(24, seed=6)
    step = StaticStep(m, 25, "prefill").eval()
    with torch.no_grad():
        logits = step(ids, torch.ones_like(ids), torch.arange(24)[None])[0]
        ref = m(ids).logits[:, -1]
    assert _rel(logits, ref) <= 1e-5
