"""kvsqueeze generate: stream text from a model whose KV cache is quantized, then report the cache size."""

from __future__ import annotations

import argparse

from . import _options

DEFAULT_KV = "kivi-4"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", required=True, help="the prompt text")
    _options.add_kv(p, default=DEFAULT_KV, help="cache: a preset (kvsqueeze presets), a spec string like "
                                                "k2c32-v2t32-w128-s4, JSON, or a calibration artifact directory "
                                                "(or a folder holding exactly one)")
    _options.add_model(p)
    p.add_argument("--max-new-tokens", type=int, default=256,
                   help="new tokens (default 256: with a short prompt, past the usual 128-token window)")
    p.add_argument("--raw", action="store_true", help="do not wrap the prompt in the model's chat template")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    _options.add_prefill_chunk(p)
    _options.add_threads(p)


def run(args: argparse.Namespace) -> int:
    # an unknown cache, a bad artifact or a peer (generate builds kvsqueeze's cache) fail before the model loads
    spec = _options.cache_spec_option(args.kv, "generate")
    if args.max_new_tokens < 1:
        raise ValueError("--max-new-tokens must be at least 1")

    import torch
    from transformers import TextStreamer

    from kvsqueeze.adapter import QuantizedCache, cache_kwargs
    from kvsqueeze.models import load_model

    torch.set_num_threads(args.threads)
    model, tok = load_model(args.model)
    _options.check_prefill_chunk(args, model)
    cache = QuantizedCache(model.config, spec)
    if not args.raw and getattr(tok, "chat_template", None):
        text = tok.apply_chat_template([{"role": "user", "content": args.prompt}], tokenize=False,
                                       add_generation_prompt=True)
    else:
        text = args.prompt
    inputs = tok(text, return_tensors="pt", add_special_tokens=args.raw or not getattr(tok, "chat_template", None))
    sample = args.temperature > 0
    with torch.no_grad():
        model.generate(**inputs, **cache_kwargs(model, cache), max_new_tokens=args.max_new_tokens, do_sample=sample,
                       temperature=args.temperature if sample else None, top_p=None, top_k=None,
                       streamer=TextStreamer(tok, skip_prompt=True, skip_special_tokens=True),
                       pad_token_id=tok.pad_token_id, prefill_chunk_size=args.prefill_chunk or None)
    nb = cache.nbytes()
    print(f"[{spec.name}] {cache.token_summary()}; {nb.summary()}, "
          f"{nb.total / max(cache.get_seq_length(), 1):.0f} bytes/token, threads {torch.get_num_threads()}")
    return 0
