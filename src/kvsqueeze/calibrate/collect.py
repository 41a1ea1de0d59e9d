"""Calibration data and activation collection.

Calibration text never overlaps evaluation chunks: ``kvsqueeze ppl`` evaluates from the start of a corpus and
refuses the last 10% of its tokens (:data:`kvsqueeze.corpus.MAX_EVAL_FRACTION`), and calibration from a
file or WikiText-2 uses exactly that tail by default.  ``--generated`` uses text the model samples itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..rope import rope_cos_sin, undo_rope


@dataclass
class CalibrationData:
    ids: torch.Tensor  # [N, L] token ids
    provenance: dict[str, Any]


def corpus_samples(corpus: Any, tokenizer: Any, samples: int, length: int, start_fraction: float | None = None,
                   allow_overlap: bool = False) -> CalibrationData:
    """``samples`` consecutive windows of ``length`` tokens from the corpus tail starting at ``start_fraction``
    (default: the evaluation limit, 0.9).  A start inside the evaluated part is a ValueError unless
    ``allow_overlap`` (then the provenance says so)."""
    from ..corpus import MAX_EVAL_FRACTION, tokenize

    _check_sizes(samples, length)
    frac = MAX_EVAL_FRACTION if start_fraction is None else start_fraction
    if not 0.0 <= frac < 1.0:
        raise ValueError(f"calibration start fraction must be in [0, 1), got {frac}")
    ids = tokenize(corpus, tokenizer)
    n = ids.numel()
    eval_limit = int(n * MAX_EVAL_FRACTION)  # the same cut eval_chunks uses
    start = int(n * frac)
    if start < eval_limit and not allow_overlap:
        raise ValueError(f"calibration from token {start} overlaps the evaluation chunks (tokens 0..{eval_limit - 1} "
                         f"of {n} may be evaluated by kvsqueeze ppl); use the default tail (start fraction "
                         f"{MAX_EVAL_FRACTION}) or --generated, or pass --allow-overlap to accept the overlap")
    tail = ids[start:]
    fit = tail.numel() // length
    if fit < 1:
        raise ValueError(f"the calibration slice has {tail.numel()} tokens, fewer than --length {length}; use a "
                         f"shorter --length or a longer corpus")
    used = min(samples, fit)
    desc = corpus.describe()
    desc["corpus_source"] = desc.pop("source")
    prov = {**desc, "source": "corpus-tail" if start >= eval_limit else "corpus-overlapping-eval",
            "corpus_tokens": n, "token_start": start, "token_end": start + used * length,
            "evaluation_limit_token": eval_limit, "disjoint_from_evaluation": start >= eval_limit,
            "samples_requested": samples, "samples": used, "length": length}
    return CalibrationData(tail[: used * length].view(used, length), prov)


def generated_samples(model: Any, tokenizer: Any, samples: int, length: int, seed: int = 0,
                      temperature: float = 1.0, progress: bool = True) -> CalibrationData:
    """Text the model writes itself: ``samples`` sequences of ``length`` tokens sampled from the start token."""
    _check_sizes(samples, length)
    start_id = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if start_id is None:
        raise ValueError("the tokenizer has neither a BOS nor an EOS token to start generation from")
    gen = torch.Generator().manual_seed(seed)
    ids = torch.full((samples, 1), start_id, dtype=torch.long)
    past = None
    from tqdm.auto import tqdm

    bar = tqdm(total=length - 1, desc="generating calibration text", disable=not progress)
    with torch.no_grad():
        out = [ids]
        nxt = ids
        for _ in range(length - 1):
            res = model(input_ids=nxt, past_key_values=past, use_cache=True)
            past = res.past_key_values
            probs = torch.softmax(res.logits[:, -1].float() / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=gen)
            out.append(nxt)
            bar.update(1)
    bar.close()
    prov = {"source": "generated", "seed": seed, "temperature": temperature, "start_token": int(start_id),
            "samples": samples, "length": length, "disjoint_from_evaluation": True}
    return CalibrationData(torch.cat(out, dim=1), prov)


def _check_sizes(samples: int, length: int) -> None:
    if samples < 1:
        raise ValueError(f"--samples must be at least 1, got {samples}")
    if length < 32:
        raise ValueError(f"--length must be at least 32 tokens, got {length}")


@dataclass
class LayerActivations:
    """One layer's calibration activations, [N, heads, L, D] float32, positions 0..L-1."""

    q: torch.Tensor  # queries after RoPE
    k: torch.Tensor  # keys after RoPE
    k_pre: torch.Tensor  # keys before RoPE
    v: torch.Tensor
    scaling: float


@dataclass
class Activations:
    layers: list[LayerActivations | None]  # None for layers without a KV cache of their own (not collected)
    inv_freq: torch.Tensor
    rope_scaling: float
    num_kv_heads: int
    head_dim: int


def rope_tables(model: Any) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention_scaling) of the model's rotary embedding; ValueError for models without one."""
    rot = getattr(model.base_model, "rotary_emb", None)
    if rot is None or not hasattr(rot, "inv_freq"):
        raise ValueError("this model has no rotary embedding module (base_model.rotary_emb); pre-RoPE calibration "
                         "supports RoPE models")
    return rot.inv_freq.detach().float().clone(), float(getattr(rot, "attention_scaling", 1.0))


@torch.no_grad()
def collect(model: Any, ids: torch.Tensor, progress: bool = True) -> Activations:
    """Run the model over the calibration samples and keep, per layer and KV head, queries, keys before and after
    RoPE, and values.  Attention itself is transformers' SDPA (the outputs are the model's own)."""
    from tqdm.auto import tqdm

    from ..adapter import attention_override, sdpa_attention_forward
    from ..layout import kv_layout

    layout = kv_layout(model.config)
    inv_freq, rope_scale = rope_tables(model)
    n, length = ids.shape
    cos, sin = rope_cos_sin(torch.arange(length), inv_freq, rope_scale)
    store: dict[int, dict[str, list[torch.Tensor]]] = {}
    scal: dict[int, float] = {}

    def capture(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        i = module.layer_idx
        d = store.setdefault(i, {"q": [], "k": [], "k_pre": [], "v": []})
        d["q"].append(query.detach().float())
        d["k"].append(key.detach().float())
        d["k_pre"].append(undo_rope(key.detach().float(), cos.to(key.device), sin.to(key.device), rope_scale))
        d["v"].append(value.detach().float())
        scal[i] = query.shape[-1] ** -0.5 if scaling is None else scaling
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kw)

    with attention_override(model, capture):
        for row in tqdm(range(n), desc="collecting activations", disable=not progress):
            model.base_model(input_ids=ids[row:row + 1].to(model.device), use_cache=False)
    layers: list[LayerActivations | None] = []
    for i in range(layout.num_layers):
        if i not in store:
            layers.append(None)
            continue
        d = store[i]
        layers.append(LayerActivations(*(torch.cat(d[name]) for name in ("q", "k", "k_pre", "v")), scaling=scal[i]))
    return Activations(layers, inv_freq, rope_scale, layout.num_kv_heads, layout.head_dim)
