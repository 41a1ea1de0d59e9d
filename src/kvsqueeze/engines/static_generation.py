"""Greedy generation through a :class:`StaticKVManager`, on any static engine.

An engine has ``check_manager(manager)``, ``prefill(manager, ids, mask, pos)`` and ``decode(manager, ids)``
returning logits ``[B, vocab]``, and an ``info`` with ``batch_size`` and ``max_len``: :class:`~kvsqueeze.engines.onnx_runner.OrtStaticEngine`
(ONNX Runtime) or :class:`~kvsqueeze.engines.torch_static.TorchStaticEngine` (the same modules, eager PyTorch).
This module imports no torch, so an ONNX Runtime deployment does not load it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .static_manager import StaticKVManager, WindowFullError


@dataclass
class StaticGenerationResult:
    tokens: list[list[int]]  # generated tokens per row (the prompt excluded), up to and including EOS
    prefill_s: float
    decode_s: float
    decode_steps: int
    stats: dict[str, int]
    stopped: str  # "max_new_tokens", "eos" or the window-full message
    logits: list[np.ndarray] = field(default_factory=list)  # per generated token, [B, vocab], when kept

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_steps / self.decode_s if self.decode_s > 0 else float("nan")


def left_pad(prompts: list[list[int]], window: int, pad_id: int = 0) -> tuple[np.ndarray, ...]:
    """Prompts as the prefill graph's left-padded ``[B, S-1]`` ids, mask and positions."""
    b = len(prompts)
    ids = np.full((b, window), pad_id, np.int64)
    mask = np.zeros((b, window), np.int64)
    pos = np.zeros((b, window), np.int64)
    for r, p in enumerate(prompts):
        n = len(p)
        ids[r, window - n:] = p
        mask[r, window - n:] = 1
        pos[r, window - n:] = np.arange(n)
    return ids, mask, pos


def check_prompts(prompts: list[list[int]], batch_size: int, max_len: int) -> None:
    """Bad input fails here, before the engine runs."""
    if len(prompts) != batch_size:
        raise ValueError(f"the static graph was exported for batch {batch_size}, got {len(prompts)} prompts")
    for r, p in enumerate(prompts):
        if len(p) < 1:
            raise ValueError(f"prompt {r} is empty")
        if len(p) > max_len - 1:
            raise ValueError(
                f"prompt {r} has {len(p)} tokens but the static window holds S-1 = {max_len - 1}; "
                f"use a larger --max-len (re-exports the graph) or a shorter prompt"
            )


def greedy_generate(
    engine,
    manager: StaticKVManager,
    prompts: list[list[int]],
    max_new_tokens: int,
    *,
    eos_token_id: int | None = None,
    pad_token_id: int = 0,
    on_token: Callable[[np.ndarray], None] | None = None,
    keep_logits: bool = False,
) -> StaticGenerationResult:
    """Greedy decoding: one prefill, then one decode step per token.  Stops at ``max_new_tokens``, when every
    row has produced ``eos_token_id``, or when the window is full and the manager's ``on_full`` is "stop"."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    check_prompts(prompts, engine.info.batch_size, engine.info.max_len)
    engine.check_manager(manager)  # a mismatched manager fails before it is reset
    ids, mask, pos = left_pad(prompts, engine.info.max_len - 1, pad_token_id)
    manager.reset()
    t0 = time.perf_counter()
    logits = engine.prefill(manager, ids, mask, pos)
    prefill_s = time.perf_counter() - t0
    out: list[list[int]] = [[] for _ in prompts]
    kept, done = [], np.zeros(len(prompts), bool)
    decode_s, steps, stopped = 0.0, 0, "max_new_tokens"
    while True:
        tok = logits.argmax(axis=-1)
        if keep_logits:
            kept.append(logits)
        for r, t in enumerate(tok.tolist()):
            if not done[r]:  # a row that produced EOS is finished; it keeps decoding only to keep the batch
                out[r].append(t)
        if on_token is not None:
            on_token(tok)
        if eos_token_id is not None:
            done |= tok == eos_token_id
        if done.all():
            stopped = "eos"
            break
        if max(len(o) for o in out) >= max_new_tokens:
            break
        t0 = time.perf_counter()
        try:
            logits = engine.decode(manager, tok[:, None].astype(np.int64))
        except WindowFullError as exc:
            stopped = str(exc)
            break
        decode_s += time.perf_counter() - t0
        steps += 1
    return StaticGenerationResult(out, prefill_s, decode_s, steps, manager.stats.as_dict(), stopped, kept)


def first_divergence(ref: list[int], got: list[int], ref_logits: list[np.ndarray] | None = None,
                     got_logits: list[np.ndarray] | None = None, row: int = 0) -> dict | None:
    """Where two greedy sequences first differ (None if they never do).

    With logits it adds ``ref_gap`` (how much the reference preferred its token over the other run's token),
    ``logit_err`` (the largest logit difference between the runs at that step) and the median and largest of
    that difference over the steps before, where both runs had the same history (``typical_err``, ``max_err``:
    the error the quantized path shows anyway).  ``tie_within_error`` says the reference's choice was a tie
    within that error, ``ref_gap <= 2 * max_err``, as opposed to an error spike at that step.
    """
    for i, (a, b) in enumerate(zip(ref, got)):
        if a == b:
            continue
        info = {"index": i, "ref_token": a, "got_token": b}
        if ref_logits is not None and got_logits is not None and i < min(len(ref_logits), len(got_logits)):
            errs = [float(np.abs(ref_logits[j][row] - got_logits[j][row]).max()) for j in range(i + 1)]
            before = errs[:-1] if i else errs
            r = ref_logits[i][row]
            info["ref_gap"] = float(r[a] - r[b])
            info["logit_err"] = errs[-1]
            info["typical_err"] = float(np.median(before))
            info["max_err"] = max(before)
            info["tie_within_error"] = info["ref_gap"] <= 2 * info["max_err"]
        return info
    return None
