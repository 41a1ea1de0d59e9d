"""Prefill time, decode milliseconds per token and peak memory of one cache at one context length.

Decoding is timed step by step through ``model(input_ids=next, cache=cache)`` (not ``generate``), so
each step's time is the model plus the cache and nothing else.  Peak resident memory is reset before the
measurement where Linux allows it (``/proc/self/clear_refs``), so each measurement reports its own peak
rather than the process's lifetime maximum.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import torch

from ..heap import release_freed_memory
from ..spec import DEFAULT_PREFILL_CHUNK

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


class PeakRSS:
    """Peak resident set size inside a ``with`` block, in bytes (``peak``), and the RSS at its start (``start``).

    Linux: the kernel's high-water mark (VmHWM) reset on entry.  Elsewhere: RSS sampled every 2 ms."""

    def __init__(self) -> None:
        self.start = self.peak = 0
        self.method = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> PeakRSS:
        release_freed_memory(collect=True)  # earlier measurements' freed memory must not hide this peak
        proc = psutil.Process()
        self.start = proc.memory_info().rss
        try:
            _CLEAR_REFS.write_text("5")  # resets VmHWM to the current RSS
            self.method = "VmHWM (kernel high-water mark, reset before the measurement)"
        except OSError:
            self.method = "RSS sampled every 2 ms"
            self.peak = self.start
            self._thread = threading.Thread(target=self._sample, args=(proc,), daemon=True)
            self._thread.start()
        return self

    def _sample(self, proc: psutil.Process) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, proc.memory_info().rss)

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, psutil.Process().memory_info().rss)
        else:
            self.peak = _vm_hwm()


def _vm_hwm() -> int:
    for line in _STATUS.read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise OSError("VmHWM not found in /proc/self/status")


def lifetime_max_rss() -> int:
    """The process's lifetime peak RSS in bytes (getrusage; kilobytes on Linux)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@contextlib.contextmanager
def _timer(out: list[float]) -> Iterator[None]:
    t = time.perf_counter()
    yield
    out.append(time.perf_counter() - t)


def _sync(cuda: bool) -> None:
    if cuda:  # CUDA work is asynchronous: a timer must wait for it
        torch.cuda.synchronize()


@torch.no_grad()
def measure_speed(model: Any, kv: str, context: int, decode_tokens: int, batch: int = 1,
                  seed: int = 0, prefill_chunk: int = DEFAULT_PREFILL_CHUNK, compile: bool = False) -> dict[str, Any]:
    """Prefill a ``context``-token random prompt (``batch`` rows; ``prefill_chunk`` tokens per forward pass, 0 = one
    pass) into a fresh cache, then ``decode_tokens`` greedy steps; returns times, memory and the cache's bytes.
    ``compile``: the decode step through ``torch.compile`` (CUDA graphs on a GPU), for caches that allow it."""
    from ..adapter import patch
    from ..resolve import resolve_kv
    from ..spec import CacheSpec

    if context < 1 or decode_tokens < 1 or batch < 1:
        raise ValueError("context, decode tokens and batch must all be positive")
    vocab = model.get_output_embeddings().weight.shape[0]
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, context), generator=g).to(model.device)
    head = model.get_output_embeddings()
    max_len = context + decode_tokens + 1  # what a preallocated cache (hf-static) must hold
    step_model = _compiled(model, kv, ids.is_cuda) if compile else model.base_model
    # compiled kvsqueeze specs: the static cache, with the model routed to it for the whole run (a graph reads the
    # routing as a constant)
    routed = compile and isinstance(resolve_kv(kv), CacheSpec)
    with patch(model) if routed else contextlib.nullcontext():
        return _measure(model, kv, ids, head, max_len, step_model, decode_tokens, batch, prefill_chunk, compile)


def _measure(model, kv, ids, head, max_len, step_model, decode_tokens, batch, prefill_chunk, compile):
    from ..adapter import attention_clock, attention_paths, cache_kwargs, describe_paths
    from .peers import footprint, make_cache, prefill

    context = ids.shape[1]
    # warm-up, untimed: one-off allocations, and the cache's kernels chosen (and built: the C++ one is compiled on
    # first use) by a short prefill and a decode step of the same kind of cache
    warm = make_cache(model, kv, max_len, static=compile)
    rows = batch if compile else 1  # compiled graphs are specialised to the batch
    prefill(model, ids[:rows, :min(context, 128)], warm, prefill_chunk and 64)
    for _ in range(3 if compile else 1):  # compiled: the graphs are built (and recorded) on the first calls
        step_model(input_ids=ids[:rows, :1].clone(memory_format=torch.contiguous_format), **cache_kwargs(model.base_model, warm), use_cache=True)
    if compile:  # the same cache, emptied: a graph is specialised to its tensors (as generate() reuses its cache)
        warm.reset()
        cache = warm
    else:
        del warm
        cache = make_cache(model, kv, max_len)
    prefill_s: list[float] = []
    steps: list[float] = []
    cuda = ids.is_cuda
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    cuda_start = torch.cuda.memory_allocated() if cuda else 0
    kw = cache_kwargs(model.base_model, cache)
    attention: list[float] = []  # seconds of each decode step inside attention (host clock: uncompiled CPU runs)
    clocked = not (cuda or compile)
    with PeakRSS() as mem, attention_clock() if clocked else contextlib.nullcontext() as clock:
        with _timer(prefill_s):
            nxt = head(prefill(model, ids, cache, prefill_chunk)).argmax(-1, keepdim=True)
            _sync(cuda)
        calls = clock.calls if clocked else 0
        for _ in range(decode_tokens):
            before = clock.seconds if clocked else 0.0
            with _timer(steps):
                h = step_model(input_ids=nxt, **kw, use_cache=True).last_hidden_state
                nxt = head(h[:, -1]).argmax(-1, keepdim=True)
                _sync(cuda)
            if clocked:
                attention.append(clock.seconds - before)
        if clocked and clock.calls == calls:  # the model's attention is a function of its own ("eager"): not seen
            attention = []
    kv_bytes = footprint(cache)
    paths = attention_paths(cache, model)
    return {
        "kv": kv, "context": context, "decode_tokens": decode_tokens, "batch": batch, "prefill_chunk": prefill_chunk,
        "compiled": compile,
        "prefill_s": prefill_s[0],
        "prefill_tokens_per_s": batch * context / prefill_s[0],
        "decode_ms_per_token": 1000 * statistics.median(steps),
        "decode_ms_min": 1000 * min(steps),  # the least disturbed step: a check on a busy machine
        "decode_ms_steps": [round(1000 * s, 3) for s in steps],
        # of a decode step, the time inside the attention function (kvsqueeze's: its kernel and the step's commit;
        # transformers' SDPA for its caches), median over the steps; None where not clocked (CUDA, compiled, a
        # model on its own eager attention)
        "decode_attention_ms_per_token": 1000 * statistics.median(attention) if attention else None,
        "peak_rss_bytes": mem.peak, "rss_before_bytes": mem.start, "peak_rss_delta_bytes": mem.peak - mem.start,
        "peak_rss_method": mem.method,
        # on CUDA, what the caching allocator handed out at its peak, above what was allocated before
        "cuda_peak_allocated_delta_bytes": torch.cuda.max_memory_allocated() - cuda_start if cuda else None,
        "kv_bytes": kv_bytes.as_dict(),
        "threads": torch.get_num_threads(),
        # what the timed steps ran on ('sdpa': transformers' own attention, for peers and prompts)
        "attention_path": describe_paths(paths), "attention_paths": paths,
    }


def _compiled(model: Any, kv: str, cuda: bool) -> Any:
    """The decode step's model under ``torch.compile`` (mode reduce-overhead on a GPU: CUDA graphs), for a cache
    whose layers say they are compileable; anything else is refused in one line before any work."""
    from .peers import make_cache

    cache = make_cache(model, kv, 2, static=True)
    layers = getattr(cache, "layers", [])
    if not layers or not all(getattr(layer, "is_compileable", False) for layer in layers):
        raise ValueError(f"--compile: the {kv} cache is not compileable (its layers say is_compileable=False); "
                         f"compileable here: hf-static and kvsqueeze specs (as StaticQuantizedCache)")
    return torch.compile(model.base_model, mode="reduce-overhead" if cuda else "default")

