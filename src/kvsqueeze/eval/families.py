"""Tiny random models of every common family, built from transformers' own config classes (no downloads).

Each has a few layers and small dims, float32, random weights (seed 0).  Used by tests/test_families.py (through
tests/_families.py) and by benchmarks/family_table.py (the family x method table of docs/calibrated.md), so both
see the same models; it lives in the package so that benchmarks never import from tests/.
"""

from __future__ import annotations

from typing import Any

import torch

COMMON = {"vocab_size": 256, "hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64, "max_position_embeddings": 4096}

# family -> (what it exercises, config class name, model class name, config overrides)
FAMILIES: dict[str, tuple[str, str, str, dict[str, Any]]] = {
    "llama": ("GQA", "LlamaConfig", "LlamaForCausalLM", {}),
    "llama3-scaled": ("RoPE scaling llama3", "LlamaConfig", "LlamaForCausalLM", {
        "max_position_embeddings": 16384,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    "llama-yarn": ("RoPE scaling yarn, attention scaling", "LlamaConfig", "LlamaForCausalLM", {
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                            "original_max_position_embeddings": 1024}}),
    "llama-dynamic": ("RoPE scaling dynamic (length-dependent)", "LlamaConfig", "LlamaForCausalLM", {
        "rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}}),
    "mistral": ("sliding window", "MistralConfig", "MistralForCausalLM", {"sliding_window": 16}),
    "qwen2": ("q/k/v biases, hybrid sliding", "Qwen2Config", "Qwen2ForCausalLM", {
        "num_hidden_layers": 4, "use_sliding_window": True, "sliding_window": 16,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]}),
    "qwen3": ("q/k norm", "Qwen3Config", "Qwen3ForCausalLM", {}),
    "gemma2": ("hybrid layers, soft-capping", "Gemma2Config", "Gemma2ForCausalLM", {
        "num_hidden_layers": 4, "sliding_window": 16, "query_pre_attn_scalar": 64,
        "attn_logit_softcapping": 0.5, "final_logit_softcapping": 30.0}),
    "gemma3": ("hybrid layers, per-layer-type RoPE, q/k norm", "Gemma3TextConfig", "Gemma3ForCausalLM", {
        "num_hidden_layers": 6, "sliding_window": 16, "query_pre_attn_scalar": 64,
        "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}}}),
    "phi3": ("partial rotary, fused qkv", "Phi3Config", "Phi3ForCausalLM", {"partial_rotary_factor": 0.5,
                                                                             "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 1}),
}


def build(family: str, attn_implementation: str | None = None) -> Any:
    """A tiny random model of ``family`` (eval mode, no grad), with its family's default attention unless given."""
    import transformers

    _, cfg_name, model_name, over = FAMILIES[family]
    kw = {**COMMON, **over}
    if attn_implementation is not None:
        kw["attn_implementation"] = attn_implementation
    config = getattr(transformers, cfg_name)(**kw)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).to(torch.float32).eval()
    model.requires_grad_(False)
    # random-init norms are all ones (or zeros for Gemma's 1 + w): perturb them so a fold into them is tested
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


def random_value_transform(hkv: int, d: int, seed: int, g: torch.Generator) -> tuple:
    """(matrix, inverse, "general"): a Hadamard-based Woodbury transform with a random rank-4 update and scales,
    the value transform the folding tests fold (draws from ``g`` in a fixed order)."""
    from kvsqueeze.transforms.matrices import GeneralTransform

    t = GeneralTransform(hkv, d, rank=4, base="hadamard", seed=seed + 1)
    with torch.no_grad():
        t.u.normal_(0, 0.2, generator=g)
        t.s.normal_(0, 0.3, generator=g)
    return t.matrix().detach(), t.inverse().detach(), "general"
