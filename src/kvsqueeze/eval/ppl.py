"""Perplexity of one cache under one protocol over evaluation chunks, with everything needed to reproduce it."""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import torch

from ..resolve import resolve_kv
from ..spec import DEFAULT_PREFILL_CHUNK, CacheSpec
from .engine_peers import check_protocol as check_engine_protocol
from .engine_peers import is_engine
from .peers import Peer, footprint, make_cache, prefill
from .protocols import PROTOCOLS, nll_all_quantized, nll_decode, nll_window, protocol_note, scored_start


def default_prefix(protocol: str, context: int) -> int:
    """decode: half the chunk is prefilled (one step per remaining token is slow); window and all-quantized
    score the whole chunk from its second token."""
    return context // 2 if protocol == "decode" else 0


def check_protocol(kv: Any, protocol: str, prefix: int, context: int) -> None:
    """``kv``: a CacheSpec, a transformers peer or an engine peer (vLLM, llama.cpp)."""
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; allowed: {', '.join(PROTOCOLS)}")
    if is_engine(kv):
        check_engine_protocol(kv, protocol)
    if isinstance(kv, Peer) and protocol != "decode":
        raise ValueError(f"the peer {kv.name} can only be measured with --protocol decode: the window and "
                         f"all-quantized protocols emulate kvsqueeze's own storage")
    if protocol == "all-quantized" and prefix:
        raise ValueError("the all-quantized protocol quantizes every token and takes no --prefix")
    if not 0 <= prefix < context - 1:
        raise ValueError(f"--prefix must be in [0, {context - 2}] for --context {context}, got {prefix}")


def stored_spec(kv: CacheSpec | Peer, protocol: str) -> CacheSpec | Peer:
    """The storage a protocol measures: all-quantized is the spec with no window and no sinks."""
    if isinstance(kv, CacheSpec) and protocol == "all-quantized":
        return dataclasses.replace(kv, window=0, sinks=0, name=f"{kv.name} (no window, no sinks)")
    return kv


@torch.no_grad()
def measure_footprint(model: Any, kv: CacheSpec | Peer, chunk: torch.Tensor,
                      prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> dict[str, Any]:
    """Bytes of the real cache after a prefill of one chunk [1, T]."""
    cache = make_cache(model, kv if isinstance(kv, CacheSpec) else kv.name)
    prefill(model, chunk, cache, prefill_chunk)
    return footprint(cache).as_dict()


def run_ppl(model: Any, chunks: torch.Tensor, kv_name: str, protocol: str, prefix: int | None = None,
            progress: Any = None, footprints: dict[str, dict[str, Any]] | None = None,
            prefill_chunk: int = DEFAULT_PREFILL_CHUNK) -> dict[str, Any]:
    """Perplexity of ``kv_name`` on ``chunks`` [N, T].  ``footprints`` memoizes the byte measurement per
    stored layout across calls.  ``prefill_chunk``: prefix tokens per forward pass (decode and window protocols;
    0 = one pass)."""
    kv = resolve_kv(kv_name)
    n_chunks, context = chunks.shape
    prefix = default_prefix(protocol, context) if prefix is None else prefix
    check_protocol(kv, protocol, prefix, context)
    start = time.perf_counter()
    nll_sum, count, per_chunk = 0.0, 0, []
    cache = None
    for i in range(n_chunks):
        ids = chunks[i:i + 1]
        if protocol == "decode":
            cache = make_cache(model, kv_name)
            nll = nll_decode(model, ids, cache, prefix, prefill_chunk)
        elif protocol == "window":
            nll = nll_window(model, ids, kv, prefix, prefill_chunk)
        else:
            nll = nll_all_quantized(model, ids, kv)
        nll_sum += float(nll.sum())
        count += nll.numel()
        per_chunk.append(math.exp(float(nll.mean())))
        if progress is not None:
            progress.update(1)
    stored = stored_spec(kv, protocol)
    if protocol == "decode":
        kv_bytes, measured_on = footprint(cache).as_dict(), "the real cache at the end of the last chunk"
    else:
        footprints = {} if footprints is None else footprints
        if repr(stored) not in footprints:
            footprints[repr(stored)] = measure_footprint(model, stored, chunks[:1], prefill_chunk)
        kv_bytes = footprints[repr(stored)]
        measured_on = f"the real cache after a prefill of one chunk ({context} tokens)"
    spec = kv if isinstance(kv, CacheSpec) else None
    return {
        "kv": kv_name,
        "kind": "peer" if isinstance(kv, Peer) else "preset",
        "ppl": math.exp(nll_sum / count),
        "nll_mean": nll_sum / count,
        "tokens_scored": count,
        "protocol": protocol,
        "protocol_note": protocol_note(protocol, spec),
        "context": context,
        "chunks": n_chunks,
        "stride": context,
        "prefix": prefix,
        "prefill_chunk": prefill_chunk if protocol != "all-quantized" else None,
        "scored_positions": f"targets {scored_start(prefix)}..{context - 1} of each chunk",
        "ppl_per_chunk": per_chunk,
        "kv_bytes": kv_bytes,
        "bits_per_element": kv_bytes["bits_per_element"],
        "quantized_bits_per_element": kv_bytes["quantized_bits_per_element"],
        "kv_bytes_per_token": kv_bytes["bytes_per_token"],
        "kv_bytes_measured_on": measured_on,
        "spec": stored.to_dict() if isinstance(stored, CacheSpec) else stored.settings(),
        "spec_label": stored.label() if isinstance(stored, CacheSpec) else stored.description,
        "seconds": time.perf_counter() - start,
    }
