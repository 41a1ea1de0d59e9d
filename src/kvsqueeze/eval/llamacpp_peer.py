"""The llama.cpp peer: ``--kv llamacpp:<type>`` (both sides) or ``llamacpp:<type_k>-<type_v>`` measures llama.cpp's
own KV cache types (its ``-ctk`` / ``-ctv``: ``f16``, ``q8_0``, ``q5_1``, ``q5_0``, ``q4_1``, ``q4_0``, ``iq4_nl``,
...) beside kvsqueeze's caches, on the same chunks (the same token ids) and the same random prompts.

llama.cpp runs in this process through llama-cpp-python, on the GGUF file itself (the embedded model's, or
``--model X.gguf``): with the weights as the file stores them (the embedded model's are Q4_1), not the float
checkpoint transformers runs, so its rows compare with its own unquantized cache ``llamacpp:f16`` (as vLLM's rows
with ``vllm:auto``).  Perplexity: each chunk is evaluated in one call; llama.cpp copies every micro-batch's K/V
into its cache, converting them to the cache type, and then attends over the cache (``build_attn`` in its
src/llama-graph.cpp: ``cpy_k`` then ``get_k``), so every token's K/V is read quantized, its own included:
kvsqueeze's ``all-quantized`` protocol (``window`` and ``decode`` are refused).  Recent llama.cpp (the one
llama-cpp-python 0.3.36 vendors) also rotates queries and keys, and values, by a Hadamard matrix before a quantized
cache stores them (head_dim a multiple of 64; ``LLAMA_ATTN_ROT_DISABLE=1`` turns it off): every record says which.
Flash attention is on for every row (llama.cpp needs it for a quantized V cache), so rows differ only in the cache
type.  Bytes are computed from ggml's block layouts (ggml-common.h: 32 elements per block, an fp16 scale, and an
fp16 minimum for the ``_1`` types), as llama.cpp allocates them; nothing here is measured from its process memory.

This is the only module that imports ``llama_cpp``.
"""

from __future__ import annotations

import importlib.util
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..cache.accounting import KVFootprint
from ..errors import UnknownCacheError, UnsupportedCacheError
from ..resolve import register_peer_family
from .engine_records import ppl_record, speed_prompts

PREFIX = "llamacpp:"
# the cache types llama.cpp's tools accept (common/arg.cpp, kv_cache_types): (elements per block, bytes per block)
TYPES = {"f32": (1, 4), "f16": (1, 2), "bf16": (1, 2), "q8_0": (32, 34), "q5_1": (32, 24), "q5_0": (32, 22),
         "q4_1": (32, 20), "q4_0": (32, 18), "iq4_nl": (32, 18)}
FULL_PRECISION = ("f32", "f16", "bf16")
REFERENCE = PREFIX + "f16"  # llama.cpp's default cache: the reference of its quantized rows
INSTALL_HINT = ("pip install -e \".[llamacpp]\" (or pip install llama-cpp-python): it builds llama.cpp from source "
                "with cmake and a C++ compiler, a few minutes (README: llama.cpp)")
# bench cells a llama.cpp peer cannot fill, and why
NOT_APPLICABLE = {"window": "llama.cpp quantizes every token", "decode": "llama.cpp quantizes every token",
                  "peak_rss": "llama.cpp's memory is not split from this process's"}
UBATCH = 512  # llama.cpp's default micro-batch
# ggml.h's type ids the Python bindings do not name (llama-cpp-python 0.3.36 has no GGML_TYPE_BF16)
_GGML_IDS = {"bf16": 30}


@dataclass(frozen=True)
class LlamaCppPeer:
    type_k: str
    type_v: str

    @property
    def name(self) -> str:
        return PREFIX + (self.type_k if self.type_k == self.type_v else f"{self.type_k}-{self.type_v}")

    @property
    def description(self) -> str:
        return (f"llama.cpp, KV cache type_k={self.type_k} type_v={self.type_v} (its own GGUF weights, flash "
                f"attention)")

    @property
    def requires(self) -> tuple[str, str]:
        return ("llama_cpp", "llama-cpp-python")

    @property
    def available(self) -> bool:
        return importlib.util.find_spec("llama_cpp") is not None

    @property
    def install_hint(self) -> str:
        return INSTALL_HINT

    def settings(self) -> dict[str, Any]:
        return {"backend": "llama.cpp", "type_k": self.type_k, "type_v": self.type_v, "flash_attn": True,
                "hadamard_rotation": rotation_note(), "description": self.description}

    def side_bits(self, side: str) -> float:
        block, nbytes = TYPES[self.type_k if side == "k" else self.type_v]
        return 8 * nbytes / block

    def bits_per_element(self, head_dim: int | None = None) -> float:
        """Bits per K/V element, every block's scale (and minimum) counted: keys and values hold as many."""
        return (self.side_bits("k") + self.side_bits("v")) / 2

    @property
    def quantized(self) -> bool:
        return self.type_k not in FULL_PRECISION or self.type_v not in FULL_PRECISION


def make_peer(name: str) -> LlamaCppPeer:
    body = name[len(PREFIX):]
    parts = body.split("-")
    if len(parts) not in (1, 2) or any(p not in TYPES for p in parts):
        raise UnknownCacheError(f"unknown llama.cpp KV cache type in {name!r}; allowed: "
                                f"{', '.join(PREFIX + t for t in TYPES)}, or {PREFIX}<type_k>-<type_v> "
                                f"(e.g. {PREFIX}q8_0-q4_0)")
    return LlamaCppPeer(parts[0], parts[-1])


register_peer_family(PREFIX, make_peer)


def rotation_note() -> str:
    """Whether llama.cpp rotates quantized K/V here (its default, or off by its environment variable)."""
    off = os.environ.get("LLAMA_ATTN_ROT_DISABLE", "").strip() not in ("", "0")
    return ("off (LLAMA_ATTN_ROT_DISABLE)" if off else
            "llama.cpp's default: on for quantized types where head_dim is a multiple of 64 (versions that have it)")


def is_llamacpp(kv: Any) -> bool:
    return isinstance(kv, LlamaCppPeer)


def check_protocol(peer: LlamaCppPeer, protocol: str) -> None:
    if protocol != "all-quantized":
        raise UnsupportedCacheError(f"{peer.name} can only be measured with --protocol all-quantized: llama.cpp "
                                    f"reads every token's K/V back from its cache, so there is no full-precision "
                                    f"window ({protocol}) to emulate")


def gguf_path(model_source: str | Path | None) -> Path:
    """The GGUF file llama.cpp loads for ``--model`` (None: the embedded model's); one line for anything else."""
    from ..models import embedded_gguf_path

    if model_source is None:
        return embedded_gguf_path()
    path = Path(model_source).expanduser()
    if path.suffix.lower() != ".gguf" or not path.is_file():
        raise UnsupportedCacheError(f"llama.cpp peers load a .gguf file: --model X.gguf or the embedded model; "
                                    f"{model_source} is not a .gguf file")
    return path


def _engine(path: Path, n_ctx: int, peer: LlamaCppPeer, threads: int, logits_all: bool = True):
    import llama_cpp

    kinds = {t: getattr(llama_cpp, f"GGML_TYPE_{t.upper()}", _GGML_IDS.get(t)) for t in (peer.type_k, peer.type_v)}
    try:
        return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=min(n_ctx, UBATCH),
                               n_threads=threads, n_threads_batch=threads, n_gpu_layers=0, flash_attn=True,
                               type_k=kinds[peer.type_k], type_v=kinds[peer.type_v], logits_all=logits_all,
                               seed=0, verbose=False)
    except (ValueError, RuntimeError) as exc:  # a file llama.cpp cannot load, a context it refuses: one line
        raise UnsupportedCacheError(f"{peer.name}: llama.cpp could not set up {path.name} with {n_ctx} tokens of "
                                    f"context ({' '.join(str(exc).split())})") from exc


def engine_name() -> str:
    import llama_cpp

    return f"llama.cpp (llama-cpp-python {llama_cpp.__version__})"


def system_info() -> str:
    """The CPU features llama.cpp was built with and uses (its own report: AVX2 = 1 | AVX512_VNNI = 1 | ...)."""
    import llama_cpp

    return " ".join(llama_cpp.llama_print_system_info().decode(errors="replace").split())


def _check_vocab(llm: Any, vocab: int | None) -> None:
    if vocab is not None and llm.n_vocab() != vocab:
        raise UnsupportedCacheError(f"llama.cpp's vocabulary of this GGUF has {llm.n_vocab()} tokens, the model "
                                    f"kvsqueeze tokenized with has {vocab}: not the same model")


def kv_bytes(peer: LlamaCppPeer, layout: dict[str, Any], tokens: int, batch: int = 1) -> dict[str, Any]:
    """Bytes of ``tokens`` tokens x ``batch`` sequences in llama.cpp's cache, computed from the types' blocks (a
    block's scale and minimum counted with its codes): layers x kv_heads x head_dim x tokens per side.  Every
    layer holds every token (an upper bound for sliding-window layers).  Same keys as the in-process footprint
    records (:meth:`kvsqueeze.cache.accounting.KVFootprint.as_dict`)."""
    per_side = tokens * batch * layout["num_layers"] * layout["num_kv_heads"] * layout["head_dim"]
    data = {s: round(per_side * peer.side_bits(s) / 8) for s in ("k", "v")}
    quant = {s: (peer.type_k if s == "k" else peer.type_v) not in FULL_PRECISION for s in ("k", "v")}
    totals = KVFootprint(sum(data[s] for s in data if quant[s]), 0, sum(data[s] for s in data if not quant[s]),
                         2 * per_side, per_side * sum(quant.values()), tokens, batch)
    return {**totals.as_dict(),
            "method": "computed from ggml's block layouts (scales and minimums counted with the codes)"}


def _nll(logits: Any, ids: list[int]) -> torch.Tensor:
    """Negative log-likelihood of targets 1..T-1 from llama.cpp's logits [T, vocab] (float32 numpy)."""
    scores = torch.from_numpy(logits[: len(ids) - 1])
    targets = torch.tensor(ids[1:], dtype=torch.long)
    return -torch.log_softmax(scores.float(), dim=-1).gather(1, targets[:, None])[:, 0].double()


def run_ppl(peer: LlamaCppPeer, chunks: torch.Tensor, model_source: str | Path | None, threads: int = 1,
            progress: Any = None, layout: dict[str, Any] | None = None, vocab: int | None = None) -> dict[str, Any]:
    """Perplexity of ``chunks`` [N, T] through llama.cpp with this peer's cache types (all-quantized protocol),
    as :func:`kvsqueeze.eval.ppl.run_ppl` reports it for kvsqueeze's caches; with the model's KV ``layout``
    (:func:`kvsqueeze.layout.model_kv_layout`) also the bytes of one chunk in llama.cpp's cache, computed."""
    start = time.perf_counter()
    context = chunks.shape[1]
    llm = _engine(gguf_path(model_source), context, peer, threads)
    _check_vocab(llm, vocab)
    nll = []
    try:
        for row in chunks.tolist():
            llm.reset()
            llm.eval(row)
            nll.append(_nll(llm.scores, row))
            if progress is not None:
                progress.update(1)
    except RuntimeError as exc:  # llama_decode failed (llama-cpp-python raises it): one line, the bench goes on
        raise UnsupportedCacheError(f"{peer.name}: llama.cpp failed to evaluate a chunk ({exc})") from exc
    finally:
        llm.close()
    footprint = None if layout is None else kv_bytes(peer, layout, context)
    note = "not measured: computed from ggml's block layouts" + ("" if footprint is None else f", {context} tokens")
    return {**ppl_record(peer, engine_name(), nll, context, footprint,
                         "llama.cpp: every micro-batch's K/V copied into its cache (converted to the cache type) "
                         "and read back from it by attention", note),
            "seconds": time.perf_counter() - start, "llama_cpp_system_info": system_info()}


def measure_speed(peer: LlamaCppPeer, model_source: str | Path | None, vocab: int, context: int,
                  decode_tokens: int, batch: int = 1, threads: int = 1, seed: int = 0,
                  layout: dict[str, Any] | None = None) -> dict[str, Any]:
    """Prefill seconds and greedy decode ms/token (median step) of a random prompt - the ids kvsqueeze's speed
    measurement uses (:func:`kvsqueeze.eval.engine_records.speed_prompts`) - through llama.cpp, one sequence."""
    if batch != 1:
        raise UnsupportedCacheError(f"{peer.name}: llama.cpp peers decode one sequence (--batch 1), got --batch "
                                    f"{batch}")
    prompt = speed_prompts(vocab, [context], 1, seed)[0][0]
    llm = _engine(gguf_path(model_source), context + decode_tokens, peer, threads, logits_all=False)
    _check_vocab(llm, vocab)

    def step(tokens: list[int]) -> int:
        llm.eval(tokens)  # with logits_all off llama.cpp computes the last token's logits only
        return _argmax(llm._ctx.get_logits_ith(-1), llm.n_vocab())

    steps = []
    try:
        t = time.perf_counter()
        token = step(prompt)
        prefill_s = time.perf_counter() - t
        for _ in range(decode_tokens):
            t = time.perf_counter()
            token = step([token])
            steps.append(time.perf_counter() - t)
    except RuntimeError as exc:
        raise UnsupportedCacheError(f"{peer.name}: llama.cpp failed to decode ({exc})") from exc
    finally:
        llm.close()
    steps.sort()
    footprint = None if layout is None else kv_bytes(peer, layout, context + decode_tokens)
    return {
        "kv": peer.name, "engine": engine_name(), "context": context, "decode_tokens": decode_tokens, "batch": 1,
        "prefill_s": prefill_s, "prefill_tokens_per_s": context / prefill_s,
        "decode_ms_per_token": 1e3 * steps[len(steps) // 2], "decode_s": sum(steps),
        "prefill_note": "one llama.cpp eval of the prompt, its last logits included",
        "decode_note": "median of the greedy decode steps (one eval of one token each)",
        "bits_per_element": peer.bits_per_element() if footprint is None else footprint["bits_per_element"],
        "threads": threads, **({} if footprint is None else {"kv_bytes": footprint}),
        "llama_cpp_system_info": system_info(),
        "peak_rss_bytes": None, "peak_rss_note": NOT_APPLICABLE["peak_rss"]}


def _argmax(logits: Any, n: int) -> int:
    import numpy as np

    return int(np.argmax(np.ctypeslib.as_array(logits, shape=(n,))))
