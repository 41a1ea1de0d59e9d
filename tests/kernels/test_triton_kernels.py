"""Triton kernels against the reference: under TRITON_INTERPRET=1 on CPU (small shapes), on CUDA when present.

Tolerance: atol 5e-5 (float32 accumulation in a different order than the reference).  Skipped cleanly when
Triton is not installed; the interpreter is slow, so the CPU cases use tiny chunks and few tokens.
"""

from __future__ import annotations

import pytest
import torch

from ._helpers import (
    HAS_TRITON,
    TRITON_DEVICE,
    assert_matches_reference,
    filled_layer,
    padding_mask,
    require_triton_runtime,
)

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")


@pytest.fixture
def td(monkeypatch):
    """The Triton module, interpreting on CPU unless a GPU is present."""
    from kvsqueeze.kernels import triton_decode  # interpreted on CPU: see tests/kernels/conftest.py

    require_triton_runtime()
    monkeypatch.setattr(triton_decode, "CHUNK", 32)
    monkeypatch.setattr(triton_decode, "BLOCK_T", 32)
    return triton_decode



@pytest.mark.parametrize("spec,new", [("kivi-2-sink4", 1), ("k8t16-v4c16-w16", 2), ("kivi-4", 1), ("full", 1)])
def test_fused_decode_matches_reference_interpreted(td, spec, new):
    layer = filled_layer(spec, batch=2, kv_heads=1, head_dim=32, stored=90 if spec != "kivi-4" else 200, new=new, steps=2, device=TRITON_DEVICE)
    assert_matches_reference(td.attend, layer, 2, new, padding_mask(layer, new, [0, 21]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("spec", ["kivi-4", "kivi-2", "int4", "int8", "full", "rot-3", "fp8-e4m3"])
def test_fused_decode_on_gpu(spec):
    from kvsqueeze.kernels import triton_decode

    layer = filled_layer(spec, batch=4, kv_heads=8, head_dim=128, stored=5000, new=1, steps=3, device="cuda")
    assert_matches_reference(triton_decode.attend, layer, 32, 1, padding_mask(layer, 1, [0, 100, 7, 4000]))
