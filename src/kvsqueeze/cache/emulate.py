"""What the cache would store, computed for a whole sequence at once (for one-pass perplexity protocols).

``fake_quantize_cache`` runs the cache's own codecs over every token that the cache could ever quantize, with
the same group alignment (token groups start right after the sinks), and :func:`quantized_mask` says which of
those a query sees quantized, so a protocol (or a calibration objective) that mixes these values with exact ones
reproduces the real cache bit for bit.  The one exception is fp8 with per-head/per-tensor
scales, which the real cache fixes from the first tokens it quantizes; here the scale comes from all tokens.
"""

from __future__ import annotations

import torch

from ..spec import CacheSpec
from .factory import make_codec


def fake_quantize_cache(k: torch.Tensor, v: torch.Tensor, spec: CacheSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (k_hat, v_hat) [B,H,T,D]: tokens [sinks, sinks + n) quantized-then-decoded as the cache stores
    them, where n is the largest multiple of ``spec.flush_tokens`` that fits; all other tokens exact."""
    spec.check_head_dim(k.shape[-1])
    t, s, f = k.shape[2], spec.sinks, spec.flush_tokens
    n = max(0, t - s) // f * f
    k_hat, v_hat = k.clone(), v.clone()
    if n:
        kc = make_codec(spec.key, k.shape[-1], k.dtype)
        vc = make_codec(spec.value, v.shape[-1], v.dtype)
        # positional codecs (pre-RoPE keys) un-rotate and re-rotate at the tokens' absolute positions (from s)
        ks, vs = {}, {}  # shared tensors of one "store" (fp8 per-head / per-tensor scales)
        k_hat[:, :, s:s + n] = kc.decode(kc.encode(k[:, :, s:s + n], s, ks), s, ks).to(k.dtype)
        v_hat[:, :, s:s + n] = vc.decode(vc.encode(v[:, :, s:s + n], s, vs), s, vs).to(v.dtype)
    return k_hat, v_hat


def quantized_mask(window: int, sinks: int, flush: int, committed: torch.Tensor, length: int) -> torch.Tensor:
    """Bool [P, length]: which keys a query sees quantized when the cache held ``committed[p]`` tokens at its step.

    The cache's one rule (:meth:`kvsqueeze.spec.CacheSpec.quantized_count`): after n committed tokens the
    ``floor((n - sinks - window) / flush) * flush`` tokens right after the sinks are stored quantized; sinks, the
    rest (the window) and the step's own tokens are exact.  A query at position p of a decoded sequence ran with
    p tokens committed."""
    n = (committed.long() - sinks - window).clamp_min(0) // flush * flush
    pos = torch.arange(length, device=committed.device)
    return (pos[None, :] >= sinks) & (pos[None, :] < sinks + n[:, None])
