"""A static-shape forward of a Llama-family model, written for export to a static graph.

HF's generic forward builds masks and caches dynamically; this module reuses the model's own weights and
sub-modules (embedding, RMSNorms, q/k/v/o projections, rotary embedding, MLP, LM head) but computes attention
itself over fixed shapes, so the traced graph has no data-dependent control flow:

* ``prefill``: ``input_ids``/``attention_mask``/``position_ids`` ``[B, S-1]`` (a left-padded prompt) ->
  last-position logits ``[B, vocab]`` and every position's K and V for the window, per layer.
* ``decode``: ``input_ids``/``position_ids`` ``[B, 1]``, ``attention_mask`` ``[B, S]`` and the past window per
  layer -> logits ``[B, vocab]`` and the new token's K and V per layer.

K/V tensors use the manager's layout: ``"token"`` ``[T, B, H, D]`` (the graph transposes) or ``"head"``
``[B, H, T, D]``.  With a :class:`StaticKVQuant` the past inputs are codes that the graph dequantizes, and the
new K/V leave the graph already quantized with the same fixed parameters.  Attention inside one call uses the
exact float K/V of the tokens computed in that call, and the stored (dequantized) K/V of the past, which is what
kvsqueeze's own quantized cache does.
"""

from __future__ import annotations

import torch
from torch import nn

from ..layout import KVLayout, attention_facts, kv_layout
from ..rope import apply_rope, distinct_tables, model_rope_tables
from .static_manager import LAYOUTS, StaticKVQuant

MODES = ("prefill", "decode")


def _check_llama_like(model: nn.Module) -> KVLayout:
    """The model's KV layout (:func:`kvsqueeze.layout.kv_layout`), after checking it is one this module can run."""
    inner = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm")
    if inner is None or any(not hasattr(inner, a) for a in needed) or not hasattr(model, "lm_head"):
        raise ValueError(
            f"static export supports Llama-family causal LMs (model.model.{{{', '.join(needed)}}} and lm_head); "
            f"got {type(model).__name__}"
        )
    layout = kv_layout(model.config)
    if "sliding_attention" in layout.layer_types:
        raise ValueError("static export does not support sliding-window attention layers")
    facts = attention_facts(model)
    if facts.projections != "separate":
        raise ValueError("static export needs separate q_proj/k_proj/v_proj/o_proj projections; this model fuses them")
    if facts.qk_norm == "other" or facts.attn_softcap is not None:
        raise ValueError("static export supports per-head q/k norms and no attention-logit soft-capping; this "
                         "model has another q/k norm or soft-capping")
    if not facts.has_rope or facts.length_dependent_rope:
        raise ValueError("static export needs RoPE tables that do not depend on the sequence length")
    return layout


class StaticStep(nn.Module):
    """One static-shape call (``mode`` "prefill" or "decode") of ``model`` with a window of ``max_len - 1``."""

    def __init__(self, model: nn.Module, max_len: int, mode: str = "decode", *, layout: str = "token",
                 quant: StaticKVQuant | None = None) -> None:
        super().__init__()
        kv = _check_llama_like(model)
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; allowed: {', '.join(MODES)}")
        if layout not in LAYOUTS:
            raise ValueError(f"unknown layout {layout!r}; allowed: {', '.join(LAYOUTS)}")
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 2:
            raise ValueError(f"max_len must be an integer >= 2, got {max_len!r}")
        self.model, self.mode, self.layout, self.quant = model, mode, layout, quant
        self.window = max_len - 1
        self.n_layers, self.n_heads, self.n_kv, self.head_dim = (kv.num_layers, kv.num_heads, kv.num_kv_heads,
                                                                 kv.head_dim)
        self.groups = self.n_heads // self.n_kv
        self.scaling = getattr(model.model.layers[0].self_attn, "scaling", self.head_dim ** -0.5)
        # the model's RoPE tables (per layer type, scaling, partial rotary) as graph constants
        tables = model_rope_tables(model)
        self.rope_tables = distinct_tables(tables)
        self.layer_table = [next(j for j, d in enumerate(self.rope_tables) if d.same_as(t)) for t in tables]
        for j, t in enumerate(self.rope_tables):
            self.register_buffer(f"inv_freq_{j}", t.inv_freq, persistent=False)
        if mode == "prefill":  # fixed [S-1, S-1] masks as graph constants (ORT has no bool EyeLike kernel)
            t = self.window
            self.register_buffer("causal", torch.ones(t, t, dtype=torch.bool).tril(), persistent=False)
            self.register_buffer("eye", torch.eye(t, dtype=torch.bool), persistent=False)
        if quant is not None:
            if quant.n_layers != self.n_layers:
                raise ValueError(f"quantization parameters are for {quant.n_layers} layers, model has {self.n_layers}")
            quant.stored_dim(self.head_dim)
            for name in ("k_scale", "k_zero", "v_scale", "v_zero"):
                a = torch.from_numpy(getattr(quant, name).copy())
                if a.shape[1:] not in ((self.n_kv, self.head_dim), (1, 1)):
                    raise ValueError(f"{name} has shape {tuple(a.shape)}, expected per-channel "
                                     f"{(self.n_layers, self.n_kv, self.head_dim)} or per-tensor")
                self.register_buffer(name, a[:, :, None, :], persistent=False)  # [L, H, 1, D] for [B, H, T, D]

    # ------------------------------------------------------------------ quantization (StaticKVQuant's own functions)
    def _quantize(self, x: torch.Tensor, kind: str, layer: int) -> torch.Tensor:
        scale, zero = getattr(self, f"{kind}_scale")[layer], getattr(self, f"{kind}_zero")[layer]
        return self.quant.codes_torch(x, scale, zero)

    def _dequantize(self, q: torch.Tensor, kind: str, layer: int) -> torch.Tensor:
        scale, zero = getattr(self, f"{kind}_scale")[layer], getattr(self, f"{kind}_zero")[layer]
        return self.quant.values_torch(q, scale, zero)

    # ------------------------------------------------------------------ layout helpers ([B, H, T, D] inside)
    def _to_store(self, x: torch.Tensor, kind: str, layer: int) -> torch.Tensor:
        if self.quant is not None:
            x = self._quantize(x, kind, layer)
        return x.permute(2, 0, 1, 3) if self.layout == "token" else x

    def _from_store(self, x: torch.Tensor, kind: str, layer: int) -> torch.Tensor:
        if self.layout == "token":
            x = x.permute(1, 2, 0, 3)
        return self._dequantize(x, kind, layer) if self.quant is not None else x

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                *past: torch.Tensor) -> tuple[torch.Tensor, ...]:
        inner = self.model.model
        x = inner.embed_tokens(input_ids)
        rope = [self._cos_sin(j, position_ids, x.dtype) for j in range(len(self.rope_tables))]
        bias = self._mask_bias(attention_mask, x.dtype)
        outs: list[torch.Tensor] = []
        for i, layer in enumerate(inner.layers[: self.n_layers]):
            attn = layer.self_attn
            h = layer.input_layernorm(x)
            b, t, _ = h.shape
            q = attn.q_proj(h).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
            k = attn.k_proj(h).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
            v = attn.v_proj(h).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
            if getattr(attn, "q_norm", None) is not None:  # per-head q/k norms (Qwen3) sit before RoPE
                q, k = attn.q_norm(q), attn.k_norm(k)
            cos, sin = rope[self.layer_table[i]]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            if self.mode == "prefill":
                o = self._attend_prompt(q, k, v, bias)
            else:
                pk, pv = self._from_store(past[2 * i], "k", i), self._from_store(past[2 * i + 1], "v", i)
                o = self._attend_step(q, k, v, pk, pv, bias)
            x = x + attn.o_proj(o)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            outs += [self._to_store(k, "k", i), self._to_store(v, "v", i)]
        logits = self.model.lm_head(inner.norm(x[:, -1]))
        return (logits, *outs)

    def _cos_sin(self, j: int, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [B, 1, T, rotary_dim] of table j, computed as transformers' rotary modules do."""
        freqs = position_ids[..., None].float() * getattr(self, f"inv_freq_{j}").float()
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = self.rope_tables[j].attention_scaling
        return (emb.cos() * scale).to(dtype)[:, None], (emb.sin() * scale).to(dtype)[:, None]

    def _mask_bias(self, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Additive bias: 0 where attended, the dtype's minimum elsewhere (finite, so no NaN from a masked row)."""
        neg = torch.finfo(dtype).min
        keep = mask.to(torch.bool)
        if self.mode == "prefill":
            # a padded query still sees itself, so its softmax row is well defined (its output is never used)
            keep = (keep[:, None, :] & self.causal[None]) | self.eye[None]  # [B, T, T]
            return torch.where(keep, 0.0, neg).to(dtype)[:, None, None]  # [B, 1, 1, T, T]
        return torch.where(keep, 0.0, neg).to(dtype)[:, None, None, :]  # [B, 1, 1, S]

    def _attend_prompt(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        b, _, t, d = q.shape
        qg = q.view(b, self.n_kv, self.groups, t, d)  # query head h*G+g uses KV head h (as repeat_kv does)
        s = torch.matmul(qg, k[:, :, None].transpose(-1, -2)) * self.scaling + bias
        p = torch.softmax(s.float(), dim=-1).to(q.dtype)
        o = torch.matmul(p, v[:, :, None])  # [B, Hkv, G, T, D]
        return o.permute(0, 3, 1, 2, 4).reshape(b, t, self.n_heads * d)

    def _attend_step(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pk: torch.Tensor, pv: torch.Tensor,
                     bias: torch.Tensor) -> torch.Tensor:
        # No concat of past and new K/V (that would copy the window inside the graph): score them apart.
        b, _, _, d = q.shape
        qg = q.view(b, self.n_kv, self.groups, d)
        s_past = torch.matmul(qg, pk.transpose(-1, -2))  # [B, Hkv, G, S-1]
        s_new = (qg * k).sum(-1, keepdim=True)  # k: [B, Hkv, 1, D] -> [B, Hkv, G, 1]
        s = torch.cat([s_past, s_new], dim=-1) * self.scaling + bias
        p = torch.softmax(s.float(), dim=-1).to(q.dtype)
        o = torch.matmul(p[..., : self.window], pv) + p[..., self.window:] * v
        return o.reshape(b, 1, self.n_heads * d)
