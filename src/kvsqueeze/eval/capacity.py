"""Capacity: how many tokens, and how many 4k sequences, fit a memory budget with a given cache.

A process that fills a cache holds the cache plus what the forward passes need on the side.  Both are measured:

* the cache's bytes for one sequence of ``n`` tokens, from a real cache of that kind filled with ``n`` tokens of
  random K/V layer by layer (no model run: the bytes do not depend on the values), at two lengths, so that the
  fixed part (full-precision window and sinks, shared scales) and the per-token part are both exact;
* the rest of the peak (``transient``): the peak RSS growth (on a GPU: CUDA's peak allocated) of a real prefill +
  decode run
  (:func:`kvsqueeze.eval.speed.measure_speed`) minus the cache's bytes at its end, per sequence.  With a chunked
  prefill it is bounded by the chunk, not the prompt, and is taken as constant in the context length (it holds the
  chunk's activations and attention scratch) and proportional to the batch.

Then a sequence of ``n`` tokens costs ``transient + fixed + per_token * n`` and a budget holds
``max_tokens = (budget - transient - fixed) / per_token`` tokens of one sequence (the longest context, before the
model's own position limit), and ``floor(budget / cost(4096))`` sequences of 4096 tokens.  The figures are
projections from measurements; :func:`check_projection` compares one with a measured run.
"""

from __future__ import annotations

import math
import re
from typing import Any

import torch

from .peers import footprint, make_cache

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
BATCH_CONTEXT = 4096  # the context of the "largest batch" figure
DEFAULT_BUDGET = 2 * 2**30  # bytes: the budget of the capacity figures unless --budget says otherwise


def parse_budget(text: str) -> int:
    """Bytes in ``2GiB``, ``1.5 GB``, ``512MiB`` or a plain byte count; a clear error for anything else."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?b?|b)?\s*", str(text), flags=re.IGNORECASE)
    unit = (m.group(2) or "").lower() if m else ""
    if unit and not unit.endswith("b"):
        unit += "b"  # "2G" -> "gb", "2Gi" -> "gib"
    if not m or unit not in _UNITS:
        raise ValueError(f"cannot read the memory budget {text!r}: give a size such as 2GiB, 1.5GB, 512MiB or a "
                         f"number of bytes")
    value = float(m.group(1)) * _UNITS[unit]
    if value < 1:
        raise ValueError(f"the memory budget must be positive, got {text!r}")
    return int(value)


def _layer_shapes(model: Any) -> list[tuple[int, int]]:
    from ..layout import kv_layout

    lay = kv_layout(model.config)
    return [(lay.num_kv_heads, lay.head_dim)] * lay.num_layers


@torch.no_grad()
def cache_bytes(model: Any, kv: str, tokens: int, chunk: int = 512) -> int:
    """Bytes a cache of kind ``kv`` holds for one sequence of ``tokens`` tokens, filled with random K/V."""
    cache = make_cache(model, kv)
    dtype = next(model.parameters()).dtype
    g = torch.Generator().manual_seed(0)
    for i, (heads, dim) in enumerate(_layer_shapes(model)):
        for start in range(0, tokens, chunk):
            n = min(chunk, tokens - start)
            k = torch.randn((1, heads, n, dim), generator=g).to(dtype)
            v = torch.randn((1, heads, n, dim), generator=g).to(dtype)
            _append(cache, i, k, v)
    return footprint(cache).total


def _append(cache: Any, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
    kv = getattr(cache.layers[layer], "kv", None)
    if kv is not None:  # kvsqueeze's layer: stage then commit (what its attention does after a step)
        kv.stage(k, v)
        kv.commit()
    else:  # transformers' caches store on update
        cache.update(k, v, layer)


def cache_cost(model: Any, kv: str, short: int = 1024, long: int = 4096) -> dict[str, float]:
    """Fixed bytes and bytes per token of one sequence, from exact fills at two lengths."""
    a, b = cache_bytes(model, kv, short), cache_bytes(model, kv, long)
    per_token = (b - a) / (long - short)
    return {"fixed_bytes": a - per_token * short, "bytes_per_token": per_token}


def capacity(cost: dict[str, float], transient_per_sequence: float, budget: int,
             max_positions: int | None, batch_context: int = BATCH_CONTEXT) -> dict[str, Any]:
    """Longest context (batch 1) and largest batch at ``batch_context`` that fit ``budget`` bytes."""
    fixed, per_token = cost["fixed_bytes"] + max(transient_per_sequence, 0.0), cost["bytes_per_token"]
    tokens = max(0, math.floor((budget - fixed) / per_token)) if per_token > 0 else 0
    per_sequence = fixed + per_token * batch_context
    return {
        "budget_bytes": budget,
        "max_tokens": tokens,  # one sequence, ignoring the model's position limit
        "max_context": tokens if max_positions is None else min(tokens, max_positions),
        "limited_by_model_positions": max_positions is not None and tokens > max_positions,
        "batch_context": batch_context,
        "max_batch": max(0, math.floor(budget / per_sequence)),
        "bytes_per_sequence": per_sequence,
        "transient_bytes_per_sequence": max(transient_per_sequence, 0.0),
        **cost,
    }


def measured_peak(speed_result: dict[str, Any]) -> int:
    """The peak growth of a :func:`measure_speed` run in the memory the cache lives in: CUDA's allocator (GPU
    memory, the budget of a GPU run) where the run was on a GPU, else the process's RSS."""
    cuda = speed_result.get("cuda_peak_allocated_delta_bytes")
    return speed_result["peak_rss_delta_bytes"] if cuda is None else cuda


def transient_per_sequence(speed_result: dict[str, Any]) -> float:
    """The measured peak beyond the cache's own bytes, per sequence, from a :func:`measure_speed` result."""
    return (measured_peak(speed_result) - speed_result["kv_bytes"]["total"]) / speed_result["batch"]


def predicted_peak(cost: dict[str, float], transient: float, batch: int, context: int) -> float:
    return batch * (max(transient, 0.0) + cost["fixed_bytes"] + cost["bytes_per_token"] * context)


def check_projection(cost: dict[str, float], transient: float, measured: dict[str, Any]) -> dict[str, Any]:
    """A measured run beside the projection for its own batch and context."""
    want = predicted_peak(cost, transient, measured["batch"], measured["context"])
    got = measured_peak(measured)
    return {"batch": measured["batch"], "context": measured["context"], "predicted_peak_bytes": want,
            "measured_peak_bytes": got, "ratio": got / want if want else float("nan")}
