"""kvsqueeze bench: the main job - every preset and peer measured side by side, one report."""

from __future__ import annotations

import argparse

from . import _options


def add_arguments(p: argparse.ArgumentParser) -> None:
    _options.add_model_and_threads(p)
    p.add_argument("--quick", action="store_true",
                   help="small sizes and fewer caches: under 10 minutes on 2 cores with the embedded model")
    p.add_argument("--kv", type=_options.csv(str), default=None,
                   help="comma-separated caches to measure instead of the default presets and peers: each a "
                        "preset, a spec string, a calibration artifact directory or a peer (as --kv of kvsqueeze "
                        "ppl), vllm:<kv_cache_dtype> included (vLLM in its own process: all-quantized ppl and "
                        "speed, bytes computed from the dtype; docs/vllm.md)")
    _options.add_corpus(p.add_mutually_exclusive_group(), "perplexity corpus")
    p.add_argument("--out", default="bench", help="reports go to OUT/<timestamp>/ (default bench)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    size = p.add_argument_group("sizes (override the --quick / full defaults)")
    size.add_argument("--ppl-context", type=int, default=None, help="tokens per perplexity chunk")
    size.add_argument("--ppl-chunks", type=int, default=None, help="perplexity chunks")
    size.add_argument("--ppl-decode-tokens", type=int, default=None,
                      help="tokens decoded one at a time at the end of each chunk (decode column)")
    size.add_argument("--lengths", default=None, help="retrieval lengths, e.g. 1k,2k")
    size.add_argument("--depths", default=None, help="retrieval depths, e.g. 0,0.5,1")
    size.add_argument("--trials", type=int, default=None, help="retrieval trials per (length, depth)")
    size.add_argument("--speed-contexts", type=_options.csv(int), default=None, help="two speed contexts, e.g. 1024,8192")
    size.add_argument("--decode-tokens", type=int, default=None, help="decode steps timed per speed context")
    size.add_argument("--retrieval-format", default=None, choices=["plain", "chat"], help="passkey prompt format")
    _options.add_prefill_chunk(p)
    p.add_argument("--budget", default="2GiB", metavar="SIZE",
                   help="memory budget of the capacity table: the longest context and the largest batch of 4096-token "
                        "sequences each cache fits, projected from its measured peak and exact bytes (default 2GiB)")
    p.add_argument("--exact-decode", action="store_true",
                   help="measure the decode column of kvsqueeze presets by real token-by-token decoding (slow) "
                        "instead of the window protocol with the same prefix (equal, and one pass per chunk)")


def run(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvsqueeze.eval.bench import make_plan, run_bench
    from kvsqueeze.eval.capacity import parse_budget
    from kvsqueeze.eval.retrieval import parse_depths, parse_lengths

    plan = make_plan(
        args.quick, args.kv,
        ppl_context=args.ppl_context, ppl_chunks=args.ppl_chunks, ppl_decode_tokens=args.ppl_decode_tokens,
        lengths=parse_lengths(args.lengths) if args.lengths else None,
        depths=parse_depths(args.depths) if args.depths else None,
        trials=args.trials, speed_contexts=args.speed_contexts, speed_decode_tokens=args.decode_tokens,
        retrieval_format=args.retrieval_format, exact_decode=args.exact_decode or None,
        prefill_chunk=args.prefill_chunk, budget_bytes=parse_budget(args.budget),
    )
    folder = run_bench(args, plan, Path(args.out), progress=not args.no_progress)
    table = (folder / "report.md").read_text(encoding="utf-8").split("## Results", 1)[1].split("How to read", 1)[0]
    print(table.strip())
    print(f"wrote {folder}/report.md, results.json and plots")
    return 0
