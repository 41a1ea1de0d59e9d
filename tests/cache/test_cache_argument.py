"""The cache argument under the name the installed transformers expects (``cache=`` from 5.24, ``past_key_values=``
before), the cache's own account of where its tokens sit, and the attention path each step ran on."""

from __future__ import annotations

import inspect
import warnings

import torch
from transformers import DynamicCache

from kvsqueeze.adapter import (
    QuantizedCache,
    attention_paths,
    cache_arg,
    cache_kwargs,
    describe_paths,
    output_cache,
)

SPEC = "k4c32-v4t32-w32"  # 32-token window, keys quantized 32 tokens at a time


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(2, 256, (1, n), generator=torch.Generator().manual_seed(seed))


def test_cache_kwargs_names_the_argument_forward_takes(tiny_llama):
    name = cache_arg(tiny_llama)
    assert name in ("cache", "past_key_values")
    assert name in inspect.signature(type(tiny_llama).forward).parameters
    assert cache_kwargs(tiny_llama, "x") == {name: "x"}


def test_forward_and_generate_through_cache_kwargs_raise_no_deprecation(tiny_llama):
    cache = QuantizedCache(tiny_llama.config, SPEC)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        out = tiny_llama(_ids(40), **cache_kwargs(tiny_llama, cache), use_cache=True)
        assert output_cache(out) is cache
        gen = QuantizedCache(tiny_llama.config, SPEC)
        tiny_llama.generate(_ids(10), **cache_kwargs(tiny_llama, gen), max_new_tokens=3, do_sample=False,
                            pad_token_id=0)
    assert cache.get_seq_length() == 40 and gen.get_seq_length() == 12


def test_token_summary_before_and_after_quantization_starts(tiny_llama):
    cache = QuantizedCache(tiny_llama.config, SPEC)
    with torch.no_grad():
        tiny_llama(_ids(40), **cache_kwargs(tiny_llama, cache), use_cache=True)
        assert cache.token_summary() == ("40 tokens, all in the 32-token full-precision window: quantization "
                                         "starts at 64 tokens, 32 at a time")
        tiny_llama(_ids(30, seed=1), **cache_kwargs(tiny_llama, cache), use_cache=True)
    assert cache.token_summary() == "70 tokens: 32 quantized, 38 in the 32-token full-precision window"
    summary = cache.summary()
    assert summary.startswith(cache.token_summary() + "; KV cache ") and "quantized part" in summary


def test_attention_paths_name_what_each_step_ran_on(tiny_llama):
    cache = QuantizedCache(tiny_llama.config, SPEC, backend="torch")
    kw = cache_kwargs(tiny_llama, cache)
    with torch.no_grad():
        tiny_llama(_ids(70), **kw, use_cache=True)  # a prompt: nothing stored yet, transformers' SDPA
        for t in range(3):
            tiny_llama(_ids(1, seed=t), **kw, use_cache=True)
    paths = attention_paths(cache)
    assert paths == {"reference": 2 * 3, "sdpa": 2}  # 2 layers
    assert describe_paths(paths) == "reference"  # a prompt's SDPA is not the cache's path
    assert describe_paths({"cpu-kernel avx2": 3, "reference": 1, "sdpa": 1}) == (
        "cpu-kernel avx2 60%, reference 20%, sdpa 20%")
    assert describe_paths({}) == "n/a"
    assert attention_paths(DynamicCache(), tiny_llama) == {"sdpa": 0}
