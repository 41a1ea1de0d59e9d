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
    return KVLayout(text.num_hidden_layers, heads, kv_heads, head_dim, tuple(types),
                    _sliding_window(types, kwargs, text))


def _sliding_window(types, kwargs, text) -> int | None:
    """The sliding layers' window: per-layer kwargs (a list of dicts in recent transformers; one dict in older 5.x
    releases), else the config's own ``sliding_window``."""
    per_layer = kwargs if isinstance(kwargs, list | tuple) else [kwargs] * len(types)
    for t, kw in zip(types, per_layer):
        if t == "sliding_attention":
            found = kw.get("sliding_window") if isinstance(kw, dict) else None
            return found if found is not None else getattr(text, "sliding_window", None)
    return None


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


# ------------------------------------------------------------------------------------------------ attention facts
QK_NORMS = ("none", "per-head", "other")  # per-head: one weight of head_dim shared by every head (Qwen3, Gemma-3)
PROJECTIONS = ("separate", "fused-qkv", "other")  # separate q/k/v/o_proj; fused-qkv: Phi-3's [q; k; v] qkv_proj


@dataclass(frozen=True)
class AttentionFacts:
    """What calibration and folding need to know about a model's attention beyond the cache's layout.

    rope:          per layer, ``(rope_type, rotary_dim)`` or None for a model without rotary embeddings
    rope_tables:   number of distinct RoPE tables over the layers (2 for Gemma-3's sliding/global bases)
    qk_norm:       a norm between W_q/W_k and RoPE: "none", "per-head" (RMSNorm over head_dim, one shared weight)
                   or "other" (over all heads, per-head weights, ...)
    projections:   how q/k/v/o are projected ("separate", "fused-qkv" or "other")
    attn_softcap:  attention-logit soft-capping (Gemma-2) or None
    """

    model_type: str
    layout: KVLayout
    rope: tuple[tuple[str, int] | None, ...]
    rope_tables: int
    qk_norm: str
    projections: str
    attn_softcap: float | None

    @property
    def has_rope(self) -> bool:
        return all(r is not None for r in self.rope)

    @property
    def partial_rotary(self) -> bool:
        return any(r is not None and r[1] < self.layout.head_dim for r in self.rope)

    @property
    def length_dependent_rope(self) -> bool:
        from .rope import LENGTH_DEPENDENT_TYPES

        return any(r is not None and r[0] in LENGTH_DEPENDENT_TYPES for r in self.rope)

    @property
    def sliding_layers(self) -> int:
        return sum(t == "sliding_attention" for t in self.layout.layer_types)


def attention_modules(model: Any) -> list[Any]:
    """The self-attention module of every decoder layer, in layer order (modules with a ``layer_idx`` and a key
    projection)."""
    mods = [m for m in model.modules() if hasattr(m, "layer_idx")
            and any(hasattr(m, a) for a in ("k_proj", "qkv_proj", "query_key_value"))]
    return sorted(mods, key=lambda m: m.layer_idx)


def _qk_norm(mod: Any, head_dim: int) -> str:
    norm = getattr(mod, "k_norm", None) or getattr(mod, "k_layernorm", None)
    if norm is None:
        return "none"
    w = getattr(norm, "weight", None)
    return "per-head" if w is not None and w.dim() == 1 and w.numel() == head_dim else "other"


def _projections(mod: Any) -> str:
    if all(hasattr(mod, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return "separate"
    if hasattr(mod, "qkv_proj") and hasattr(mod, "o_proj"):
        return "fused-qkv"
    return "other"


def attention_facts(model: Any) -> AttentionFacts:
    """Facts about ``model``'s attention from its config and the names and shapes of its attention modules."""
    from .rope import distinct_tables, has_rope, layer_rope_tables

    layout = kv_layout(model.config)
    text = model.config.get_text_config(decoder=True)
    if has_rope(text):
        tables = layer_rope_tables(text)
        rope: tuple = tuple((t.rope_type, t.rotary_dim) for t in tables)
        n_tables = len(distinct_tables(tables))
    else:
        rope, n_tables = (None,) * layout.num_layers, 0
    mods = attention_modules(model)
    norms = {_qk_norm(m, layout.head_dim) for m in mods} or {"none"}
    projs = {_projections(m) for m in mods} or {"other"}
    return AttentionFacts(
        model_type=str(getattr(text, "model_type", type(text).__name__)), layout=layout, rope=rope,
        rope_tables=n_tables, qk_norm=norms.pop() if len(norms) == 1 else "other",
        projections=projs.pop() if len(projs) == 1 else "other",
        attn_softcap=getattr(text, "attn_logit_softcapping", None))
