"""What a model's attention looks like to a KV cache: layers, heads, head_dim, layer types, sliding window.

A leaf module (reads transformers configs, touches no model internals); every layer of the package asks here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    sliding_window: int | None


def kv_layout(config) -> KVLayout:
    """Read the attention layout the cache must serve; ValueError for layouts it cannot."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    text = config.get_text_config(decoder=True)
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    types, kwargs = get_layer_types_and_kwargs(text)
    bad = sorted(set(types) - set(SUPPORTED_LAYER_TYPES))
    if bad:
        raise ValueError(f"this model has attention layers of type {', '.join(bad)}; kvsqueeze's cache serves "
                         f"{', '.join(SUPPORTED_LAYER_TYPES)}")
    if getattr(text, "v_head_dim", None) not in (None, head_dim) or getattr(text, "kv_lora_rank", None):
        raise ValueError("models with compressed or differently sized value heads (MLA) are not supported; "
                         "allowed: standard multi-head, grouped-query and multi-query attention")
    sw = next((kw.get("sliding_window") for t, kw in zip(types, kwargs) if t == "sliding_attention"), None)
    return KVLayout(text.num_hidden_layers, heads, kv_heads, head_dim, tuple(types), sw)


def model_kv_layout(config: Any) -> dict[str, Any]:
    """The KV-cache-relevant shape of a model config.

    Returns num_layers, num_heads, num_kv_heads, head_dim, layer_types (one of
    "full_attention" / "sliding_attention" per layer, or whatever other type the config
    names), sliding_window (None when no layer slides), rope (the rope parameters dict or
    None) and max_position_embeddings.
    """
    text = config.get_text_config(decoder=True)
    num_layers = int(text.num_hidden_layers)
    num_heads = int(text.num_attention_heads)
    num_kv_heads = int(getattr(text, "num_key_value_heads", None) or num_heads)
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
    window = getattr(text, "sliding_window", None)
    layer_types = getattr(text, "layer_types", None)
    if layer_types is not None:
        layer_types = list(layer_types)
    elif window is not None and getattr(text, "use_sliding_window", True) is not False:
        layer_types = ["sliding_attention"] * num_layers
    else:
        layer_types = ["full_attention"] * num_layers
    if len(layer_types) != num_layers:
        raise ValueError(f"config.layer_types has {len(layer_types)} entries for {num_layers} layers")
    rope = getattr(text, "rope_parameters", None)
    return {
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "head_dim": int(head_dim),
        "layer_types": layer_types,
        "sliding_window": window if "sliding_attention" in layer_types else None,
        "rope": dict(rope) if rope is not None else None,
        "max_position_embeddings": getattr(text, "max_position_embeddings", None),
    }
