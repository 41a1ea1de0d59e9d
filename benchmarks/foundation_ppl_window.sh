#!/usr/bin/env bash
# Perplexity of kvsqueeze presets with the `window` protocol: whole 2048-token chunks scored in one pass, every
# query seeing exactly what the real cache gives it when tokens arrive one at a time from the chunk start
# (quantized history, the full-precision window and sinks). Usage: bash benchmarks/foundation_ppl_window.sh [CHUNKS] [OUTDIR]
set -euo pipefail
CHUNKS=${1:-4}
OUT=${2:-bench/foundation_ppl_window}
mkdir -p "$OUT"
for kv in ${PRESETS:-full int4 kivi-4 kivi-2}; do
  kvsqueeze ppl --kv "$kv" --protocol window --context 2048 --chunks "$CHUNKS" --threads 2 \
    --json "$OUT/$kv.json" | grep "^ppl " | sed "s/^/$kv: /"
done
