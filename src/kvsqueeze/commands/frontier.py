"""kvsqueeze frontier: per bit budget, the best kvsqueeze cache against the peers that fit the same budget."""

from __future__ import annotations

import argparse

from . import _options


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvsqueeze.eval.bench import FULL_PRESETS
    from kvsqueeze.eval.frontier import BUDGETS, PEERS

    _options.add_model_and_threads(p)
    p.add_argument("--kv", type=_options.csv(str), default=None,
                   help="comma-separated kvsqueeze caches to choose from: presets, spec strings, calibration "
                        "artifact directories (e.g. those of calibrate --method auto --bits B) "
                        f"(default: {','.join(c for c in FULL_PRESETS if c != 'full')})")
    p.add_argument("--peers", type=_options.csv(str), default=None,
                   help=f"comma-separated peers; those that cannot run here (a missing library, vLLM not installed) "
                        f"are skipped with a note (default: {','.join(PEERS)})")
    p.add_argument("--budgets", type=_options.csv(float), default=list(BUDGETS),
                   help=f"bits per element of the quantized part (default {','.join(map(str, BUDGETS))})")
    _options.add_corpus(p.add_mutually_exclusive_group(), "perplexity corpus")
    p.add_argument("--context", type=_options.positive_int, default=2048, help="tokens per chunk (default 2048)")
    p.add_argument("--chunks", type=_options.positive_int, default=2, help="chunks from the corpus start (default 2)")
    p.add_argument("--decode-tokens", type=_options.positive_int, default=128,
                   help="tokens decoded one at a time at the end of each chunk (decode column, where the peers "
                        "are measured; default 128)")
    p.add_argument("--out", default="frontier", help="writes OUT/frontier.md, frontier.json, frontier.png")
    p.add_argument("--add-to", action="store_true",
                   help="OUT already holds a frontier.json of the same model, chunks and decode tokens: keep its "
                        "measurements and measure only the caches it lacks (e.g. a new calibration artifact)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def run(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from kvsqueeze import corpus as corpus_mod
    from kvsqueeze.eval import meta
    from kvsqueeze.eval.bench import FULL_PRESETS
    from kvsqueeze.eval.frontier import PEERS, run_frontier

    start = time.perf_counter()
    caches = args.kv if args.kv is not None else [c for c in FULL_PRESETS if c != "full"]
    for name in caches:  # a typo fails here, before the model loads
        _options.resolve_kv_option(name)
    if not 1 <= args.decode_tokens <= args.context - 2:
        raise ValueError(f"--decode-tokens must be in [1, {args.context - 2}], got {args.decode_tokens}")
    corpus = corpus_mod.resolve_corpus(args.text, args.dataset)
    model, tokenizer, threads = meta.load_for_eval(args.model, args.threads)
    meta.check_context(model, args.context, "--context")
    ids = corpus_mod.tokenize(corpus, tokenizer)
    chunks = corpus_mod.eval_chunks(ids, args.context, args.chunks)
    print(f"kvsqueeze frontier: {len(caches)} caches, budgets {', '.join(f'{b:g}' for b in args.budgets)}, "
          f"{args.chunks} x {args.context} tokens of {corpus_mod.summary(corpus)}, {threads} threads")
    info = {"command": meta.command_line(args), "model": meta.model_info(model, args.model),
            "corpus": {**corpus.describe(), "tokens": int(ids.numel())}}
    out = Path(args.out)
    previous = None
    if args.add_to:
        import json

        previous = json.loads((out / "frontier.json").read_text(encoding="utf-8"))
    res = run_frontier(model, chunks, [*caches, *(args.peers if args.peers is not None else PEERS)],
                       tuple(args.budgets), args.decode_tokens, out, progress=not args.no_progress,
                       model_source=args.model, threads=threads, info=info, previous=previous)
    for note in res["skipped"]:
        print(f"  skipped {note}")
    print((out / "frontier.md").read_text(encoding="utf-8"))
    print(f"wrote {out}/frontier.md, frontier.json, frontier.png ({time.perf_counter() - start:.0f} s)")
    return 0
