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


def _fixed(bits: int, symmetric: bool, scale: list[float], zero: list[float]) -> StaticKVQuant:
    """One layer, one KV head, parameters per channel (``len(scale)`` channels) or per tensor (one value)."""
    s = np.array(scale, np.float32).reshape(1, 1, -1)
    z = np.array(zero, np.float32).reshape(1, 1, -1)
    return StaticKVQuant(bits, symmetric, "channel" if s.size > 1 else "tensor", s, z, s, z)


@pytest.mark.parametrize("bits,symmetric,scale,zero,x,codes,values", [
    # 8-bit symmetric: int8 in [-127, 127], zero-point 0; round half to even (0.5 -> 0, 2.5 -> 2)
    (8, True, [0.25], [0.0], [-40.0, 0.125, 31.75, 0.625], [-127, 0, 127, 2], [-31.75, 0.0, 31.75, 0.5]),
    # 8-bit asymmetric: uint8 with a zero-point, clipped at 255
    (8, False, [0.5], [128.0], [-64.0, 0.25, 63.5, 100.0], [0, 128, 255, 255], [-64.0, 0.0, 63.5, 63.5]),
    # 4-bit symmetric, zero-point 8, codes in [1, 15]: channel 2i in the low nibble, 2i + 1 in the high one
    (4, True, [0.5], [8.0], [-1.0, 0.5, 3.0, 100.0], [6 + 16 * 9, 14 + 16 * 15], [-1.0, 0.5, 3.0, 3.5]),
    # 4-bit asymmetric, per channel
    (4, False, [0.25, 1.0, 0.125, 2.0], [4.0, 0.0, 15.0, 3.0], [0.5, -3.0, -1.0, 5.0], [6 + 16 * 0, 7 + 16 * 5],
     [0.5, 0.0, -1.0, 4.0]),
])
def test_stored_codes_reference_values(bits, symmetric, scale, zero, x, codes, values):
    """The stored form is fixed: exported graphs and saved parameters keep their meaning only if it never moves."""
    q = _fixed(bits, symmetric, scale, zero)
    xs = np.array(x, np.float32).reshape(1, 1, 1, -1)  # token layout [T, B, H, D]
    got = q.quantize(xs, "k", 0)
    assert got.dtype == q.storage_dtype and got.reshape(-1).tolist() == codes
    back = q.dequantize(got, "v", 0)
    assert back.dtype == np.float32 and back.reshape(-1).tolist() == values
    step_codes = q.codes_torch(torch.from_numpy(xs), torch.from_numpy(q.k_scale[0]), torch.from_numpy(q.k_zero[0]))
    assert step_codes.numpy().reshape(-1).tolist() == codes


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5, 8])
def test_exportable_unpacker_equals_the_packer_inverse(bits):
    from kvsqueeze.quant.packing import pack_bits, unpack_bits, unpack_bits_exportable

    codes = torch.randint(0, 1 << bits, (3, 2, 48), dtype=torch.uint8, generator=torch.Generator().manual_seed(bits))
    packed = pack_bits(codes, bits)
    assert torch.equal(unpack_bits_exportable(packed, bits, 48), codes)
    assert torch.equal(unpack_bits(packed, bits, 48), codes)
    with pytest.raises(ValueError, match="packed dim"):
        unpack_bits_exportable(packed[..., 1:], bits, 48)


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
