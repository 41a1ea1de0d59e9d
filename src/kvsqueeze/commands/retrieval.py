"""kvsqueeze retrieval: passkey (needle-in-a-haystack) accuracy per context length and depth."""

from __future__ import annotations

import argparse

from . import _options


def add_arguments(p: argparse.ArgumentParser) -> None:
    _options.add_kv(p)
    _options.add_model_and_threads(p)
    p.add_argument("--lengths", default="1k,2k,4k,8k", help="prompt lengths in tokens (default 1k,2k,4k,8k)")
    p.add_argument("--depths", default="0,0.25,0.5,0.75,1.0",
                   help="where the pass key sits, as a fraction of the haystack (default 0,0.25,0.5,0.75,1.0)")
    p.add_argument("--trials", type=int, default=1, help="pass keys per (length, depth) (default 1)")
    p.add_argument("--format", default="plain", choices=["plain", "chat"],
                   help="plain text prompt, or the tokenizer's chat template (default plain)")
    p.add_argument("--haystack-text", default=None,
                   help="build the haystack from this text file's sentences instead of the generated filler")
    _options.add_prefill_chunk(p)
    _options.add_json(p)
    p.add_argument("--png", default=None, help="heat-map image (default: next to a --json file, same name, .png)")


def run(args: argparse.Namespace) -> int:
    import time
    from pathlib import Path

    from kvsqueeze.corpus import load_text_file
    from kvsqueeze.eval import meta, report
    from kvsqueeze.eval.peers import describe
    from kvsqueeze.eval.retrieval import generated_haystack, parse_depths, parse_lengths, run_retrieval

    start = time.perf_counter()
    _options.resolve_kv_option(args.kv)
    lengths, depths = parse_lengths(args.lengths), parse_depths(args.depths)
    if args.trials < 1:
        raise ValueError(f"--trials must be at least 1, got {args.trials}")
    haystack = load_text_file(args.haystack_text) if args.haystack_text else None
    model, tokenizer, threads = meta.load_for_eval(args.model, args.threads)
    meta.check_context(model, max(lengths), "retrieval length")
    _options.check_prefill_chunk(args, model)
    print(f"kvsqueeze retrieval: {args.kv}, lengths {', '.join(map(str, lengths))}, depths "
          f"{', '.join(f'{d:g}' for d in depths)}, {args.trials} trial(s), prefill chunk {args.prefill_chunk or 'one pass'}, {threads} threads")
    res = run_retrieval(model, tokenizer, args.kv, lengths, depths, args.trials, args.format,
                        None if haystack is None else haystack.text, prefill_chunk=args.prefill_chunk)
    print("depth \\ length " + " ".join(f"{n:>7}" for n in lengths))
    for d, row in zip(depths, res["accuracy"]):
        print(f"{d:>14g} " + " ".join(f"{100 * a:>6.0f}%" for a in row))
    print(f"mean accuracy {100 * res['mean_accuracy']:.1f}% over {len(res['cells'])} prompts")
    to_file = args.json and not _options.json_to_stdout(args)
    png = args.png or (str(Path(args.json).with_suffix(".png")) if to_file else None)
    if png:
        report.plot_retrieval({args.kv: res}, Path(png))
        print(f"wrote {png}")
    if args.json:
        record = {**res, "cache": describe([args.kv])[0], "heatmap_png": png,
                  "haystack_source": generated_haystack() if haystack is None else haystack.describe(),
                  "model": meta.model_info(model, args.model), "threads": threads,
                  "wall_seconds": time.perf_counter() - start, "command": meta.command_line(args),
                  "date": meta.now(), "machine": meta.machine_info()}
        _options.write_json(args, record)
    return 0
