"""The calibration objective sees what the cache serves: its exact/quantized split is the cache's own."""

from __future__ import annotations

import pytest
import torch

from kvsqueeze.cache.emulate import fake_quantize_cache, quantized_mask
from kvsqueeze.cache.layer import LayerKV
from kvsqueeze.cache.plan import STORED
from kvsqueeze.calibrate.clip import attention_out
from kvsqueeze.kernels import reference
from kvsqueeze.spec import preset


@pytest.mark.parametrize("spec_name", ["k2c16-v2t16-w32-s3", "k4t16-v2t16-w8-s1", "k3c8-v4c8-w0"])
def test_objective_split_equals_the_cache(spec_name):
    """Per-channel keys flush whole token groups, so the exact window holds window..window+G-1 tokens: the
    objective must follow that, not a fixed ``window`` (what it did before)."""
    spec = preset(spec_name)
    g = torch.Generator().manual_seed(0)
    length, d = 90, 32
    q = torch.randn(1, 4, length, d, generator=g)
    k = torch.randn(1, 2, length, d, generator=g) * 2
    v = torch.randn(1, 2, length, d, generator=g)
    k_hat, v_hat = fake_quantize_cache(k, v, spec)
    layer = LayerKV(spec)
    for p in range(length):
        layer.stage(k[:, :, p:p + 1], v[:, :, p:p + 1])
        plan = layer.plan()
        stored = torch.zeros(p + 1, dtype=torch.bool)
        for seg in plan.segments:
            if seg.kind == STORED:
                stored[seg.start:seg.start + seg.length] = True
        want = quantized_mask(spec.window, spec.sinks, spec.flush_tokens, torch.tensor([p]), p + 1)[0]
        assert torch.equal(stored, want), p
        if p in (0, 30, 57, length - 1):
            cache_out = reference.attend(q[:, :, p:p + 1], plan, None, 0.2)  # [1, 4, 1, D]
            objective = attention_out(q, k, v, torch.tensor([p]), 0.2, k_hat, v_hat, spec.window, spec.sinks,
                                      flush=spec.flush_tokens)  # [1, 2, 2, D]: query heads grouped by KV head
            torch.testing.assert_close(objective.reshape(1, 4, 1, d), cache_out, atol=1e-5, rtol=0)
        layer.commit()


def test_quantized_mask_reference_values():
    m = quantized_mask(window=4, sinks=2, flush=4, committed=torch.tensor([5, 9, 10, 13, 14]), length=16)
    got = [row.nonzero().flatten().tolist() for row in m]
    assert got == [[], [], [2, 3, 4, 5], [2, 3, 4, 5], [2, 3, 4, 5, 6, 7, 8, 9]]
