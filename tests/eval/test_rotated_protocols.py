"""The rotated codebook format under the perplexity protocols: the one-pass window emulation equals decoding
token by token through the real cache (whose attention reads the codes: the C++ kernel where it builds)."""

from __future__ import annotations

import math

import pytest
import torch

from kvsqueeze import QuantizedCache
from kvsqueeze.eval import protocols as P
from kvsqueeze.spec import CacheSpec, QuantSpec

SMALL_ROT = CacheSpec(key=QuantSpec(fmt="rot", bits=3), value=QuantSpec(fmt="rot", bits=2.5), window=16, sinks=3,
                      block_tokens=32, name="small-rot")


SMALL_CENTRED = CacheSpec(key=QuantSpec(fmt="rot", bits=2.875, axis="channel", group=16),
                          value=QuantSpec(fmt="rot", bits=2.375, axis="channel", group=16), window=16, sinks=3,
                          block_tokens=32, name="small-rot-centred")


@pytest.mark.parametrize("spec", [SMALL_ROT, SMALL_CENTRED], ids=["plain", "centred"])
def test_window_equals_decode_through_the_real_cache(tiny_llama, spec):
    ids = torch.randint(2, 256, (1, 72), generator=torch.Generator().manual_seed(0))
    window = P.nll_window(tiny_llama, ids, spec, 10)
    decode = P.nll_decode(tiny_llama, ids, QuantizedCache(tiny_llama.config, spec), 10)
    torch.testing.assert_close(window, decode, atol=1e-3, rtol=0)
    assert (window - P.nll_reference(tiny_llama, ids, 10)).abs().max() > 1e-3  # quantization is really there
    allq = P.nll_all_quantized(tiny_llama, ids, spec)
    assert math.isfinite(float(allq.mean())) and (allq - P.nll_reference(tiny_llama, ids)).abs().max() > 1e-3
