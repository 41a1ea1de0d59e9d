"""kvsqueeze speed: prefill time, decode milliseconds per token and memory of one cache."""

from __future__ import annotations

import argparse

from . import _options


def add_arguments(p: argparse.ArgumentParser) -> None:
    _options.add_kv(p)
    _options.add_model_and_threads(p)
    _options.add_device(p)
    p.add_argument("--context", type=int, default=1024, help="prompt tokens (random ids) (default 1024)")
    p.add_argument("--decode-tokens", type=int, default=32, help="decode steps timed (default 32)")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together (default 1)")
    _options.add_prefill_chunk(p)
    p.add_argument("--compile", action="store_true",
                   help="decode steps through torch.compile (CUDA graphs on a GPU), for compileable caches "
                        "(hf-static); others are refused")
    p.add_argument("--budget", default=None, metavar="SIZE",
                   help="also print the capacity in this memory budget (e.g. 2GiB): the longest context (batch 1) "
                        "and the largest batch of 4096-token sequences, projected from this run's peak and the "
                        "cache's exact bytes (kvsqueeze.eval.capacity)")
    p.add_argument("--batch-context", type=int, default=None, metavar="N",
                   help="with --budget: the context of the largest-batch figure (default 4096; e.g. 32768 for "
                        "32k sequences in a GPU's memory)")
    _options.add_json(p)


def run(args: argparse.Namespace) -> int:
    import time

    from kvsqueeze.eval import meta
    from kvsqueeze.eval.capacity import parse_budget
    from kvsqueeze.eval.peers import describe
    from kvsqueeze.eval.speed import lifetime_max_rss, measure_speed

    start = time.perf_counter()
    from kvsqueeze.eval import engine_peers, vllm_peer

    kv = _options.resolve_kv_option(args.kv)
    engine = engine_peers.is_engine(kv)
    for what, v in (("--context", args.context), ("--decode-tokens", args.decode_tokens), ("--batch", args.batch)):
        if v < 1:
            raise ValueError(f"{what} must be at least 1, got {v}")
    budget = None if args.budget is None else parse_budget(args.budget)
    if args.batch_context is not None and (budget is None or args.batch_context < 1):
        raise ValueError("--batch-context takes a positive number of tokens, with --budget (the budget it projects "
                         f"into); got {args.batch_context}{'' if budget is not None else ' without --budget'}")
    if budget is not None and engine:
        raise ValueError("--budget projects from a cache measured in this process; vLLM's and llama.cpp's caches "
                         "live in their own engines (drop --budget for vllm:* and llamacpp:* caches)")
    if engine and (args.device != "cpu" or args.random_weights or args.compile):
        raise ValueError("vllm:* and llamacpp:* caches run the model in their own engine: --device, --random-weights "
                         "and --compile apply to kvsqueeze and transformers caches only")
    model, threads = _options.model_for_device(args)
    meta.check_context(model, args.context + args.decode_tokens, "--context + --decode-tokens")
    _options.check_prefill_chunk(args, model)
    name = (f", {args.random_weights} with RANDOM WEIGHTS ({model.config.num_hidden_layers} layers)"
            if args.random_weights else "")
    print(f"kvsqueeze speed: {args.kv}, context {args.context}, batch {args.batch}, {args.decode_tokens} decode "
          f"steps, prefill chunk {args.prefill_chunk or 'one pass'}, {threads} threads, {args.device} "
          f"{str(model.dtype).replace('torch.', '')}{name}{', compiled decode' if args.compile else ''}")
    if engine:
        from kvsqueeze.layout import model_kv_layout

        engine_peers.check_model(kv, args.model)
        vocab = model.get_output_embeddings().weight.shape[0]
        r = engine_peers.measure_speed(kv, args.model, vocab, args.context, args.decode_tokens, args.batch, threads,
                                       layout=model_kv_layout(model.config))
        b = r.get("kv_bytes")
        size = "" if b is None else (f"; KV {b['total'] / 2**20:.2f} MiB = {b['bits_per_element']:.3f} bits/element, "
                                     f"computed from the {'dtype' if vllm_peer.is_vllm(kv) else 'storage types'}")
        where = "in its own process" if vllm_peer.is_vllm(kv) else "its median step"
        print(f"prefill {r['prefill_s']:.3f} s ({r['prefill_tokens_per_s']:.0f} tokens/s); decode "
              f"{r['decode_ms_per_token']:.2f} ms/token (batch {args.batch}, {r['engine']}, {where})"
              f"{size}")
        if r.get("vllm_pool"):
            print(vllm_peer.pool_line(r["vllm_pool"]))
        if args.json:
            _options.write_json(args, {**r, "cache": describe([args.kv])[0], "model": meta.model_info(model, args.model or args.random_weights),
                                       "wall_seconds": time.perf_counter() - start, "command": meta.command_line(args),
                                       "date": meta.now(), "machine": meta.machine_info()})
        return 0
    r = measure_speed(model, args.kv, args.context, args.decode_tokens, args.batch, prefill_chunk=args.prefill_chunk,
                      compile=args.compile)
    b = r["kv_bytes"]
    bits = "n/a" if b["bits_per_element"] is None else f"{b['bits_per_element']:.3f}"
    print(f"prefill {r['prefill_s']:.3f} s ({r['prefill_tokens_per_s']:.0f} tokens/s); decode "
          f"{r['decode_ms_per_token']:.2f} ms/token (median of {args.decode_tokens}); peak RSS "
          f"{r['peak_rss_bytes'] / 2**20:.0f} MiB (+{r['peak_rss_delta_bytes'] / 2**20:.0f} MiB during the run); "
          f"KV {b['total'] / 2**20:.2f} MiB = {bits} bits/element, {b['bytes_per_token']:.0f} bytes/token")
    attn = r["decode_attention_ms_per_token"]
    share = "" if attn is None else (f"; a decode step spends {attn:.2f} ms in attention "
                                     f"({100 * attn / r['decode_ms_per_token']:.0f}% of the step's median)")
    print(f"attention path: {r['attention_path']}{share}")
    if r["cuda_peak_allocated_delta_bytes"] is not None:
        print(f"CUDA peak allocated +{r['cuda_peak_allocated_delta_bytes'] / 2**20:.0f} MiB during the run")
    if budget is not None:
        r["capacity"] = _capacity(model, args.kv, r, budget, args.batch_context)
    if args.json:
        record = {**r, "cache": describe([args.kv])[0], "lifetime_max_rss_bytes": lifetime_max_rss(),
                  "model": meta.model_info(model, args.model or args.random_weights), "wall_seconds": time.perf_counter() - start,
                  "command": meta.command_line(args), "date": meta.now(), "machine": meta.machine_info()}
        _options.write_json(args, record)
    return 0


def _capacity(model, kv: str, measured: dict, budget: int, batch_context: int | None) -> dict:
    from kvsqueeze.eval import capacity as cap

    cost = cap.cache_cost(model, kv)
    transient = cap.transient_per_sequence(measured)
    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    c = cap.capacity(cost, transient, budget, limit, batch_context or cap.BATCH_CONTEXT)
    longest = f"{c['max_context']} tokens" + (f" (the model's limit; the budget holds {c['max_tokens']})"
                                              if c["limited_by_model_positions"] else "")
    print(f"capacity in {budget / 2**30:.2f} GiB: longest context {longest}; {c['max_batch']} sequences of "
          f"{c['batch_context']} tokens ({c['bytes_per_sequence'] / 2**20:.1f} MiB each: cache "
          f"{(c['fixed_bytes'] + c['bytes_per_token'] * c['batch_context']) / 2**20:.1f} + transient "
          f"{c['transient_bytes_per_sequence'] / 2**20:.1f}, the transient from this run's peak "
          f"{'GPU memory allocated' if measured['cuda_peak_allocated_delta_bytes'] is not None else 'RSS'})")
    return c
