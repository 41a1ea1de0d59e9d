"""Specs that parse but do not fit the model are refused as one KvsqueezeError line, before anything is allocated."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from kvsqueeze import QuantizedCache
from kvsqueeze.errors import CacheSpecError, KvsqueezeError

CONFIG = LlamaConfig(hidden_size=256, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=100)  # head_dim 64


@pytest.mark.parametrize("spec, side", [("k4t128-v8t8", "keys"), ("k8t8-v4t96", "values"), ("k3t8-v3t8-w0", None)])
def test_a_spec_that_does_not_fit_the_heads_is_a_kvsqueeze_error(spec, side):
    if side is None:  # fits: 3-bit codes need head_dim % 8 == 0, which 64 is
        QuantizedCache(CONFIG, spec)
        return
    with pytest.raises(KvsqueezeError) as info:
        QuantizedCache(CONFIG, spec)
    assert isinstance(info.value, CacheSpecError) and isinstance(info.value, ValueError)
    msg = str(info.value)
    assert "\n" not in msg and spec in msg and f"{side}:" in msg and "head_dim 64" in msg
