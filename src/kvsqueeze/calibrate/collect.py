"""Calibration data and activation collection.

Calibration text never overlaps evaluation chunks: ``kvsqueeze ppl`` evaluates from the start of a corpus and
refuses the last 10% of its tokens (:data:`kvsqueeze.corpus.MAX_EVAL_FRACTION`), and calibration from a
file or WikiText-2 uses exactly that tail by default.  ``--generated`` uses text the model samples itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..rope import RopeTable, has_rope, model_rope_tables, undo_rope


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
    from ..adapter import cache_kwargs, output_cache

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
            res = model(input_ids=nxt, **cache_kwargs(model, past), use_cache=True)
            past = output_cache(res)
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
    k_pre: torch.Tensor | None  # keys before RoPE (collected only when asked for)
    v: torch.Tensor
    scaling: float
    rope: RopeTable | None = None  # this layer's RoPE table
    sliding_window: int | None = None  # a sliding layer's window: a query sees only its last this-many keys
    softcap: float | None = None  # attention-logit soft-capping of the model (Gemma-2)


@dataclass
class Activations:
    layers: list[LayerActivations | None]  # None for layers without a KV cache of their own (not collected)
    inv_freq: torch.Tensor | None  # the first layer's RoPE table (every layer's: LayerActivations.rope)
    rope_scaling: float
    num_kv_heads: int
    head_dim: int
    tables: list[RopeTable] | None = None  # per layer


def rope_tables(model: Any) -> tuple[torch.Tensor, float]:
    """(inv_freq, attention_scaling) of the model's first layer; ValueError for models without RoPE."""
    t = model_rope_tables(model)[0]
    return t.inv_freq, t.attention_scaling


def _attention_softcapped(module, query, key, value, attention_mask, scaling, softcap, dropout=0.0, **kw):
    """Attention with logit soft-capping (SDPA has none): ``softcap * tanh(q k^T * scaling / softcap)``, the
    boolean SDPA mask (True = attend) or causal when None."""
    rep = query.shape[1] // key.shape[1]
    k, v = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    s = torch.matmul(query, k.transpose(-1, -2)) * scaling
    s = torch.tanh(s / softcap) * softcap
    if attention_mask is None:
        lq, lk = s.shape[-2:]
        attention_mask = torch.ones(lq, lk, dtype=torch.bool, device=s.device).tril(lk - lq)
    if attention_mask.dtype == torch.bool:
        s = s.masked_fill(~attention_mask, float("-inf"))
    else:
        s = s + attention_mask
    p = torch.softmax(s.float(), dim=-1).to(query.dtype)
    return torch.matmul(p, v).transpose(1, 2).contiguous(), None


@torch.no_grad()
def collect(model: Any, ids: torch.Tensor, progress: bool = True, pre_rope: bool = True) -> Activations:
    """Run the model over the calibration samples and keep, per layer and KV head, queries, keys after RoPE (and
    before, with ``pre_rope``: un-rotated with the layer's own table), and values.  Attention itself is
    transformers' SDPA (or the soft-capped form for models with attention-logit soft-capping), so the outputs are
    the model's own."""
    from tqdm.auto import tqdm

    from ..adapter import attention_override, sdpa_attention_forward
    from ..layout import kv_layout

    layout = kv_layout(model.config)
    text = model.config.get_text_config(decoder=True)
    softcap = getattr(text, "attn_logit_softcapping", None)
    tables = model_rope_tables(model) if pre_rope or has_rope(model.config) else None
    n, length = ids.shape
    cos_sin: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    store: dict[int, dict[str, list[torch.Tensor]]] = {}
    scal: dict[int, float] = {}

    def capture(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        i = module.layer_idx
        d = store.setdefault(i, {"q": [], "k": [], "k_pre": [], "v": []})
        d["q"].append(query.detach().float())
        d["k"].append(key.detach().float())
        if pre_rope:
            t = tables[i]
            if id(t) not in cos_sin:
                cos_sin[id(t)] = t.cos_sin(torch.arange(length))
            cos, sin = cos_sin[id(t)]
            d["k_pre"].append(undo_rope(key.detach().float(), cos.to(key.device), sin.to(key.device),
                                        t.attention_scaling))
        d["v"].append(value.detach().float())
        scal[i] = query.shape[-1] ** -0.5 if scaling is None else scaling
        if kw.get("softcap") is not None:
            return _attention_softcapped(module, query, key, value, attention_mask, scal[i], dropout=dropout, **kw)
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
        k_pre = torch.cat(d["k_pre"]) if pre_rope else None
        sliding = layout.sliding_window if layout.layer_types[i] == "sliding_attention" else None
        layers.append(LayerActivations(torch.cat(d["q"]), torch.cat(d["k"]), k_pre, torch.cat(d["v"]),
                                       scaling=scal[i], rope=None if tables is None else tables[i],
                                       sliding_window=sliding, softcap=softcap))
    first = None if tables is None else tables[0]
    return Activations(layers, None if first is None else first.inv_freq,
                       1.0 if first is None else first.attention_scaling, layout.num_kv_heads, layout.head_dim,
                       tables)
