"""BENCHMARKS.md section 1: perplexity of kvsqueeze presets and transformers' caches on the same text.

One ``kvsqueeze ppl`` run per cache (a fresh process each, as the shell loops it replaces did), then a table from
their JSON files.

``--protocol decode`` (the default): each 2048-token chunk is prefilled exactly for its first ``--prefix`` tokens,
then the remaining tokens are fed one at a time through the real cache and scored (so they see quantized history
+ the fp window, as in generation).  ``--protocol window``: whole chunks scored in one pass, every query seeing
exactly what the real cache gives it when tokens arrive one at a time from the chunk start.

    KVSQUEEZE_DATA=../shared/data python benchmarks/foundation_ppl.py --chunks 2 --prefix 1792 \
        --out bench/foundation_ppl
    KVSQUEEZE_DATA=../shared/data python benchmarks/foundation_ppl.py --protocol window --chunks 2 \
        --out bench/foundation_ppl_window
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

PRESETS = {"decode": ["full", "int4", "kivi-4", "kivi-2", "hf-dynamic", "hf-quanto-int4", "hf-quanto-int2"],
           "window": ["full", "int4", "kivi-4", "kivi-2"]}


def ppl_command(kv: str, args: argparse.Namespace, out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "kvsqueeze.cli", "ppl", "--kv", kv, "--protocol", args.protocol, "--context",
           "2048", "--chunks", str(args.chunks)]
    if args.protocol == "decode":
        # --prefill-chunk 0: the prefix in one exact pass, as the published figures were measured
        cmd += ["--prefix", str(args.prefix), "--prefill-chunk", str(args.prefill_chunk)]
    return cmd + ["--threads", str(args.threads), "--json", str(out / f"{kv}.json")]


def table(out: Path) -> list[str]:
    rows = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    base = next((r["ppl"] for r in rows if r.get("kv") == "full"), None)
    lines = ["| cache | bits/element (quantized part) | ppl | vs full |", "|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: r.get("kv", "")):
        bpe = f"{r.get('bits_per_element')} ({r.get('quantized_bits_per_element')})"
        d = f"{100 * (r['ppl'] / base - 1):+.2f}%" if base else "-"
        lines.append(f"| {r.get('kv')} | {bpe} | {r['ppl']:.3f} | {d} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--protocol", choices=sorted(PRESETS), default="decode")
    p.add_argument("--chunks", type=int, default=None, help="2048-token chunks (default: 2 decode, 4 window)")
    p.add_argument("--prefix", type=int, default=1792, help="decode: exact prefix of each chunk")
    p.add_argument("--prefill-chunk", type=int, default=0, help="decode: 0 = the prefix in one exact pass")
    p.add_argument("--presets", nargs="+", default=None, help="caches (default: the section's list)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None, help="folder for one JSON per cache (default: bench/foundation_ppl[_window])")
    args = p.parse_args(argv)
    if args.chunks is None:
        args.chunks = 2 if args.protocol == "decode" else 4
    out = Path(args.out or ("bench/foundation_ppl" if args.protocol == "decode" else "bench/foundation_ppl_window"))
    out.mkdir(parents=True, exist_ok=True)
    for kv in args.presets or PRESETS[args.protocol]:
        run = subprocess.run(ppl_command(kv, args, out), stdout=subprocess.PIPE, text=True)
        for line in run.stdout.splitlines():
            if line.startswith("ppl "):
                print(f"{kv}: {line}", flush=True)
        if run.returncode:
            print(f"{kv}: kvsqueeze ppl exited with {run.returncode}", file=sys.stderr)
            return run.returncode
    if args.protocol == "decode":
        print("\n".join(table(out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
