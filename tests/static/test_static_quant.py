"""Fixed-parameter K/V codes: the graph's quantizer equals the numpy reference, and codes survive a round trip."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvsqueeze.engines.static_manager import StaticKVQuant
from kvsqueeze.engines.static_step import StaticStep

CONFIGS = [(8, False, "channel"), (8, True, "channel"), (8, False, "tensor"), (4, False, "channel"),
           (4, True, "tensor")]


def _quant(bits: int, symmetric: bool, granularity: str, layers: int = 2, heads: int = 2, dim: int = 64,
           seed: int = 0) -> StaticKVQuant:
    rng = np.random.default_rng(seed)
    shape = (layers, heads, dim) if granularity == "channel" else (layers, 1, 1)
    lo = -rng.uniform(0.5, 3.0, shape)
    hi = rng.uniform(0.5, 3.0, shape)
    return StaticKVQuant.from_ranges(lo, hi, lo * 2, hi * 2, bits=bits, symmetric=symmetric, granularity=granularity)


@pytest.mark.parametrize("bits,symmetric,granularity", CONFIGS)
def test_codes_round_trip_bit_exact(bits, symmetric, granularity):
    """Dequantize then quantize with the same fixed parameters gives the same codes back: passing K/V from an
    output to an input can never drift, even if something re-quantized them."""
    q = _quant(bits, symmetric, granularity)
    lo, hi = q.qrange
    rng = np.random.default_rng(1)
    codes = rng.integers(lo, hi + 1, size=(7, 3, 2, 64)).astype(np.float32)
    if bits == 4:
        codes = codes[..., 0::2] + 16 * codes[..., 1::2]
    codes = codes.astype(q.storage_dtype)
    for kind in ("k", "v"):
        for layer in range(2):
            assert np.array_equal(q.quantize(q.dequantize(codes, kind, layer), kind, layer), codes)


@pytest.mark.parametrize("bits,symmetric,granularity", CONFIGS)
@pytest.mark.parametrize("layout", ["token", "head"])
def test_graph_quantizer_matches_numpy_reference(bits, symmetric, granularity, layout, static_llama):
    q = _quant(bits, symmetric, granularity)
    step = StaticStep(static_llama, 8, "decode", layout=layout, quant=q)
    x = torch.randn(2, 2, 5, 64) * 3  # [B, H, T, D], beyond the range too (clipped)
    for kind in ("k", "v"):
        for layer in range(2):
            got = step._to_store(x, kind, layer).numpy()
            ref_in = x.permute(2, 0, 1, 3).numpy() if layout == "token" else x.numpy()
            assert np.array_equal(got, q.quantize(ref_in, kind, layer, layout))
            back = step._from_store(torch.from_numpy(got), kind, layer).numpy()  # [B, H, T, D]
            ref = q.dequantize(got, kind, layer, layout)
            assert np.array_equal(back, ref.transpose(1, 2, 0, 3) if layout == "token" else ref)


def test_quantization_error_is_bounded_inside_the_range():
    q = _quant(8, False, "channel")
    x = np.random.default_rng(2).uniform(-0.4, 0.4, (9, 1, 2, 64)).astype(np.float32)
    err = np.abs(q.dequantize(q.quantize(x, "k", 0), "k", 0) - x)
    assert (err <= q.k_scale[0] / 2 + 1e-6).all()


def test_save_load(tmp_path):
    q = _quant(4, True, "channel")
    q.save(tmp_path / "q.npz")
    back = StaticKVQuant.load(tmp_path / "q.npz")
    assert back.digest() == q.digest() and back.bits == 4 and back.symmetric


def test_bad_parameters(static_llama):
    with pytest.raises(ValueError, match="bits"):
        _quant(3, False, "channel")
    with pytest.raises(ValueError, match="positive"):
        StaticKVQuant(8, False, "tensor", *([np.zeros((1, 1, 1))] * 4))
    with pytest.raises(ValueError, match="layers"):
        StaticStep(static_llama, 8, "decode", quant=_quant(8, False, "channel", layers=3))
