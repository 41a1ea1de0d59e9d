"""Attention routing leaves nothing behind: a QuantizedCache routes each step it serves, kvsqueeze.patch routes a
block, and the model's attention implementation is what it was afterwards, on success and on failure."""

from __future__ import annotations

import copy

import pytest
import torch

import kvsqueeze
from kvsqueeze.adapter import ATTN_NAME, QuantizedCache, cache_kwargs


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(2, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def _impls(model) -> tuple[str, str]:
    return model.config._attn_implementation, model.config.get_text_config(decoder=True)._attn_implementation


def test_generate_with_the_cache_restores_the_attention_implementation(tiny_llama):
    assert _impls(tiny_llama) == ("sdpa", "sdpa")
    cache = QuantizedCache(tiny_llama.config, "kivi-4")
    assert _impls(tiny_llama) == ("sdpa", "sdpa")  # creating a cache changes nothing
    with torch.no_grad():
        out = tiny_llama.generate(_ids(40), **cache_kwargs(tiny_llama, cache), max_new_tokens=5, do_sample=False)
    assert out.shape == (1, 45)
    assert cache.get_seq_length() == 44  # the last generated token is never fed back
    assert _impls(tiny_llama) == ("sdpa", "sdpa")


def test_routed_steps_equal_patched_steps(tiny_llama):
    """Per-step routing and an explicit patch give bit-identical logits (same attention function, same mask)."""
    ids = _ids(70, seed=1)

    def run(cache):
        with torch.no_grad():
            first = tiny_llama(ids[:, :60], **cache_kwargs(tiny_llama, cache)).logits
            rest = [tiny_llama(ids[:, t:t + 1], **cache_kwargs(tiny_llama, cache)).logits for t in range(60, 70)]
        return torch.cat([first[:, -1:], *rest], dim=1)

    routed = run(QuantizedCache(tiny_llama.config, "k4c32-v4t32-w32"))
    with kvsqueeze.patch(tiny_llama) as p:
        assert _impls(tiny_llama) == (ATTN_NAME, ATTN_NAME)
        patched = run(QuantizedCache(tiny_llama.config, "k4c32-v4t32-w32"))
    assert isinstance(p, kvsqueeze.adapter.AttentionPatch)
    assert _impls(tiny_llama) == ("sdpa", "sdpa")
    assert torch.equal(routed, patched)


def test_eager_models_are_routed_and_restored(tiny_llama):
    """An eager-attention model gets its additive float mask read correctly: full precision through the cache equals
    the model's own eager attention."""
    eager = copy.deepcopy(tiny_llama)
    eager.config._attn_implementation = "eager"
    ids = _ids(50, seed=2)
    with torch.no_grad():
        ref = eager(ids).logits
        cache = QuantizedCache(eager.config, "full")
        out = torch.cat([eager(ids[:, :30], **cache_kwargs(eager, cache)).logits,
                         eager(ids[:, 30:], **cache_kwargs(eager, cache)).logits], dim=1)
    assert eager.config._attn_implementation == "eager"
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_a_failed_step_restores_the_attention_implementation(tiny_llama):
    cache = QuantizedCache(tiny_llama.config, "kivi-4")
    with torch.no_grad():
        tiny_llama(_ids(20), **cache_kwargs(tiny_llama, cache))

    def boom(*args):
        raise RuntimeError("kernel failure")

    cache.layers[-1].kv.attend = boom
    with pytest.raises(RuntimeError, match="kernel failure"), torch.no_grad():
        tiny_llama(_ids(1), **cache_kwargs(tiny_llama, cache))
    assert _impls(tiny_llama) == ("sdpa", "sdpa")
    assert cache.get_seq_length() == 20


def test_unreadable_mask_implementations_are_refused_before_anything_changes(tiny_llama):
    model = copy.deepcopy(tiny_llama)
    model.config._attn_implementation = "flash_attention_2"
    cache = QuantizedCache(model.config, "kivi-4")
    with pytest.raises(RuntimeError, match=r"uses 'flash_attention_2'.*kvsqueeze.patch\(model\)"):
        cache.update(torch.zeros(1, 2, 3, 64), torch.zeros(1, 2, 3, 64), 0)
    assert model.config._attn_implementation == "flash_attention_2"
    assert cache.get_seq_length() == 0


def test_patch_undo_restores_exactly_what_was_there(tiny_llama):
    model = copy.deepcopy(tiny_llama)
    model.config._attn_implementation = "eager"
    handle = kvsqueeze.patch(model)
    assert model.config._attn_implementation == ATTN_NAME
    handle.undo()
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize("batch", [1, 2])
def test_transformers_chunked_prefill_works_with_the_cache(tiny_llama, batch):
    """``generate(..., prefill_chunk_size=N)`` fills the cache chunk by chunk (each chunk quantized as it leaves
    the window) and scores the same as kvsqueeze's own chunked prefill followed by greedy steps."""
    from kvsqueeze.eval.peers import prefill

    spec = "k2c16-v2t16-w16-s2"
    ids = torch.cat([_ids(70, seed=s) for s in range(batch)])
    kw = dict(max_new_tokens=4, do_sample=False, output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        got = tiny_llama.generate(ids, **cache_kwargs(tiny_llama, QuantizedCache(tiny_llama.config, spec)),
                                  prefill_chunk_size=24, **kw)
        one_pass = tiny_llama.generate(ids, **cache_kwargs(tiny_llama, QuantizedCache(tiny_llama.config, spec)), **kw)
        cache = QuantizedCache(tiny_llama.config, spec)
        head = tiny_llama.get_output_embeddings()
        want = [head(prefill(tiny_llama, ids, cache, chunk=24))]
        for step in range(3):
            step_ids = got.sequences[:, 70 + step:71 + step]
            h = tiny_llama.model(input_ids=step_ids, **cache_kwargs(tiny_llama.model, cache)).last_hidden_state
            want.append(head(h[:, -1]))
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want), atol=1e-4, rtol=1e-4)
    assert not torch.allclose(torch.stack(got.logits)[0], torch.stack(one_pass.logits)[0], atol=1e-4)
    assert _impls(tiny_llama) == ("sdpa", "sdpa")


def test_attention_clock_times_both_routes_and_restores_them(tiny_llama):
    """The clock sees every layer's attention call, kvsqueeze's and transformers' SDPA alike, and leaves the
    registered functions as they were, also when the block raises."""
    from transformers.modeling_utils import AttentionInterface

    from kvsqueeze.adapter import attention_clock

    before = {name: AttentionInterface()[name] for name in ("sdpa", ATTN_NAME)}
    layers = tiny_llama.config.num_hidden_layers
    with torch.no_grad(), attention_clock() as clock:
        tiny_llama(_ids(20), **cache_kwargs(tiny_llama, QuantizedCache(tiny_llama.config, "kivi-4")), use_cache=True)
        assert clock.calls == layers and clock.seconds > 0  # kvsqueeze's function (a prompt: SDPA inside it)
        tiny_llama(_ids(20), use_cache=False)
        assert clock.calls == 2 * layers  # the model's own SDPA
    assert {name: AttentionInterface()[name] for name in before} == before
    with pytest.raises(RuntimeError, match="inside"), attention_clock():
        raise RuntimeError("inside")
    assert {name: AttentionInterface()[name] for name in before} == before


def test_speed_reports_no_attention_time_it_could_not_see(tiny_llama):
    """A model on transformers' eager attention calls a function of its own module, which the clock does not see:
    the speed record says None rather than 0 ms; on SDPA it reports the time."""
    from kvsqueeze.eval.speed import measure_speed

    eager = copy.deepcopy(tiny_llama)
    eager.config._attn_implementation = "eager"
    assert measure_speed(eager, "hf-dynamic", 24, 2)["decode_attention_ms_per_token"] is None
    assert measure_speed(tiny_llama, "hf-dynamic", 24, 2)["decode_attention_ms_per_token"] > 0
