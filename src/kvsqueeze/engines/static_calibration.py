"""Fixed K/V quantization parameters for the static path: one absmax / percentile pass over calibration text.

The K/V that get stored are collected with the same :class:`StaticStep` prefill module the graphs are exported
from (keys after RoPE, as the cache holds them), over chunks of the calibration text, and reduced per channel
(per layer, KV head and channel) or per tensor (per layer).  ``absmax`` keeps the whole observed range;
``percentile`` clips to the ``p``-th percentile on each side, trading rare outliers for resolution.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import torch

from .static_manager import StaticKVQuant
from .static_step import StaticStep

METHODS = ("absmax", "percentile")
CALIB_VERSION = 2  # part of every digest: cached graphs calibrated by older code are not reused
GRANULARITIES = ("channel", "tensor")

BUILTIN_TEXT = (
    "The history of computing is a story of machines built to follow instructions faster than people could. "
    "Early mechanical calculators added and multiplied numbers with gears; later, electrical relays and vacuum "
    "tubes replaced the gears, and transistors replaced the tubes. Each step made computers smaller, cheaper "
    "and more reliable. Today a phone holds more memory than the rooms of equipment that guided the first "
    "spacecraft. Software grew alongside the hardware: operating systems, compilers and databases turned raw "
    "arithmetic into tools for writing, drawing, talking and learning. Language models are a recent chapter. "
    "They read a sequence of tokens and predict the next one, keeping the keys and values of every earlier "
    "token in a cache so that each new word costs only a little extra work. Storing that cache in fewer bits "
    "lets a device hold longer conversations in the same memory, as long as the numbers keep enough precision "
    "for the model to choose the same words it would have chosen before."
)


def calibration_text(path: str | Path | None = None) -> tuple[str, str]:
    """(text, where it came from): ``path``; else the last 10% of
    ``$KVSQUEEZE_DATA/wikitext-2-raw/wiki.test.raw`` when present; else a built-in paragraph."""
    if path is not None:
        p = Path(path).expanduser()
        if not p.is_file():
            raise ValueError(f"calibration text file not found: {p}")
        text = p.read_text(encoding="utf-8", errors="replace")
        if not text.strip():
            raise ValueError(f"calibration text file {p} is empty")
        return text, str(p)
    data = os.environ.get("KVSQUEEZE_DATA")
    if data:
        wiki = Path(data).expanduser() / "wikitext-2-raw" / "wiki.test.raw"
        if wiki.is_file():
            text = wiki.read_text(encoding="utf-8", errors="replace")
            return text[int(len(text) * 0.9):], f"{wiki} (last 10%)"
    return BUILTIN_TEXT, "built-in paragraph"


def calib_digest(text: str, **settings: object) -> str:
    h = hashlib.sha256(f"v{CALIB_VERSION}:{text}".encode())
    h.update(repr(sorted(settings.items())).encode())
    return h.hexdigest()[:16]


@torch.inference_mode()
def collect_kv(model: torch.nn.Module, token_ids: list[int], chunk_len: int = 512) -> tuple[list, list]:
    """Stored-form K (after RoPE) and V per layer, each ``[N, H, D]`` float32 over all calibration tokens, run
    ``chunk_len`` tokens at a time (attention within a chunk, positions as in the whole text)."""
    if len(token_ids) < 2:
        raise ValueError("calibration text must have at least 2 tokens")
    chunk_len = min(chunk_len, len(token_ids))
    step = StaticStep(model, chunk_len + 1, "prefill", layout="token").eval()
    ks: list[list[np.ndarray]] = [[] for _ in range(step.n_layers)]
    vs: list[list[np.ndarray]] = [[] for _ in range(step.n_layers)]
    for lo in range(0, len(token_ids), chunk_len):
        part = token_ids[lo:lo + chunk_len]
        n = len(part)
        ids = torch.zeros(1, chunk_len, dtype=torch.long)
        ids[0, chunk_len - n:] = torch.tensor(part)
        mask = torch.zeros(1, chunk_len, dtype=torch.long)
        mask[0, chunk_len - n:] = 1
        # each chunk keeps its real positions in the text, so keys are seen after RoPE at positions up to
        # ``len(token_ids)``, not only below ``chunk_len`` (a sliding window keeps positions growing)
        pos = torch.clamp(mask.cumsum(1) - 1, min=0) + lo
        out = step(ids, mask, pos)
        for i in range(step.n_layers):  # token layout [T, 1, H, D]: keep the real tokens only
            ks[i].append(out[1 + 2 * i][chunk_len - n:, 0].numpy())
            vs[i].append(out[2 + 2 * i][chunk_len - n:, 0].numpy())
    return [np.concatenate(k) for k in ks], [np.concatenate(v) for v in vs]


def _ranges(xs: list[np.ndarray], method: str, percentile: float, granularity: str) -> tuple[np.ndarray, ...]:
    los, his = [], []
    for x in xs:  # [N, H, D]
        flat = x.reshape(-1, 1, 1) if granularity == "tensor" else x
        if method == "absmax":
            lo, hi = flat.min(axis=0), flat.max(axis=0)
        else:
            lo, hi = np.percentile(flat, [100 - percentile, percentile], axis=0)
        los.append(lo)
        his.append(hi)
    return np.stack(los), np.stack(his)


def calibrate_static(
    model: torch.nn.Module,
    token_ids: list[int],
    *,
    bits: int = 8,
    symmetric: bool = False,
    granularity: str = "channel",
    method: str = "absmax",
    percentile: float = 99.99,
    max_tokens: int = 4096,
    chunk_len: int = 512,
) -> StaticKVQuant:
    """Fixed per-channel (or per-tensor) K/V parameters from one pass over the calibration tokens (the first
    ``max_tokens`` of ``token_ids``, in chunks of ``chunk_len``).  Values beyond the calibrated range are
    clipped at run time, so calibrate on text like the expected inputs."""
    if method not in METHODS:
        raise ValueError(f"unknown calibration method {method!r}; allowed: {', '.join(METHODS)}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"unknown granularity {granularity!r}; allowed: {', '.join(GRANULARITIES)}")
    if not (50.0 < percentile <= 100.0):
        raise ValueError(f"percentile must be in (50, 100], got {percentile!r}")
    ids = [int(t) for t in token_ids[:max_tokens]]
    k, v = collect_kv(model, ids, chunk_len)
    lo_k, hi_k = _ranges(k, method, percentile, granularity)
    lo_v, hi_v = _ranges(v, method, percentile, granularity)
    meta = {"method": method, "percentile": percentile, "tokens": len(ids),
            "digest": calib_digest(repr(ids), bits=bits, symmetric=symmetric, granularity=granularity, method=method,
                                   percentile=percentile, max_tokens=max_tokens, chunk_len=chunk_len)}
    return StaticKVQuant.from_ranges(lo_k, hi_k, lo_v, hi_v, bits=bits, symmetric=symmetric,
                                     granularity=granularity, meta=meta)
