"""Peers measured in the same run: transformers' own caches, selectable by name like presets.

Importing this module registers them with :func:`kvsqueeze.resolve.register_peer`, so that
:func:`kvsqueeze.resolve_kv` (every ``--kv``) resolves their names; the resolver never imports this module.

* ``hf-dynamic``: ``transformers.DynamicCache`` (full precision, the model's dtype).
* ``hf-static``: ``transformers.StaticCache`` (full precision, preallocated to a length: ``kvsqueeze speed`` sizes
  it to the run, context + decode tokens; the cache ``torch.compile`` captures with CUDA graphs, ``--compile``).
* ``hf-quanto-int4`` / ``hf-quanto-int2``: ``transformers.QuantizedCache(backend="quanto")`` with its defaults:
  groups of 64, a 128-token full-precision residual, both keys and values on axis 0 (per-token groups of 64
  channels).  ``-axis1`` variants quantize keys and values on quanto's axis -1 (per-channel, over groups of 64
  consecutive tokens of the flattened batch x heads x tokens axis).
* ``hf-fp8``: ``transformers.QuantizedCache(backend="fp8")``: float8-e4m3 with one scale per layer tensor.
* ``vllm:<kv_cache_dtype>``: vLLM's own cache, run in a child process (:mod:`kvsqueeze.eval.vllm_peer`).
* ``llamacpp:<type>`` / ``llamacpp:<type_k>-<type_v>``: llama.cpp's own cache types, through llama-cpp-python on
  the GGUF file (:mod:`kvsqueeze.eval.llamacpp_peer`).

Bytes are counted from what the peer really stores (quanto's packed codes, its scales and shifts in the model
dtype, the full-precision residual), never from a formula.  The only module reading the peers' internals.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from ..cache.accounting import KVFootprint
from ..resolve import register_peer, resolve_kv
from ..spec import DEFAULT_PREFILL_CHUNK, CacheSpec, check_prefill_chunk
from . import llamacpp_peer, vllm_peer  # noqa: F401  (register the vllm:<kv_cache_dtype> and llamacpp:<type> peers)
from .engine_peers import is_engine


@dataclass(frozen=True)
class Peer:
    name: str
    backend: str  # "dynamic", "static", "quanto" or "fp8"
    description: str
    nbits: int | None = None
    axis_key: int | None = None
    axis_value: int | None = None
    q_group_size: int = 64
    residual_length: int = 128

    @property
    def requires(self) -> tuple[str, str] | None:
        """(module, pip package) of the optional library this peer needs; None: transformers alone."""
        return ("optimum.quanto", "optimum-quanto") if self.backend == "quanto" else None

    @property
    def available(self) -> bool:
        return self.requires is None or _importable(self.requires[0])

    @property
    def install_hint(self) -> str:
        return PEER_INSTALL_HINT

    def settings(self) -> dict[str, Any]:
        d = {"backend": self.backend, "description": self.description}
        if self.backend == "quanto":
            d |= {"nbits": self.nbits, "axis_key": self.axis_key, "axis_value": self.axis_value,
                  "q_group_size": self.q_group_size, "residual_length": self.residual_length}
        return d


def _quanto(bits: int, axis: int) -> Peer:
    name = f"hf-quanto-int{bits}" + ("-axis1" if axis else "")
    layout = "per-channel over 64-token groups" if axis else "per-token groups of 64 channels"
    return Peer(name, "quanto", f"transformers QuantizedCache, quanto int{bits}, {layout}, residual 128",
                nbits=bits, axis_key=-axis, axis_value=-axis)


PEERS: dict[str, Peer] = {p.name: p for p in (
    Peer("hf-dynamic", "dynamic", "transformers DynamicCache (full precision)"),
    Peer("hf-static", "static", "transformers StaticCache (full precision, preallocated to the run's length)"),
    _quanto(4, 0), _quanto(4, 1), _quanto(2, 0), _quanto(2, 1),
    Peer("hf-fp8", "fp8", "transformers QuantizedCache, fp8-e4m3 with one scale per layer tensor"),
)}
PEER_INSTALL_HINT = "pip install 'kvsqueeze[peers]' (or: pip install optimum-quanto)"
for _peer in PEERS.values():  # selectable by name wherever a cache is named (kvsqueeze.resolve_kv)
    register_peer(_peer)


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a missing parent package
        return False


def make_cache(model: Any, name: str | CacheSpec, max_len: int | None = None, static: bool = False) -> Any:
    """An empty cache for ``model``: kvsqueeze's QuantizedCache for anything :func:`kvsqueeze.resolve_kv` turns
    into a CacheSpec (``static``: its StaticQuantizedCache, preallocated to ``max_len`` tokens, for compiled decode
    steps), or the peer's own cache (``hf-static``: preallocated to ``max_len`` tokens)."""
    kv = resolve_kv(name)
    if isinstance(kv, CacheSpec):
        from ..adapter import QuantizedCache, StaticQuantizedCache

        return StaticQuantizedCache(model.config, kv, max_len) if static else QuantizedCache(model.config, kv)
    import transformers

    if kv.backend == "dynamic":
        return transformers.DynamicCache(config=model.config)
    if kv.backend == "static":
        if max_len is None:
            raise ValueError("hf-static preallocates its length, which only `kvsqueeze speed` sets (context + decode "
                             "tokens); use hf-dynamic here")
        return transformers.StaticCache(config=model.config, max_cache_len=max_len)
    if kv.backend == "fp8":
        return transformers.QuantizedCache(backend="fp8", config=model.config)
    return transformers.QuantizedCache(backend="quanto", config=model.config, nbits=kv.nbits, axis_key=kv.axis_key,
                                       axis_value=kv.axis_value, q_group_size=kv.q_group_size,
                                       residual_length=kv.residual_length)


def prefill_pieces(model: Any, cache: Any, n_tokens: int, batch: int = 1,
                   chunk: int = DEFAULT_PREFILL_CHUNK) -> list[int]:
    """How to split an ``n_tokens`` prompt into forward calls: ``chunk`` tokens each (0 = one call).

    quanto's axis -1 groups run over the flattened batch x heads x tokens axis, so every tensor it quantizes
    (the prompt, then the whole history at each flush of the 128-token residual) must hold a multiple of the
    group size there: its pieces are multiples of that alignment (the chunk rounded down, at least one
    alignment), and an unaligned remainder goes in last, where it lands in the full-precision residual."""
    check_prefill_chunk(chunk)
    if n_tokens < 1:
        raise ValueError(f"a prompt of at least one token is needed, got {n_tokens}")
    step = chunk or n_tokens
    layer = cache.layers[0] if getattr(cache, "layers", None) else None
    if -1 in (getattr(layer, "axis_key", None), getattr(layer, "axis_value", None)):
        from ..layout import model_kv_layout

        rows = batch * model_kv_layout(model.config)["num_kv_heads"]
        align = layer.q_group_size // math.gcd(layer.q_group_size, rows)
        aligned = n_tokens // align * align
        if aligned == 0:
            raise ValueError(f"quanto with axis -1 needs prompts of at least {align} tokens (got {n_tokens})")
        step = max(align, min(step, aligned) // align * align)
        pieces = [step] * (aligned // step) + ([aligned % step] if aligned % step else [])
        return pieces + ([n_tokens - aligned] if n_tokens > aligned else [])
    return [step] * (n_tokens // step) + ([n_tokens % step] if n_tokens % step else [])


@torch.no_grad()
def prefill(model: Any, ids: torch.Tensor, cache: Any, chunk: int = DEFAULT_PREFILL_CHUNK) -> torch.Tensor:
    """Feed a prompt [B, T] into ``cache``, ``chunk`` tokens per forward pass (0 = one pass; split as
    :func:`prefill_pieces` says); returns the final hidden state of the last position [B, H]."""
    from ..adapter import cache_kwargs

    start = 0
    out = None
    for n in prefill_pieces(model, cache, ids.shape[1], ids.shape[0], chunk):
        out = model.base_model(input_ids=ids[:, start:start + n], **cache_kwargs(model.base_model, cache),
                                use_cache=True)
        start += n
    return out.last_hidden_state[:, -1]


# ------------------------------------------------------------------------------------------------ accounting
def footprint(cache: Any) -> KVFootprint:
    """What ``cache`` stores right now, counted from its tensors."""
    tokens = int(cache.get_seq_length())  # a tensor for a static cache
    if hasattr(cache, "nbytes"):  # kvsqueeze's own accounting
        b = cache.nbytes()
        batch = next((layer.kv.shape[0] for layer in cache.layers if layer.kv.shape is not None), 1)
        return KVFootprint(b.codes, b.params, b.full_precision, b.elements, b.quantized_elements, tokens, batch)
    codes = params = fp = elements = q_elements = 0
    batch = 1
    for layer in cache.layers:
        if not getattr(layer, "is_initialized", False):
            continue
        shape = _layer_shape(layer)
        batch = shape[0]
        elements += 2 * math.prod(shape[:2]) * shape[3] * int(layer.get_seq_length())
        for t in (layer.keys, layer.values):
            fp += _nbytes(t) if t is not None and t.dim() == 4 else 0  # dynamic layers, or the quanto residual
        for q in (getattr(layer, "_quantized_keys", None), getattr(layer, "_quantized_values", None)):
            if q is None:
                continue
            c, p, n = _quantized_bytes(q)
            codes, params, q_elements = codes + c, params + p, q_elements + n
    return KVFootprint(codes, params, fp, elements, q_elements, tokens, batch)


def _layer_shape(layer: Any) -> tuple[int, int, int, int]:
    for t in (getattr(layer, "_quantized_keys", None), layer.keys):
        if isinstance(t, tuple):
            t = t[0]
        if t is not None and t.dim() == 4:
            return tuple(t.shape)
    raise ValueError("cannot read the shape of an empty cache layer")


def _quantized_bytes(q: Any) -> tuple[int, int, int]:
    """(code bytes, parameter bytes, elements) of a peer's quantized tensor: quanto's QTensor or fp8's
    (codes, scale) tuple."""
    if isinstance(q, tuple):
        data, *scales = q
        return _nbytes(data), sum(_nbytes(s) for s in scales), data.numel()
    names, _ = q.__tensor_flatten__()
    codes = sum(_nbytes(getattr(q, n)) for n in names if n == "_data")
    params = sum(_nbytes(getattr(q, n)) for n in names if n != "_data")
    return codes, params, q.numel()


def _nbytes(t: Any) -> int:
    """Real bytes of a tensor, looking inside tensor subclasses (quanto packs its codes in an inner tensor)."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(_nbytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def describe(names: Iterable[str]) -> list[dict[str, Any]]:
    """Settings of each name, for JSON: the full CacheSpec of a preset or a peer's settings."""
    out = []
    for n in names:
        kv = resolve_kv(n)
        out.append({"name": n, "kind": "peer", **kv.settings()} if isinstance(kv, Peer) or is_engine(kv)
                   else {"name": n, "kind": "preset", "spec": kv.to_dict(), "label": kv.label()})
    return out
