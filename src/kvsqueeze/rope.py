"""RoPE as transformers applies it (half-split rotation of the first ``rotary_dim`` channels), its inverse, and
the per-layer RoPE tables of a model read from its config.

A leaf module: the pre-RoPE key codec, calibration, folding and the static engine all rotate with these.
Tables come from transformers' own RoPE initialisers (``ROPE_INIT_FUNCTIONS``: linear, dynamic, yarn, longrope,
llama3, ...), per layer type where the config nests its RoPE parameters by layer type (Gemma-3-style hybrid
models use one base for sliding layers and another for global ones).  Partial rotary (``partial_rotary_factor``
< 1) rotates only the first ``rotary_dim`` channels; the rest pass through unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

# RoPE types whose table depends on the current sequence length: keys the model rotated earlier were rotated with
# another table than the one a later step uses, so a key stored before RoPE cannot be re-rotated as the model did.
LENGTH_DEPENDENT_TYPES = ("dynamic", "longrope")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The half-split RoPE convention of Llama-family models in transformers: (x1, x2) -> (-x2, x1)."""
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float) -> tuple[torch.Tensor, ...]:
    """cos, sin [T, rotary_dim] as transformers computes them (float32 products of positions and inverse
    frequencies, times the attention scaling)."""
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos() * scaling, emb.sin() * scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of x [..., D] with cos/sin [..., r]: the first r channels rotate (r < D: partial rotary)."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot = x[..., :r]
    return torch.cat((rot * cos + rotate_half(rot) * sin, x[..., r:]), dim=-1)


def undo_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, scaling: float) -> torch.Tensor:
    """Inverse of :func:`apply_rope` (the rotation is orthogonal up to the attention scaling factor)."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return (x * cos - rotate_half(x) * sin) / (scaling * scaling)
    rot = x[..., :r]
    return torch.cat(((rot * cos - rotate_half(rot) * sin) / (scaling * scaling), x[..., r:]), dim=-1)


def pair_partner(head_dim: int, rotary_dim: int | None = None) -> torch.Tensor:
    """[D] long: the channel each channel is rotated with (i <-> i + r/2 inside the rotary part); channels past
    ``rotary_dim`` are paired the same way among themselves (they never rotate, so any pairing commutes)."""
    r = head_dim if rotary_dim is None else rotary_dim
    idx = torch.arange(head_dim)
    out = idx.clone()
    for lo, n in ((0, r), (r, head_dim - r)):
        h = n // 2
        out[lo:lo + h] = idx[lo + h:lo + 2 * h]
        out[lo + h:lo + 2 * h] = idx[lo:lo + h]
    return out


def pair_order(head_dim: int, rotary_dim: int | None = None) -> torch.Tensor:
    """[D] long permutation P with ``x[..., P]`` in the full half-split layout: channel j of the reordered vector
    is paired with j + D/2 as the model pairs them (identity for full rotary).  Lets transforms written for the
    full half-split convention serve partial rotary models: conjugate them with P."""
    r = head_dim if rotary_dim is None else rotary_dim
    if r == head_dim:
        return torch.arange(head_dim)
    if r % 2 or (head_dim - r) % 2:
        raise ValueError(f"rotary_dim {r} and head_dim {head_dim} must both leave an even number of channels")
    hr, hp = r // 2, (head_dim - r) // 2
    first = torch.cat((torch.arange(hr), r + torch.arange(hp)))
    second = torch.cat((hr + torch.arange(hr), r + hp + torch.arange(hp)))
    return torch.cat((first, second))


@dataclass(frozen=True)
class RopeTable:
    """One RoPE table: ``inv_freq`` [rotary_dim / 2] float32, the cos/sin ``attention_scaling``, and where it
    applies (``rotary_dim`` of ``head_dim`` channels)."""

    inv_freq: torch.Tensor
    attention_scaling: float
    rotary_dim: int
    head_dim: int
    rope_type: str = "default"
    label: str = ""  # the layer type it serves when the config nests RoPE parameters by layer type

    @property
    def partial(self) -> bool:
        return self.rotary_dim < self.head_dim

    @property
    def length_dependent(self) -> bool:
        return self.rope_type in LENGTH_DEPENDENT_TYPES

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.inv_freq.to(positions.device), self.attention_scaling)

    def same_as(self, other: RopeTable) -> bool:
        return (self.attention_scaling == other.attention_scaling and self.rotary_dim == other.rotary_dim
                and torch.equal(self.inv_freq, other.inv_freq))


def _text(config: Any) -> Any:
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def _head_dim(text: Any) -> int:
    return int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)


def _nested_labels(text: Any, params: dict) -> list[str]:
    if hasattr(text, "nested_rope_parameter_keys"):
        return list(text.nested_rope_parameter_keys(params))
    labels = getattr(text, "layer_types", None) or ()
    return [k for k in params if k in labels]


def _default_table(text: Any, params: dict) -> tuple[torch.Tensor, float]:
    """transformers' default RoPE (the formula every model's ``compute_default_rope_parameters`` uses)."""
    base = params["rope_theta"]
    dim = int(_head_dim(text) * params.get("partial_rotary_factor", 1.0))
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0


def _table(text: Any, params: dict, label: str | None) -> RopeTable:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        inv_freq, scaling = _default_table(text, params)
    elif rope_type in ROPE_INIT_FUNCTIONS:
        kw = {"layer_type": label} if label else {}
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](text, None, **kw)
    else:
        raise ValueError(f"RoPE type {rope_type!r} has no table here; allowed: default, "
                         f"{', '.join(sorted(ROPE_INIT_FUNCTIONS))}")
    head_dim = _head_dim(text)
    rotary = 2 * int(inv_freq.numel())
    if rotary > head_dim:
        raise ValueError(f"RoPE table rotates {rotary} channels of a {head_dim}-channel head")
    return RopeTable(inv_freq.detach().float().clone(), float(scaling), rotary, head_dim, rope_type, label or "")


def has_rope(config: Any) -> bool:
    """Whether the config describes rotary position embeddings (``rope_parameters`` with a base)."""
    params = getattr(_text(config), "rope_parameters", None)
    return bool(params)


def layer_rope_tables(config: Any) -> list[RopeTable]:
    """The RoPE table of every decoder layer, from the config through transformers' own initialisers.

    ValueError for a model without RoPE parameters (learned or ALiBi positions: nothing to un-rotate)."""
    text = _text(config)
    params = getattr(text, "rope_parameters", None)
    if not params:
        raise ValueError(f"this model ({getattr(text, 'model_type', type(text).__name__)}) has no rotary position "
                         "embeddings (no rope_parameters in its config)")
    n = int(text.num_hidden_layers)
    nested = _nested_labels(text, params)
    if not nested:
        table = _table(text, dict(params), None)
        return [table] * n
    types = list(getattr(text, "layer_types", None) or [])
    if len(types) != n:
        raise ValueError(f"config nests RoPE parameters by layer type but has {len(types)} layer types for {n} layers")
    tables = {label: _table(text, dict(params[label]), label) for label in nested}
    missing = sorted(set(types) - set(tables))
    if missing:
        raise ValueError(f"no RoPE parameters for layer type(s) {', '.join(missing)}")
    return [tables[t] for t in types]


def model_rope_tables(model: Any) -> list[RopeTable]:
    """Every layer's RoPE table (:func:`layer_rope_tables`) with the inverse frequencies the model's rotary module
    actually holds where it has a buffer of the same size (``inv_freq`` or ``<layer type>_inv_freq``): a model
    cast to bf16 rotates with its rounded buffer, and the tables must rotate as the model does."""
    tables = layer_rope_tables(model.config)
    rot = getattr(getattr(model, "base_model", model), "rotary_emb", None)
    out = []
    for t in tables:
        buf = None if rot is None else getattr(rot, f"{t.label}_inv_freq" if t.label else "inv_freq", None)
        if isinstance(buf, torch.Tensor) and buf.shape == t.inv_freq.shape:
            t = dataclasses.replace(t, inv_freq=buf.detach().float().clone())
        out.append(t)
    return out


def distinct_tables(tables: list[RopeTable]) -> list[RopeTable]:
    """The different tables among per-layer ones, in order of first use."""
    out: list[RopeTable] = []
    for t in tables:
        if not any(t.same_as(o) for o in out):
            out.append(t)
    return out
