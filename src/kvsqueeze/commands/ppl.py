"""kvsqueeze ppl: perplexity of a preset or peer under a stated protocol, with a complete JSON record."""

from __future__ import annotations

import argparse

from . import _options


def add_arguments(p: argparse.ArgumentParser) -> None:
    _options.add_kv(p)
    _options.add_model_and_threads(p)
    _options.add_corpus(p.add_mutually_exclusive_group())
    p.add_argument("--context", type=int, default=1024, help="tokens per chunk (default 1024)")
    p.add_argument("--chunks", type=int, default=4, help="consecutive chunks from the corpus start (default 4)")
    p.add_argument("--protocol", default=None, choices=["decode", "window", "all-quantized"],
                   help="which K/V each scored token sees (default: window for presets, decode for transformers' "
                        "caches, which only decode can measure, all-quantized for vllm:* and llamacpp:*, which "
                        "only it can)")
    p.add_argument("--prefix", type=int, default=None,
                   help="tokens prefilled before scoring (default: context/2 for decode, 0 for window)")
    _options.add_prefill_chunk(p)
    _options.add_json(p, "the full result")


def run(args: argparse.Namespace) -> int:
    import time

    from kvsqueeze import corpus as corpus_mod
    from kvsqueeze.eval import engine_peers, meta, vllm_peer
    from kvsqueeze.eval.ppl import check_protocol, default_prefix, run_ppl
    from kvsqueeze.resolve import is_peer

    start = time.perf_counter()
    # everything that can be checked without the model fails here, before anything is loaded
    kv = _options.resolve_kv_option(args.kv)
    engine = engine_peers.is_engine(kv)
    protocol = args.protocol or ("all-quantized" if engine else "decode" if is_peer(kv) else "window")
    prefix = default_prefix(protocol, args.context) if args.prefix is None else args.prefix
    check_protocol(kv, protocol, prefix, args.context)
    if args.chunks < 1:
        raise ValueError(f"--chunks must be at least 1, got {args.chunks}")
    corpus = corpus_mod.resolve_corpus(args.text, args.dataset)
    model, tokenizer, threads = meta.load_for_eval(args.model, args.threads)
    if engine:  # what the engine loads (vLLM: the converted checkpoint, written by the load above), or one line
        engine_peers.check_model(kv, args.model)
    meta.check_context(model, args.context, "--context")
    _options.check_prefill_chunk(args, model)
    ids = corpus_mod.tokenize(corpus, tokenizer)
    chunks = corpus_mod.eval_chunks(ids, args.context, args.chunks)
    chunking = "" if protocol == "all-quantized" or not prefix else \
        f", prefill chunk {args.prefill_chunk or 'one pass'}"
    print(f"kvsqueeze ppl: {args.kv}, protocol {protocol} (prefix {prefix}{chunking}), {args.chunks} x "
          f"{args.context} tokens of {corpus.name}, {threads} threads")
    print(f"corpus {corpus_mod.summary(corpus)}; found by: {'; '.join(corpus.resolution)}")
    if engine:
        from kvsqueeze.layout import model_kv_layout

        # bytes computed from the model's layout (vLLM's own dtypes: bits per element from the dtype alone)
        layout = None if vllm_peer.is_vllm(kv) and not kv.plugin_format else model_kv_layout(model.config)
        vocab = model.get_output_embeddings().weight.shape[0]
        res = engine_peers.run_ppl(kv, chunks, args.model, threads, layout=layout, vocab=vocab)
    else:
        res = run_ppl(model, chunks, args.kv, protocol, prefix, prefill_chunk=args.prefill_chunk)
    wall = time.perf_counter() - start
    b = res.get("kv_bytes")
    if b is None:  # vLLM's paged cache: bits per element from its dtype
        bits = "n/a" if res["bits_per_element"] is None else f"{res['bits_per_element']:g}"
        size = f"{bits} bits/element ({res['engine']})"
    else:
        bits = "n/a" if b["bits_per_element"] is None else f"{b['bits_per_element']:.3f}"
        size = f"{bits} bits/element with all metadata, {b['bytes_per_token']:.0f} KV bytes/token"
        if engine:
            size += f" (computed from the storage types; {res['engine']})"
    print(f"ppl {res['ppl']:.4f} over {res['tokens_scored']} tokens ({res['scored_positions']}); {size}; "
          f"{wall:.1f} s")
    if res.get("vllm_pool"):
        print(vllm_peer.pool_line(res["vllm_pool"]))
    if args.json:
        record = {
            **res,
            "model": meta.model_info(model, args.model),
            "corpus": {**corpus.describe(), "tokens": int(ids.numel()),
                       "evaluated_fraction_limit": corpus_mod.MAX_EVAL_FRACTION},
            "threads": threads,
            "wall_seconds": wall,
            "command": meta.command_line(args),
            "date": meta.now(),
            "machine": meta.machine_info(),
        }
        _options.write_json(args, record)
    return 0
