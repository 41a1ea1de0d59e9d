"""What the engine peers (vLLM: :mod:`.vllm_peer`, llama.cpp: :mod:`.llamacpp_peer`) record alike: the random
prompts of a speed measurement and the perplexity record built from an engine's per-token negative
log-likelihoods, in the fields :func:`kvsqueeze.eval.ppl.run_ppl` writes for kvsqueeze's own caches."""

from __future__ import annotations

import math
from typing import Any

import torch


def speed_prompts(vocab: int, contexts: list[int], batch: int = 1, seed: int = 0) -> list[list[list[int]]]:
    """The random prompts kvsqueeze's speed measurement uses (:func:`kvsqueeze.eval.speed.measure_speed`), one
    batch per context."""
    sets = []
    for context in contexts:
        g = torch.Generator().manual_seed(seed)
        sets.append(torch.randint(0, vocab, (batch, context), generator=g).tolist())
    return sets


def ppl_record(peer: Any, engine: str, nll: list[torch.Tensor], context: int, footprint: dict[str, Any] | None,
               protocol_note: str, bytes_note: str) -> dict[str, Any]:
    """The all-quantized perplexity record of ``peer`` (``name``, ``quantized``, ``bits_per_element()``,
    ``settings()``, ``description``) from ``nll``, one float64 tensor of targets 1..context-1 per chunk;
    ``footprint``: the bytes of one chunk in the engine's cache (a :class:`~kvsqueeze.cache.accounting.KVFootprint`
    record), or None where they are not known; ``bytes_note``: how they were obtained."""
    total = float(sum(x.sum() for x in nll))
    count = sum(x.numel() for x in nll)
    bits = peer.bits_per_element()
    return {
        "kv": peer.name, "kind": "peer", "engine": engine,
        "ppl": math.exp(total / count), "nll_mean": total / count, "tokens_scored": count,
        "protocol": "all-quantized", "protocol_note": protocol_note,
        "context": context, "chunks": len(nll), "stride": context, "prefix": 0,
        "scored_positions": f"targets 1..{context - 1} of each chunk",
        "ppl_per_chunk": [math.exp(float(x.mean())) for x in nll],
        "bits_per_element": bits if footprint is None else footprint["bits_per_element"],
        "quantized_bits_per_element": (bits if peer.quantized else None) if footprint is None
        else footprint["quantized_bits_per_element"],
        **({} if footprint is None else {"kv_bytes": footprint, "kv_bytes_per_token": footprint["bytes_per_token"]}),
        "kv_bytes_measured_on": bytes_note, "spec": peer.settings(), "spec_label": peer.description,
    }
