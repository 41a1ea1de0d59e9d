"""The C++ kernel's rotated codebook kind (attention read straight from the codes) against the reference, which
decodes every block back to the original space and attends to it (same tolerance as test_cpu_kernel.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvsqueeze.adapter import cache_kwargs
from kvsqueeze.cache.plan import Memo
from kvsqueeze.kernels import cpu, reference

from ._helpers import (
    INT_DOT_ATOL,
    assert_matches_reference,
    exact_keys_kernel_and_own_error,
    filled_layer,
    kernel_and_own_error,
    kernel_rounds,
    padding_mask,
    query_for,
)

pytestmark = [pytest.mark.skipif(not cpu.available(), reason="C++ kernel could not be built here"),
              pytest.mark.usefixtures("cpu_isa")]

SPECS = [
    "rot-3", "rot-3.5",
    "k2.75r-v2.75r-w64-s3",  # mixed 3/2-bit runs on both sides
    "k1r-v1.5r",  # 1-bit and 1/2-bit runs, no window, no sinks
    "k3.25r-v2c32-w32",  # rotated keys beside per-channel integer values (and the reverse below)
    "k2c32-v3.5r-w32-s1",
    "k2.875rc128-v2.5r-w128-s4",  # centred keys (a mean per channel per 128 tokens), plain values
    "k3rc32-v2.375rc32-w64-s3",  # both sides centred over 32-token groups
    "k2.5rc16-v2c16-w32",  # centred rotated keys beside per-channel integer values of the same group
]


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("new", [1, 3])
def test_matches_reference_gqa_batch_padding(spec, new):
    layer = filled_layer(spec, batch=2, kv_heads=2, stored=300, new=new, steps=4)
    assert cpu.supports(layer.plan())
    assert_matches_reference(cpu.attend, layer, 6, new)
    assert_matches_reference(cpu.attend, layer, 6, new, padding_mask(layer, new, [0, 45]))


@pytest.mark.parametrize("stored", [1, 5, 129, 133, 700])
def test_block_and_window_boundaries(stored):
    layer = filled_layer("rot-3", batch=1, kv_heads=1, stored=stored, new=1, steps=min(stored, 3))
    assert_matches_reference(cpu.attend, layer, 4, 1)


@pytest.mark.parametrize("head_dim", [16, 32, 128])
@pytest.mark.parametrize("spec", ["k2.5r-v3r-w32-s2", "k2.5rc32-v3rc32-w32-s2"])
def test_head_dims(head_dim, spec):
    layer = filled_layer(spec, batch=1, kv_heads=2, head_dim=head_dim, stored=300, new=1)
    assert_matches_reference(cpu.attend, layer, 2, 1)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("q_per_kv", [1, 2, 4, 5])
@pytest.mark.parametrize("spec", ["rot-3.5", "k3.25r-v1.5r-w32-s1"])
def test_query_rows_per_kv_head(spec, q_per_kv, head_dim):
    """Every row-group size of the codebook loops (1-4 query rows per call; 5 = 4 + 1), with 16-level (4-bit)
    high runs, 1-bit low runs and the value passes' remainders."""
    layer = filled_layer(spec, batch=1, kv_heads=2, head_dim=head_dim, stored=300, new=1)
    assert_matches_reference(cpu.attend, layer, 2 * q_per_kv, 1)


@pytest.mark.parametrize("stored", [3, 131, 260, 700])
def test_centred_group_boundaries(stored):
    """Centred layouts: blocks of two 128-token groups, tiles crossing a group's end, partly filled blocks."""
    layer = filled_layer("k2.875rc128-v2.375rc128-w128-s4", batch=1, kv_heads=1, stored=stored, new=1,
                         steps=min(stored, 3))
    assert_matches_reference(cpu.attend, layer, 4, 1)


def test_scores_come_from_the_codes():
    """The kernel does not read a decoded copy: corrupting one stored code byte changes its output exactly as it
    changes the reference's."""
    layer = filled_layer("k4r-v4r", batch=1, kv_heads=1, stored=64, new=1)
    q = query_for(layer, 1, 1)
    before = cpu.attend(q, layer.plan(), None, 0.125)
    layer.store.blocks[0].parts["k.codes"][0, 0, 3, 0] ^= 0xFF
    after = cpu.attend(q, layer.plan(), None, 0.125)
    assert not torch.allclose(before, after)
    assert_matches_reference(cpu.attend, layer, 1, 1)  # (the same query as q)


def test_sign_sketch_uses_the_reference():
    layer = filled_layer("k2rq-v2r", batch=1, kv_heads=1, stored=200, new=1)
    assert not cpu.supports(layer.plan())
    q = query_for(layer, 2, 1)
    assert torch.equal(cpu.attend(q, layer.plan(), None, 0.125), reference.attend(q, layer.plan(), None, 0.125))


@pytest.mark.parametrize("spec", ["rot-3", "k2.5r-v4r-w32-s4", "k3rc32-v2.5rc32-w32-s4"])
def test_greedy_generation_matches_reference_tiny_llama(tiny_llama, spec):
    from kvsqueeze.adapter import QuantizedCache

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, 256, (1, 150), generator=g)  # longer than the window: history is stored as codes

    def generate(backend):
        cache = QuantizedCache(tiny_llama.config, spec, backend=backend)
        with torch.no_grad():
            return tiny_llama.generate(ids, **cache_kwargs(tiny_llama, cache), max_new_tokens=12, do_sample=False,
                                       pad_token_id=1)

    assert generate("cpu").tolist() == generate("torch").tolist()


# The fused path (kernels/_csrc/codebook_fast.h: levels in registers, AVX2 / AVX-512 builds, head_dim 64 and 128;
# the generic build keeps the tiled path, run here too by the cpu_isa fixture): the presets, plain keys whose
# stored length is no multiple of 16, centred keys and values over 32 tokens, centred keys over 8-token groups (two
# in a vector of 16 tokens' scores), mixed 4/3-bit and 3/2-bit runs (the vector holding both runs' codes; at
# head_dim 64 on AVX-512 a 16-coordinate vector mixes runs when the high run is an odd multiple of 8: 2.875 bits
# is 56 + 8 coordinates, 2.125 bits 8 + 56, so the first vector is the mixed one and no vector is all high-run).
FUSED_SPECS = ["rot-3", "rot-3.5", "k2.875r-v2.5r-w16-s3", "k3.875rc32-v2.5rc32-w32-s2", "k2.875rc8-v3.5r-w8-s1",
               "k2.125r-v2.875r-w16-s3"]


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("spec", FUSED_SPECS)
@pytest.mark.parametrize("stored", [37, 301])
def test_fused_codebook_path_gqa_rows(spec, head_dim, stored):
    """1-4 query rows per KV head (one new token), batch 2, several stored lengths and append steps."""
    layer = filled_layer(spec, batch=2, kv_heads=2, head_dim=head_dim, stored=stored, new=1, steps=3)
    assert cpu.supports(layer.plan())
    for rows in (1, 2, 3, 4):
        assert_matches_reference(cpu.attend, layer, 2 * rows, 1)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("spec", ["rot-3", "rot-3.5", "k3.875rc32-v2.5rc32-w32-s2"])
def test_fused_codebook_path_several_new_tokens_and_mask(spec, head_dim):
    """3 new tokens x 3 query heads per KV head: 9 rows (blocks of 4, 4 and 1), causal and padded."""
    layer = filled_layer(spec, batch=2, kv_heads=1, head_dim=head_dim, stored=433, new=3, steps=2, seed=5)
    assert_matches_reference(cpu.attend, layer, 3, 3)
    assert_matches_reference(cpu.attend, layer, 3, 3, padding_mask(layer, 3, [0, 77]))


@pytest.mark.parametrize("spec", ["rot-3", "k2.875r-v2.5r-w16-s3", "k2.125r-v2.875r-w16-s3"])
def test_fused_codebook_path_agrees_with_generic_build(spec):
    """Every instruction-set path gives the generic build's output to float32 rounding (same algebra, other sums),
    or within INT_DOT_ATOL where the path scores the keys by int16 levels (avx512-vbmi); 1000 tokens: several
    256-token work items."""
    layer = filled_layer(spec, batch=1, kv_heads=3, stored=1000, new=1, steps=2)
    q = query_for(layer, 9, 1)
    with cpu.use_isa("generic"):
        want = cpu.attend(q, layer.plan(), None, 0.125)
    atol = INT_DOT_ATOL if kernel_rounds(layer.plan()) else 2e-5
    torch.testing.assert_close(cpu.attend(q, layer.plan(), None, 0.125), want, atol=atol, rtol=0)


@pytest.mark.parametrize("spec", ["rot-3", "rot-3.5", "k2.125r-v2.875r-w16-s3", "k3.875rc32-v2.5rc32-w32-s2",
                                  "k1r-v4r-w16", "k4r-v2r-w16"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_integer_rotated_keys_add_a_small_share_of_the_quantization_error(spec, head_dim):
    """The avx512-vbmi path scores rotated keys by int16 levels and query (_csrc/codebook_int.h): against attention
    over the unquantized K/V its error is the reference's own plus at most 1% of it (measured up to 0.15%: rot-3.5 at
    head_dim 64); kernels/cpu.py integer_scores says which path does so, and the rounding is visible exactly there
    (measured 4.9e-5 to 2.6e-4 on these outputs, |o| <= 3; the float levels <= 1.5e-6)."""
    layer, diff, own = kernel_and_own_error(spec, head_dim)
    assert diff <= 0.01 * own
    integer = cpu.integer_scores(layer.plan())
    assert integer == (cpu.selected_isa() == "avx512-vbmi")
    if integer:
        assert diff > 2e-5  # the kernel really rounded (the mirror agrees with codebook_int.h)
    else:
        assert diff <= 1e-5


def _rows_apart(plan, pad: int):
    """``plan`` with every packed segment's codes moved into storage ``pad`` bytes wider per row (a strided view)."""
    def wide(parts):
        codes = parts["codes"]
        store = torch.zeros(*codes.shape[:-1], codes.shape[-1] + pad, dtype=codes.dtype)
        store[..., : codes.shape[-1]] = codes
        return {**parts, "codes": store[..., : codes.shape[-1]]}

    def moved(segs):
        return tuple(dataclasses.replace(s, k_parts=wide(s.k_parts), v_parts=wide(s.v_parts)) if s.k_parts else s
                     for s in segs)

    return dataclasses.replace(plan, before=moved(plan.before), stored=moved(plan.stored), after=moved(plan.after),
                               stored_memo=Memo())


@pytest.mark.parametrize("spec,head_dim", [("rot-3", 64), ("k4r-v4r", 64), ("k2.5r-v3r-w32-s2", 32), ("rot-3", 128),
                                           ("k4r-v4r", 128), ("rot-3", 256)])
@pytest.mark.parametrize("pad", [0, 9, 48])
def test_rows_apart_in_memory(spec, head_dim, pad):
    """Codes whose rows lie ``pad`` bytes apart (a view into wider storage) give the cache's own outputs bit for bit.
    The avx512-vbmi paths (rotated keys and values, _csrc/codebook_int.h PairWindows) read two rows per vector: one
    load where row t + 1's codes lie within 64 bytes of row t's window, two loads and an insert otherwise, one window
    for every vector where rows hold at most 32 bytes; these cases take each way (rot-3 at 64: 23-byte key rows; k4r
    at 64: 32; rot-3 at 128: 46; k4r at 128: 64; rot-3 at 256: 92)."""
    layer = filled_layer(spec, batch=2, kv_heads=2, head_dim=head_dim, stored=300, new=1, steps=2)
    plan = layer.plan()
    apart = _rows_apart(plan, pad)
    assert sum(s.k_parts["codes"].stride(2) == s.k_parts["codes"].shape[-1] + pad for s in apart.segments
               if s.k_parts) >= 1
    assert cpu.supports(apart)
    q = query_for(layer, 6, 1)
    assert torch.equal(cpu.attend(q, apart, None, 0.125), cpu.attend(q, plan, None, 0.125))


@pytest.mark.parametrize("bits", [1.5, 2.5, 3, 3.5, 4])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_integer_rotated_values_add_a_small_share_of_the_quantization_error(bits, head_dim):
    """The avx512-vbmi path weights rotated values by int16 levels and weights, two tokens per dot product
    (_csrc/codebook_int.h).  With exact keys, so that only the values are rounded: against attention over the
    unquantized K/V the kernel's error is the reference's own plus at most 1% of it; kernels/cpu.py integer_values
    says which path does so, and the rounding is visible exactly there (measured 2.3e-4 to 9.2e-4 on these outputs,
    |o| <= 4, at most 0.25% of the format's own error; the float levels <= 5e-6)."""
    from kvsqueeze.spec import QuantSpec

    layer, diff, own = exact_keys_kernel_and_own_error(QuantSpec(fmt="rot", bits=bits, axis="token"), head_dim,
                                                       n=600, q_heads=6, seed=head_dim + int(bits * 8))
    assert diff <= 0.01 * own
    integer = cpu.integer_values(layer.plan())
    assert integer == (cpu.selected_isa() == "avx512-vbmi")
    assert not cpu.integer_scores(layer.plan())
    if integer:
        assert diff > 2e-5  # the kernel really rounded (the mirror agrees with codebook_int.h)
    else:
        assert diff <= 1e-5
