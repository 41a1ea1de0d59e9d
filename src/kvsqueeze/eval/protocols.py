"""The perplexity protocols: which K/V each scored token's query sees.

Every function takes one chunk ``ids`` [1, T] and returns the negative log-likelihood (float64, nats) of the
target tokens ``start .. T-1`` where ``start = max(prefix, 1)``: target t is predicted from positions < t.

* ``decode``: prefill ``prefix`` tokens (``prefill_chunk`` tokens per forward pass, 0 = one pass), then feed the
  rest one token at a time through the real cache.  Exact for any cache (ours or a peer's), and slow.
* ``window``: one forward pass; the query at position t sees token j's exact K/V when j is a sink, in the
  full-precision window, or part of the current step, and the K/V the cache would have quantized otherwise,
  as the real cache stores it after ``t`` tokens (``spec.quantized_count``).  Queries before ``prefix`` belong to
  the prefill: they see the cache as it stood before their prefill chunk (everything exact for a one-pass
  prefill).  Equal to ``decode`` with the same prefix and prefill chunk (tested).
* ``all-quantized``: every token's K/V is quantized, the query's own token included, ignoring window and sinks
  (the KVQuant / llama.cpp protocol); see :data:`ALL_QUANTIZED_NOTE` for token-grouped layouts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from ..spec import DEFAULT_PREFILL_CHUNK, CacheSpec

PROTOCOLS = ("decode", "window", "all-quantized")
QUERY_BLOCK = 256  # queries scored per block: bounds the [queries x keys] score matrices
LOGIT_ROWS = 512  # positions sent through the LM head at a time: bounds the [positions x vocab] logits

WINDOW_NOTE = ("one forward pass per chunk; query t sees sinks, the full-precision window and its own token "
               "exact and every older token as the cache stores it after t tokens (spec.quantized_count(t)); "
               "queries before the prefix see the cache as it stood before their prefill chunk (all exact for a "
               "one-pass prefill); equal to the decode protocol")
DECODE_NOTE = ("prefill of the first `prefix` tokens (`prefill_chunk` tokens per forward pass, 0 = one pass), then "
               "one token per forward pass through the real cache; targets from the prefix on are scored")
ALL_QUANTIZED_NOTE = (
    "every key and value is quantized, the query's own token included; window and sinks are ignored. "
    "Per-token layouts are causal by construction. For groups spanning tokens (per-channel keys over G-token "
    "groups) each query sees the complete groups before it quantized with their own parameters and its own "
    "partial group quantized causally, with parameters computed from that group's tokens up to and including "
    "itself, so no query sees parameters computed from future tokens."
)
FP8_SHARED_SCALE_NOTE = (" fp8 with a per-head/per-tensor scale: the emulation takes the scale from the whole "
                         "chunk (the real cache fixes it from the first tokens), a mild look-ahead.")


def scored_start(prefix: int) -> int:
    """First scored target position: the token right after the prefix (position 0 has no prediction)."""
    return max(prefix, 1)


def check_prefix(prefix: int, length: int) -> None:
    if not 0 <= prefix < length - 1:
        raise ValueError(f"prefix must be in [0, {length - 2}] for chunks of {length} tokens, got {prefix}")


# ------------------------------------------------------------------------------------------------ scoring
def _nll(model: Any, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """NLL of ``targets`` [N] from final hidden states [N, H], a few hundred rows at a time through the head."""
    head = model.get_output_embeddings()
    cap = getattr(model.config.get_text_config(decoder=True), "final_logit_softcapping", None)
    out = []
    for r in range(0, hidden.shape[0], LOGIT_ROWS):
        logits = head(hidden[r:r + LOGIT_ROWS]).float()
        if cap:
            logits = cap * torch.tanh(logits / cap)
        out.append(F.cross_entropy(logits, targets[r:r + LOGIT_ROWS], reduction="none"))
    return torch.cat(out).double()


def _hidden(model: Any, ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    return model.base_model(input_ids=ids, **kwargs).last_hidden_state


@torch.no_grad()
def nll_reference(model: Any, ids: torch.Tensor, prefix: int = 0) -> torch.Tensor:
    """The model's own attention, no cache: the full-precision reference."""
    check_prefix(prefix, ids.shape[1])
    s = scored_start(prefix)
    h = _hidden(model, ids, use_cache=False)[0]
    return _nll(model, h[s - 1:-1], ids[0, s:])


@torch.no_grad()
def nll_decode(model: Any, ids: torch.Tensor, cache: Any, prefix: int,
               prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> torch.Tensor:
    """Prefill ``max(prefix, 1)`` tokens into ``cache`` (any cache, ours or a peer's; ``prefill_chunk`` tokens per
    pass, 0 = one pass), then one token per step; score each next token."""
    from ..adapter import cache_kwargs
    from .peers import prefill

    check_prefix(prefix, ids.shape[1])
    s = scored_start(prefix)
    rows = [prefill(model, ids[:, :s], cache, prefill_chunk)]
    for t in range(s, ids.shape[1] - 1):
        rows.append(_hidden(model, ids[:, t:t + 1], **cache_kwargs(model.base_model, cache), use_cache=True)[0, -1:])
    return _nll(model, torch.cat(rows), ids[0, s:])


@torch.no_grad()
def nll_window(model: Any, ids: torch.Tensor, spec: CacheSpec, prefix: int = 0,
               prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> torch.Tensor:
    """The window protocol: one pass, each query seeing what kvsqueeze's cache would give it (the prefix
    prefilled ``prefill_chunk`` tokens per pass, 0 = one pass)."""
    check_prefix(prefix, ids.shape[1])
    layer_specs = _layer_specs(model, spec)
    committed = committed_tokens(ids.shape[1], prefix, prefill_chunk)

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        out = window_attend(query, key, value, attention_mask, _scaling(query, scaling),
                            layer_specs[module.layer_idx], committed, kw.get("softcap"))
        return out.transpose(1, 2).contiguous(), None  # transformers' attention functions return [B, T, H, D]

    return _scored_pass(model, ids, attend, prefix)


@torch.no_grad()
def nll_all_quantized(model: Any, ids: torch.Tensor, spec: CacheSpec) -> torch.Tensor:
    """The all-quantized protocol: one pass, every key and value quantized (see :data:`ALL_QUANTIZED_NOTE`)."""
    layer_specs = _layer_specs(model, spec)

    def attend(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        out = all_quantized_attend(query, key, value, attention_mask, _scaling(query, scaling),
                                   layer_specs[module.layer_idx], kw.get("softcap"))
        return out.transpose(1, 2).contiguous(), None

    return _scored_pass(model, ids, attend, 0)


def committed_tokens(length: int, prefix: int, prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> list[int]:
    """Tokens the cache holds when the query at each position runs: during the prefill of the first
    ``scored_start(prefix)`` tokens, those of the chunks before its own (none for a one-pass prefill); then one
    token per step."""
    s = scored_start(prefix)
    return [(i // prefill_chunk * prefill_chunk if prefill_chunk else 0) if i < s else i for i in range(length)]


def window_attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                  scaling: float, spec: CacheSpec, committed: list[int], softcap: float | None = None
                  ) -> torch.Tensor:
    """One layer of the window protocol: [B, Hq, T, D] out; ``committed[t]`` = tokens stored when query t ran.
    ``softcap``: the model's attention-logit soft-capping, if any."""
    if not spec.quantized:
        return _dense(query, key, value, mask, scaling, softcap)
    from ..cache.emulate import fake_quantize_cache, quantized_mask

    k_hat, v_hat = fake_quantize_cache(key, value, spec)
    quant = quantized_mask(spec.window, spec.sinks, spec.flush_tokens, torch.tensor(committed, device=key.device),
                           key.shape[2])  # [T, T]: query t sees key j quantized

    def sources(t0: int, t1: int) -> list[Source]:
        base, qm = _allowed(mask, t0, t1, key.device), quant[t0:t1, :t1]
        return [(key[:, :, :t1], value[:, :, :t1], base & ~qm), (k_hat[:, :, :t1], v_hat[:, :, :t1], base & qm)]

    return _blocked(query, scaling, sources, softcap)


def all_quantized_attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                         scaling: float, spec: CacheSpec, softcap: float | None = None) -> torch.Tensor:
    """One layer of the all-quantized protocol (window and sinks of ``spec`` ignored): [B, Hq, T, D] out."""
    if not spec.quantized:
        return _dense(query, key, value, mask, scaling, softcap)
    from ..cache.emulate import fake_quantize_cache

    spec = dataclasses.replace(spec, window=0, sinks=0)
    k_hat, v_hat = fake_quantize_cache(key, value, spec)  # complete token groups quantized
    g = spec.flush_tokens
    if g == 1:  # per-token layouts: every token quantized, plain causal attention over them
        return _dense(query, k_hat, v_hat, mask, scaling, softcap)
    k_own, v_own = _causal_partial_groups(key, value, spec)
    pos = torch.arange(key.shape[2], device=key.device)
    g0 = pos // g * g  # first token of each query's own group

    def sources(t0: int, t1: int) -> list[Source]:
        base = _allowed(mask, t0, t1, key.device)  # [B|1, 1, q, t1]
        prev = base & (pos[None, :t1] < g0[t0:t1, None])
        cols = g0[t0:t1, None] + torch.arange(g, device=key.device)[None, :]  # [q, G]: the own group's tokens
        own = (cols <= pos[t0:t1, None]) & base.gather(-1, cols.clamp_max(t1 - 1).expand(base.shape[0], 1, -1, -1))
        return [(k_hat[:, :, :t1], v_hat[:, :, :t1], prev), (k_own[:, :, t0:t1], v_own[:, :, t0:t1], own)]

    return _blocked(query, scaling, sources, softcap)


def protocol_note(protocol: str, spec: CacheSpec | None) -> str:
    note = {"decode": DECODE_NOTE, "window": WINDOW_NOTE, "all-quantized": ALL_QUANTIZED_NOTE}[protocol]
    if spec is not None and protocol != "decode" and any(
            q.quantized and q.fmt != "int" and q.fp8_scale != "token" for q in (spec.key, spec.value)):
        note += FP8_SHARED_SCALE_NOTE
    return note


# ------------------------------------------------------------------------------------------------ helpers
def _layer_specs(model: Any, spec: CacheSpec) -> list[CacheSpec]:
    """The spec each layer of the real cache uses (sliding layers may stay unquantized): read from a real,
    empty cache so the emulation can never disagree with it about which layers are quantized."""
    from ..adapter import QuantizedCache

    return [layer.spec for layer in QuantizedCache(model.config, spec).layers]


def _scored_pass(model: Any, ids: torch.Tensor, attend: Callable, prefix: int) -> torch.Tensor:
    from ..adapter import attention_override

    s = scored_start(prefix)
    with attention_override(model, attend):
        h = _hidden(model, ids, use_cache=False)[0]
    return _nll(model, h[s - 1:-1], ids[0, s:])


def _allowed(mask: torch.Tensor | None, t0: int, t1: int, device: torch.device | None = None) -> torch.Tensor:
    """Boolean [B|1, 1, t1-t0, t1]: which keys 0..t1-1 queries t0..t1-1 may attend to (True = attend)."""
    if mask is None:
        q = torch.arange(t0, t1, device=device)
        return (torch.arange(t1, device=device)[None, :] <= q[:, None])[None, None]
    blk = mask[:, :, t0:t1, :t1]
    if blk.dtype != torch.bool:  # additive float mask: 0 = attend, very negative = blocked
        blk = blk > torch.finfo(blk.dtype).min / 2
    return blk


Source = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _blocked(query: torch.Tensor, scaling: float,
             sources: Callable[[int, int], list[Source]], softcap: float | None = None) -> torch.Tensor:
    """Attention for query blocks; ``sources(t0, t1)`` gives the (keys, values, allowed) the block attends to."""
    t = query.shape[2]
    out = [_attend(query[:, :, t0:min(t0 + QUERY_BLOCK, t)], scaling, sources(t0, min(t0 + QUERY_BLOCK, t)), softcap)
           for t0 in range(0, t, QUERY_BLOCK)]
    return torch.cat(out, dim=2)


def _attend(query: torch.Tensor, scaling: float, sources: list[Source], softcap: float | None = None
            ) -> torch.Tensor:
    """One softmax over several key sources.

    keys/values are [B, Hkv, L, D] (shared by all queries) or [B, Hkv, Tq, L, D] (one set per query);
    allowed is bool, broadcastable to [B, 1, Tq, L].  Query heads are grouped by KV head (GQA)."""
    b, hq, tq, d = query.shape
    hkv = sources[0][0].shape[1]
    q = query.float().reshape(b, hkv, hq // hkv, tq, d)
    scores = []
    for k, _, allowed in sources:
        s = (torch.einsum("bhrtd,bhtld->bhrtl", q, k.float()) if k.dim() == 5
             else torch.matmul(q, k.float().unsqueeze(2).transpose(-1, -2)))
        s = s * scaling
        if softcap is not None:  # Gemma-2's attention-logit soft-capping
            s = torch.tanh(s / softcap) * softcap
        scores.append(s.masked_fill(~allowed.unsqueeze(2), float("-inf")))
    p = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
    out = torch.zeros_like(q)
    col = 0
    for (_, v, _), s in zip(sources, scores):
        ps = p[..., col:col + s.shape[-1]]
        col += s.shape[-1]
        out += (torch.einsum("bhrtl,bhtld->bhrtd", ps, v.float()) if v.dim() == 5
                else torch.matmul(ps, v.float().unsqueeze(2)))
    return out.reshape(b, hq, tq, d).to(query.dtype)


def _dense(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
           scaling: float, softcap: float | None = None) -> torch.Tensor:
    return _blocked(query, scaling, lambda t0, t1: [(key[:, :, :t1], value[:, :, :t1],
                                                     _allowed(mask, t0, t1, key.device))], softcap)


def _scaling(query: torch.Tensor, scaling: float | None) -> float:
    return query.shape[-1] ** -0.5 if scaling is None else scaling


def _causal_partial_groups(k: torch.Tensor, v: torch.Tensor, spec: CacheSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """For each query t: its own token group, tokens g0..g0+G-1, quantized with parameters computed from the
    tokens g0..t only.  Returns [B, H, T, G, D] for keys and values (entries past t are unused)."""
    g = spec.flush_tokens
    return _own_group(k, spec.key, g, "key"), _own_group(v, spec.value, g, "value")


def _own_group(x: torch.Tensor, q: Any, g: int, side: str) -> torch.Tensor:
    """One side (keys or values) of :func:`_causal_partial_groups`."""
    from ..cache.emulate import fake_quantize_cache

    def fq(t: torch.Tensor, qs: Any, block: int) -> torch.Tensor:  # quantize this side only
        cs = CacheSpec(**{side: qs}, block_tokens=block)
        return fake_quantize_cache(t, t, cs)[0 if side == "key" else 1]

    b, h, n, d = x.shape
    n_groups = -(-n // g)
    xp = F.pad(x, (0, 0, 0, n_groups * g - n)).view(b, h, n_groups, g, d)
    i = torch.arange(g, device=x.device)
    upto = i[None, :] <= i[:, None]  # [r, i]: token i of the group is visible to the query at offset r
    if q.token_group == 1:  # per-token layout: every token quantized on its own, the same for every query
        xq = fq(xp.reshape(b, h, -1, d), q, 1).view(b, h, n_groups, 1, g, d)
        return xq.expand(b, h, n_groups, g, g, d).reshape(b, h, n_groups * g, g, d)[:, :, :n]
    if _range_based(q):
        # One pass: for each prefix length r+1, a full group of G tokens whose positions past r repeat the
        # group's first token.  Parameters come from the group's range, which the repeats do not change, so
        # every prefix is quantized exactly as a group of its own tokens would be.
        idx = torch.where(upto, i[None, :], 0)
        xq = fq(xp[:, :, :, idx].reshape(b, h, -1, d), q, g)
        return xq.view(b, h, n_groups * g, g, d)[:, :, :n]
    by_len = []
    for r in range(1, g + 1):  # otherwise: every group truncated to its first r tokens, quantized as groups of r
        xq = fq(xp[:, :, :, :r].reshape(b, h, -1, d), _regroup(q, r), r)
        by_len.append(F.pad(xq.view(b, h, n_groups, r, d), (0, 0, 0, g - r)))
    # [B, H, nG, G(r), G(i), D] -> one row per query t = group * G + r
    return torch.stack(by_len, dim=3).reshape(b, h, n_groups * g, g, d)[:, :, :n]


def _range_based(q: Any) -> bool:
    """Whether a group's parameters depend only on its min/max (or absmax): then repeating a token of the group
    leaves them unchanged.  Per-token layouts qualify trivially (their groups never span tokens)."""
    return q.token_group == 1 or (q.fmt == "int" and not (q.symmetric and q.bits == 1)
                                  and getattr(q, "extras", None) is None)


def _regroup(q: Any, tokens: int) -> Any:
    """The same QuantSpec with token groups of ``tokens`` (per-token layouts are unchanged)."""
    return dataclasses.replace(q, group=tokens) if q.token_group > 1 else q
