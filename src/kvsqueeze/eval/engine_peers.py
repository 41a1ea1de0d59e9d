"""Peers that run the model in an engine of their own - vLLM (``vllm:*``, in its own process) and llama.cpp
(``llamacpp:*``, through its Python bindings) - measured on the same chunks and prompts as kvsqueeze's caches.

They have no full-precision window (every token's K/V goes through their cache), so their perplexity is the
all-quantized protocol only, and their bytes are computed from their storage types.  Each family lives in its
own module (:mod:`.vllm_peer`, :mod:`.llamacpp_peer`); the commands, the bench and the frontier reach them
through the functions here, which pick the family's module.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from . import llamacpp_peer, vllm_peer

# the engine's own unquantized cache, per name prefix: the second reference of its quantized rows (its weights or
# kernels differ from the model kvsqueeze runs, so its loss is read against its own full-precision cache)
REFERENCES = {vllm_peer.PREFIX: "vllm:auto", llamacpp_peer.PREFIX: llamacpp_peer.REFERENCE}


def is_engine(kv: Any) -> bool:
    return vllm_peer.is_vllm(kv) or llamacpp_peer.is_llamacpp(kv)


def _module(kv: Any):
    return vllm_peer if vllm_peer.is_vllm(kv) else llamacpp_peer


def reference_of(name: str) -> str | None:
    """The engine's unquantized cache for a peer name (``vllm:fp8_e4m3`` -> ``vllm:auto``), or None."""
    return next((ref for prefix, ref in REFERENCES.items() if name.startswith(prefix)), None)


def check_protocol(kv: Any, protocol: str) -> None:
    _module(kv).check_protocol(kv, protocol)


def not_applicable(kv: Any) -> dict[str, str]:
    """The bench cells the peer cannot fill, and why."""
    engine = "vLLM" if vllm_peer.is_vllm(kv) else "llama.cpp"
    return {**_module(kv).NOT_APPLICABLE, "retrieval": f"not run through {engine}"}


def check_model(kv: Any, model_source: str | Path | None) -> None:
    """One line now unless the engine can load ``--model`` (vLLM: a Hugging Face directory; llama.cpp: a GGUF)."""
    if vllm_peer.is_vllm(kv):
        vllm_peer.model_dir(model_source)
    else:
        llamacpp_peer.gguf_path(model_source)


def check_runs_here(peers: list[Any]) -> None:
    """vLLM's KV dtypes checked against the vLLM installed (one child process); llama.cpp needs no check."""
    vllm_peer.check_runs_here([p for p in peers if vllm_peer.is_vllm(p)])


def run_ppl(kv: Any, chunks: torch.Tensor, model_source: str | Path | None, threads: int = 1, progress: Any = None,
            layout: dict[str, Any] | None = None, vocab: int | None = None) -> dict[str, Any]:
    """All-quantized perplexity of ``chunks`` through the peer's engine (the record of ``eval.ppl.run_ppl``)."""
    if vllm_peer.is_vllm(kv):
        return vllm_peer.run_ppl(kv, chunks, model_source, threads, progress, layout)
    return llamacpp_peer.run_ppl(kv, chunks, model_source, threads, progress, layout, vocab)


def measure_speed(kv: Any, model_source: str | Path | None, vocab: int, context: int, decode_tokens: int,
                  batch: int = 1, threads: int = 1, layout: dict[str, Any] | None = None) -> dict[str, Any]:
    return _module(kv).measure_speed(kv, model_source, vocab, context, decode_tokens, batch, threads,
                                     layout=layout)


def measure(kv: Any, chunks: torch.Tensor | None, model_source: str | Path | None, vocab: int, contexts: list[int],
            decode_tokens: int, threads: int = 1, layout: dict[str, Any] | None = None,
            ) -> tuple[dict[str, Any] | None, dict[int, dict[str, Any]]]:
    """For the bench: perplexity of ``chunks`` (None: none) and speed at each context (batch 1)."""
    if vllm_peer.is_vllm(kv):  # one engine start for both
        return vllm_peer.measure(kv, chunks, model_source, vocab, contexts, decode_tokens, threads, layout)
    ppl = None if chunks is None else llamacpp_peer.run_ppl(kv, chunks, model_source, threads, layout=layout,
                                                            vocab=vocab)
    speed = {c: llamacpp_peer.measure_speed(kv, model_source, vocab, c, decode_tokens, 1, threads, layout=layout)
             for c in contexts}
    return ppl, speed
