"""Real architectures with random weights, built from their configs: GPU timings without downloaded weights.

Decode speed and memory depend on a model's shapes, not on its weights, so ``kvsqueeze speed --random-weights
NAME`` times Llama-3.1-8B, Qwen2.5-7B or Mistral-7B as they are shaped, on a machine that cannot fetch them.  The
configs below are the architecture fields of each model's public ``config.json`` (Hugging Face hub, as published
by Meta, the Qwen team and Mistral AI); a JSON file of such fields works too.  Every report of such a run says
"random weights": the tokens it generates are noise, only its times and bytes mean anything.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

CONFIGS: dict[str, dict[str, Any]] = {
    "llama-3.1-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                         max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                         rope_scaling=_LLAMA3_ROPE, tie_word_embeddings=False),
    "qwen2.5-7b": dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                       max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=1000000.0,
                       tie_word_embeddings=False),
    "mistral-7b": dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=32768,
                       max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1000000.0, sliding_window=None,
                       tie_word_embeddings=False),
    # the embedded model's shapes: small enough for a CPU check of the random-weights route itself
    "smollm2-135m": dict(model_type="llama", hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
                         rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True),
}


def config_fields(name: str) -> dict[str, Any]:
    """The architecture fields of a named shape, or of a JSON file (a ``config.json`` or just its fields)."""
    if name in CONFIGS:
        return dict(CONFIGS[name])
    path = Path(name).expanduser()
    if path.is_file():
        try:
            fields = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"--random-weights {name}: not a readable JSON config ({err})") from err
        if not isinstance(fields, dict) or "model_type" not in fields:
            raise ValueError(f"--random-weights {name}: a config needs at least 'model_type'")
        return fields
    raise ValueError(f"unknown --random-weights shape {name!r}; allowed: {', '.join(CONFIGS)}, or a config.json path")


def random_model(name: str, layers: int | None = None, dtype: torch.dtype = torch.bfloat16,
                 device: str | torch.device = "cpu", seed: int = 0) -> Any:
    """The architecture ``name`` with random weights (normal, std = its initializer range) in ``dtype`` on
    ``device``, in eval mode; ``layers`` keeps only the first that many decoder layers (a quicker run)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = config_fields(name)
    if layers is not None:
        if layers < 1:
            raise ValueError(f"--layers must be at least 1, got {layers}")
        fields["num_hidden_layers"] = min(layers, fields.get("num_hidden_layers", layers))
    model_type = fields.pop("model_type")
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval().requires_grad_(False)
    model.random_weights = name  # reports say so (eval.meta.model_info)
    return model
