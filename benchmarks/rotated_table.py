"""Rotated codebook K/V (fmt "rot", docs/rotated.md) beside KIVI at equal bits: the table of docs/rotated.md.

    KVSQUEEZE_DATA=../shared/data python benchmarks/rotated_table.py --chunks 2 --threads 1 --json bench/rotated.json

Each row is a preset or spec string run through the same code as ``kvsqueeze ppl --kv ROW --context 2048
--chunks 2 --protocol window|all-quantized`` (:func:`kvsqueeze.eval.ppl.run_ppl`), with the model loaded once.
WikiText-2 test, chunks of ``--context`` tokens from the start.  window: the spec's own window and sinks (every
row here: a 128-token full-precision window and 4 sinks), each query seeing what the real cache gives it;
all-quantized: every token quantized, no window, no sinks.  Bits per element: the quantized part, every norm /
scale / zero-point included, measured on the real cache after a prefill of one chunk.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from kvsqueeze import corpus as corpus_mod
from kvsqueeze.eval import meta
from kvsqueeze.eval.ppl import run_ppl

# (group, label, kv): every quantized row has the same 128-token window and 4 sinks
ROWS: list[tuple[str, str, str]] = [
    ("full precision", "fp32", "full"),
    ("KIVI (K per-channel g32, V per-token g32, fp16)", "2-bit", "kivi-2-sink4"),
    ("KIVI (K per-channel g32, V per-token g32, fp16)", "3-bit", "kivi-3-sink4"),
    ("rotated codebook, keys centred (mean per 128 tokens), LS scales", "rot-3 = K2.875c128 / V2.5", "rot-3"),
    ("rotated codebook, keys centred (mean per 128 tokens), LS scales", "rot-3.5 = K3.875c128 / V2.5", "rot-3.5"),
    ("rotated codebook, both sides centred, LS scales", "K2.875c128 / V2.375c128", "k2.875rc128-v2.375rc128-w128-s4"),
    ("rotated codebook, not centred, LS scales", "K3 / V2.5", "k3r-v2.5r-w128-s4"),
    ("rotated codebook, not centred, LS scales", "K4 / V2.5", "k4r-v2.5r-w128-s4"),
    ("rotated + 1-bit residual sign sketch on keys", "K2.75+sketch / V2.5", "k2.75rq-v2.5r-w128-s4"),
]
DEFAULT = ("full", "kivi-2-sink4", "kivi-3-sink4", "rot-3", "rot-3.5")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--chunks", type=int, default=2)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--rows", default="default",
                   help="'default' (full, KIVI at equal bits, the two presets), 'all' (adds the ablations), or "
                        "comma-separated kv names of ROWS (full is always run first)")
    p.add_argument("--no-full", action="store_true", help="skip the full-precision row (its ppl is then not "
                   "measured and the 'vs full' column is left empty)")
    p.add_argument("--protocols", default="window,all-quantized")
    p.add_argument("--json", default=None, help="write every result here")
    args = p.parse_args()
    wanted = {"default": set(DEFAULT), "all": {r[2] for r in ROWS}}.get(args.rows, set(args.rows.split(",")))
    rows = [r for r in ROWS if r[2] in wanted | ({"full"} - ({"full"} if args.no_full else set()))]
    protocols = args.protocols.split(",")
    start = time.perf_counter()
    model, tok, threads = meta.load_for_eval(None, args.threads)
    corpus = corpus_mod.resolve_corpus(None, None)
    chunks = corpus_mod.eval_chunks(corpus_mod.tokenize(corpus, tok), args.context, args.chunks)
    results, footprints = [], {}
    for group, label, kv in rows:
        res = {pr: run_ppl(model, chunks, kv, pr, footprints=footprints) for pr in protocols}
        results.append((group, label, kv, res))
        line = "  ".join(f"{pr} {r['ppl']:.3f}" for pr, r in res.items())
        print(f"# {kv}: {line}", file=sys.stderr, flush=True)
    seconds = time.perf_counter() - start
    full = {pr: results[0][3][pr]["ppl"] for pr in protocols} if rows[0][2] == "full" else {}
    print(f"Embedded SmolLM2-135M-Instruct, WikiText-2 test ({corpus.describe().get('sha256', '')[:12]}), "
          f"{args.chunks} chunks x {args.context} tokens from the start, {threads} threads, {seconds / 60:.0f} min. "
          "window = the row's 128-token full-precision window + 4 sinks; all-quantized = every token quantized, "
          "no window, no sinks. Bits per element: quantized part (codes + every norm/scale/zero), measured on the "
          "real cache.\n")
    head = "| method | setting | kv | bits/elem (quantized part) |"
    for pr in protocols:
        head += f" {pr} ppl | vs full |"
    print(head)
    print("|" + "---|" * (4 + 2 * len(protocols)))
    for group, label, kv, res in results:
        bits = next((r["quantized_bits_per_element"] for r in res.values() if r["quantized_bits_per_element"]),
                    None)
        line = f"| {group} | {label} | `{kv}` | {'32 (fp32)' if bits is None else f'{bits:.3f}'} |"
        for pr in protocols:
            ppl = res[pr]["ppl"]
            rel = "—" if kv == "full" or pr not in full else f"{100 * (ppl / full[pr] - 1):+.2f}%"
            line += f" {ppl:.3f} | {rel} |"
        print(line)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"rows": [{"group": g, "label": lab, "kv": kv, "results": r}
                                                        for g, lab, kv, r in results],
                                               "threads": threads, "seconds": seconds}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
