#!/usr/bin/env bash
# Perplexity of kvsqueeze presets against transformers' caches on the same WikiText-2 text, decode protocol:
# each 2048-token chunk is prefilled exactly for its first PREFIX tokens, then the remaining tokens are fed one
# at a time through the real cache and scored (so they see quantized history + the fp window, as in generation).
# Usage: bash benchmarks/foundation_ppl.sh [CHUNKS] [PREFIX] [OUTDIR]
set -euo pipefail
CHUNKS=${1:-2}
PREFIX=${2:-1792}
OUT=${3:-bench/foundation_ppl}
mkdir -p "$OUT"
for kv in ${PRESETS:-full int4 kivi-4 kivi-2 hf-dynamic hf-quanto-int4 hf-quanto-int2}; do
  # --prefill-chunk 0: the prefix in one exact pass, as the published figures were measured (the default chunks it)
  kvsqueeze ppl --kv "$kv" --protocol decode --context 2048 --chunks "$CHUNKS" --prefix "$PREFIX" \
    --prefill-chunk "${PREFILL_CHUNK:-0}" --threads 2 --json "$OUT/$kv.json" | grep "^ppl " | sed "s/^/$kv: /"
done
python3 - "$OUT" <<'PY'
import json, pathlib, sys
rows = [json.loads(p.read_text()) for p in sorted(pathlib.Path(sys.argv[1]).glob("*.json"))]
base = next((r["ppl"] for r in rows if r.get("kv") == "full"), None)
print("| cache | bits/element (quantized part) | ppl | vs full |")
print("|---|---|---|---|")
for r in sorted(rows, key=lambda r: r.get("kv", "")):
    bpe = f"{r.get('bits_per_element')} ({r.get('quantized_bits_per_element')})"
    d = f"{100 * (r['ppl'] / base - 1):+.2f}%" if base else "-"
    print(f"| {r.get('kv')} | {bpe} | {r['ppl']:.3f} | {d} |")
PY
