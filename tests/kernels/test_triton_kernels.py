"""The Triton decode at a real model's scale on a GPU (8 KV heads, head_dim 128, 5000 tokens) against the reference.

The table of small cases every kernel path runs, Triton under the interpreter included, is test_conformance.py.
Tolerance: atol 5e-5 (float32 accumulation in a different order than the reference).
"""

from __future__ import annotations

import pytest
import torch

from ._helpers import (
    HAS_TRITON,
    assert_matches_reference,
    filled_layer,
    padding_mask,
)

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("spec", ["kivi-4", "kivi-2", "int4", "int8", "full", "rot-3", "fp8-e4m3"])
def test_fused_decode_on_gpu(spec):
    from kvsqueeze.kernels import triton_decode

    layer = filled_layer(spec, batch=4, kv_heads=8, head_dim=128, stored=5000, new=1, steps=3, device="cuda")
    assert_matches_reference(triton_decode.attend, layer, 32, 1, padding_mask(layer, 1, [0, 100, 7, 4000]))
