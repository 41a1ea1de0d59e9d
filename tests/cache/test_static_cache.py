"""The static-shape quantized cache: the same outputs as the dynamic cache, a decode step torch.compile captures
whole, and one-line refusals."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import kvsqueeze
from kvsqueeze.adapter import QuantizedCache, StaticQuantizedCache, cache_kwargs
from kvsqueeze.spec import preset

SPECS = ["kivi-4", "kivi-2-sink4", "k4t64-v4t32-w32", "k8t64-v8t64", "fp8-e4m3", "rot-3", "32 sinks"]


def _spec(name):
    return dataclasses.replace(preset("kivi-4"), sinks=32) if name == "32 sinks" else name


def _run(model, cache, prompt, steps, chunks=(None,), step_fn=None):
    """Logits of the prompt's last token and of ``steps`` greedy decode steps (prompt in ``chunks`` passes)."""
    fwd = model if step_fn is None else step_fn
    out = []
    with torch.no_grad(), kvsqueeze.patch(model):
        pieces = torch.tensor_split(prompt, [c for c in chunks if c], dim=1) if chunks != (None,) else [prompt]
        for piece in pieces:
            logits = model(input_ids=piece, **cache_kwargs(model, cache), use_cache=True).logits
        out.append(logits[:, -1].clone())
        nxt = logits[:, -1:].argmax(-1)
        for _ in range(steps):
            logits = fwd(input_ids=nxt, **cache_kwargs(model, cache), use_cache=True).logits
            out.append(logits[:, -1].clone())
            nxt = logits[:, -1:].argmax(-1)
    return torch.stack(out)


@pytest.mark.parametrize("spec", SPECS)
def test_same_logits_as_the_dynamic_cache(tiny_llama, spec):
    # 150 prompt tokens then 80 steps: groups flushed by the prompt and by decode steps, past several window wraps
    prompt = torch.randint(0, 256, (1, 150), generator=torch.Generator().manual_seed(1))
    spec = _spec(spec)
    want = _run(tiny_llama, QuantizedCache(tiny_llama.config, spec, backend="torch"), prompt, 80)
    got = _run(tiny_llama, StaticQuantizedCache(tiny_llama.config, spec, 256, backend="torch"), prompt, 80)
    assert torch.allclose(got, want, atol=2e-5, rtol=0), (got - want).abs().max()


def test_chunked_prompt_and_the_fast_kernel(tiny_llama):
    prompt = torch.randint(0, 256, (2, 170), generator=torch.Generator().manual_seed(2))
    want = _run(tiny_llama, QuantizedCache(tiny_llama.config, "kivi-4", backend="torch"), prompt, 40)
    got = _run(tiny_llama, StaticQuantizedCache(tiny_llama.config, "kivi-4", 256), prompt, 40, chunks=(60, 130))
    assert torch.allclose(got, want, atol=1e-3, rtol=0), (got - want).abs().max()


def test_compiled_decode_is_one_graph_with_eager_outputs(tiny_llama):
    """fullgraph=True: the step's writes, the attention operator and the flush trace without a break; the compiled
    steps give the eager steps' logits (aot_eager: the graph as traced, without inductor's own rounding)."""
    prompt = torch.randint(0, 256, (1, 150), generator=torch.Generator().manual_seed(3))
    eager = _run(tiny_llama, StaticQuantizedCache(tiny_llama.config, "kivi-4", 256), prompt, 45)
    torch._dynamo.reset()
    compiled = torch.compile(tiny_llama, backend="aot_eager", fullgraph=True)
    got = _run(tiny_llama, StaticQuantizedCache(tiny_llama.config, "kivi-4", 256), prompt, 45, step_fn=compiled)
    assert torch.equal(got, eager), (got - eager).abs().max()


def test_generate_with_left_padding_matches_the_dynamic_cache(tiny_llama):
    ids = torch.randint(3, 256, (2, 180), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    ids[1, :25], mask[1, :25] = 0, 0  # the second row is 25 tokens shorter, padded on the left
    outs = []
    for cache in (QuantizedCache(tiny_llama.config, "kivi-4"), StaticQuantizedCache(tiny_llama.config, "kivi-4", 256)):
        with torch.no_grad(), kvsqueeze.patch(tiny_llama):
            outs.append(tiny_llama.generate(input_ids=ids, attention_mask=mask, max_new_tokens=40, do_sample=False,
                                            pad_token_id=0, **cache_kwargs(tiny_llama, cache)))
    assert torch.equal(outs[0], outs[1])


def test_a_prompt_shorter_than_the_sinks(tiny_llama):
    """Decode steps that write sinks (a 2-token prompt, 4 sinks), compiled: the same logits as the dynamic cache."""
    prompt = torch.randint(0, 256, (1, 2), generator=torch.Generator().manual_seed(7))
    want = _run(tiny_llama, QuantizedCache(tiny_llama.config, "kivi-2-sink4", backend="torch"), prompt, 200)
    torch._dynamo.reset()
    compiled = torch.compile(tiny_llama, backend="aot_eager", fullgraph=True)
    got = _run(tiny_llama, StaticQuantizedCache(tiny_llama.config, "kivi-2-sink4", 256, backend="torch"), prompt, 200,
               step_fn=compiled)
    assert torch.allclose(got, want, atol=2e-5, rtol=0), (got - want).abs().max()


def test_refusals(tiny_llama, tiny_mixed_sliding):
    with pytest.raises(ValueError, match="sliding-window layers"):
        StaticQuantizedCache(tiny_mixed_sliding.config, "kivi-4", 256)
    for bad in (0, -5, 2.5, "4096", True):
        with pytest.raises(ValueError, match="max_cache_len must be a positive int"):
            StaticQuantizedCache(tiny_llama.config, "kivi-4", bad)
    filled = StaticQuantizedCache(tiny_llama.config, "kivi-4", 64)
    with torch.no_grad(), kvsqueeze.patch(tiny_llama):
        tiny_llama(input_ids=torch.zeros(1, 4, dtype=torch.long), **cache_kwargs(tiny_llama, filled))
        filled.reset()
        with pytest.raises(ValueError, match="holds batch 1 x 2 KV heads"):  # another batch: refused, not reshaped
            tiny_llama(input_ids=torch.zeros(2, 4, dtype=torch.long), **cache_kwargs(tiny_llama, filled))
    cache = StaticQuantizedCache(tiny_llama.config, "kivi-4", 64)
    with torch.no_grad(), pytest.raises(RuntimeError, match="kvsqueeze.patch"):  # not routed: refused, not wrong
        tiny_llama(input_ids=torch.zeros(1, 4, dtype=torch.long), **cache_kwargs(tiny_llama, cache))
    with torch.no_grad(), kvsqueeze.patch(tiny_llama):
        with pytest.raises(ValueError, match="holds 64 tokens"):
            tiny_llama(input_ids=torch.zeros(1, 65, dtype=torch.long), **cache_kwargs(tiny_llama, cache))
        tiny_llama(input_ids=torch.zeros(1, 64, dtype=torch.long), **cache_kwargs(tiny_llama, cache))
        with pytest.raises(RuntimeError, match="holds 64 tokens; this step needs 65"):
            tiny_llama(input_ids=torch.zeros(1, 1, dtype=torch.long), **cache_kwargs(tiny_llama, cache))


def test_bytes_are_the_allocation(tiny_llama):
    cache = StaticQuantizedCache(tiny_llama.config, "kivi-4", 512)
    with torch.no_grad(), kvsqueeze.patch(tiny_llama):
        tiny_llama(input_ids=torch.zeros(1, 300, dtype=torch.long), **cache_kwargs(tiny_llama, cache))
    nb = cache.nbytes()
    # 2 layers x 2 KV heads x 64 dims x 512 rows: 4-bit codes (32 bytes a row) and fp16 parameters per 32 channels
    # (values) or per 32 tokens (keys), 2 bytes each for scale and zero; the ring: 128 + 64 fp32 tokens per side
    assert nb.codes == 2 * 2 * 2 * 512 * 32
    assert nb.params == 2 * 2 * (512 // 32 * 64 * 4 + 512 * 2 * 4)
    assert nb.full_precision == 2 * 2 * 2 * 192 * 64 * 4
    assert nb.elements == 2 * 2 * 2 * 64 * 300 and nb.quantized_elements == 2 * 2 * 2 * 64 * 160


def test_a_reset_cache_serves_a_new_prompt_as_a_fresh_one(tiny_llama):
    """reset() keeps the tensors (a compiled graph's) and forgets everything derived from their old contents."""
    g = torch.Generator().manual_seed(6)
    a, b = torch.randint(0, 256, (1, 170), generator=g), torch.randint(0, 256, (1, 170), generator=g)
    fresh = _run(tiny_llama, StaticQuantizedCache(tiny_llama.config, "kivi-4", 256), b, 30)
    cache = StaticQuantizedCache(tiny_llama.config, "kivi-4", 256)
    _run(tiny_llama, cache, a, 30)
    cache.reset()
    assert int(cache.get_seq_length()) == 0
    assert torch.equal(_run(tiny_llama, cache, b, 30), fresh)


def test_beam_search_reorders_rows_in_place_and_shape_edits_are_refused(tiny_llama):
    from kvsqueeze.errors import CacheEditError

    ids = torch.randint(3, 256, (2, 170), generator=torch.Generator().manual_seed(8))
    outs = []
    for cache in (QuantizedCache(tiny_llama.config, "kivi-4"), StaticQuantizedCache(tiny_llama.config, "kivi-4", 256)):
        with torch.no_grad(), kvsqueeze.patch(tiny_llama):
            tiny_llama(input_ids=ids, **cache_kwargs(tiny_llama, cache))
            cache.reorder_cache(torch.tensor([1, 0]))
            outs.append(tiny_llama(input_ids=ids[:, -1:], **cache_kwargs(tiny_llama, cache)).logits)
    assert torch.allclose(outs[0], outs[1], atol=1e-4), (outs[0] - outs[1]).abs().max()
    with pytest.raises(CacheEditError, match="keeps its batch of 2"):
        cache.batch_select_indices(torch.tensor([0]))
    with pytest.raises(CacheEditError):
        cache.batch_repeat_interleave(2)
    with pytest.raises(CacheEditError):
        cache.crop(-3)
