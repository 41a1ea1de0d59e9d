#!/usr/bin/env bash
# One call on a lent GPU (device tool, see BENCHMARKS.md section 2 "On a GPU"): the Triton kernels' tests on the
# real device, then the attention table, then end-to-end decode with Llama-3.1-8B-shaped random weights against
# transformers' DynamicCache.  Everything it needs is in the checkout (no downloads); each part has its own time
# limit so one slow part cannot eat the lease, and a short summary is printed last.
#   run from the repository root:  bash benchmarks/gpu_check.sh
#   knobs (environment): PARTS ("tests attention e2e compiled": which parts, in that order; "env" prints kvsqueeze
#                        env first; "fault" also runs the one-warp misaligned-address cases, one process each, at
#                        FAULT_SHAPE, 32:4096:1, beside the tests; "ncu" profiles the decode's partials kernel for
#                        NCU_PRESETS at NCU_CONFIG with Nsight Compute, after the attention), CONTEXTS ("4096 32768"),
#                        CODES16 (default / on / off / both: attention_micro --gpu-codes16),
#                        PRESETS ("kivi-4 kivi-2 int8 fp8-e4m3"), CONFIGS (decode launch shapes BT:PROGRAMS:WARPS to
#                        sweep; empty: the module's own), E2E_CONTEXT (32768), E2E_BATCH (8), E2E_CHUNK (prefill
#                        chunk, 0 = one pass), E2E_BUDGET (60GiB: capacity projected at E2E_CONTEXT),
#                        E2E_LAYERS (all), E2E_CACHES ("hf-dynamic kivi-4 kivi-2"),
#                        COMPILED_CONTEXT (8192), COMPILED_LAYERS (all), COMPILED_KVS (the batch-1 runs, comma-separated:
#                        "hf-static --compile,kivi-4 --compile,kivi-4"), COMPILED_TIMEOUT (240 s each),
#                        SHAPE (llama-3.1-8b), XDIST (8 test workers), TESTS_TIMEOUT (240 s)
#   the device's per-call limit is 600 s: a call that ran out can go on with e.g. PARTS="e2e compiled"
set -u
cd "$(dirname "$0")/.."
export PYTHONPATH=src HF_HUB_OFFLINE=1
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
CONTEXTS=${CONTEXTS:-"4096 32768"}
PRESETS=${PRESETS:-"kivi-4 kivi-2 int8 fp8-e4m3"}
CONFIGS=${CONFIGS:-}
E2E_CONTEXT=${E2E_CONTEXT:-32768}
E2E_BATCH=${E2E_BATCH:-8}
E2E_CHUNK=${E2E_CHUNK:-0}
E2E_BUDGET=${E2E_BUDGET:-60GiB}  # GPU memory for caches and activations: the largest batch of E2E_CONTEXT tokens
E2E_CACHES=${E2E_CACHES:-"hf-dynamic kivi-4 kivi-2"}
COMPILED_CONTEXT=${COMPILED_CONTEXT:-8192}
COMPILED_KVS=${COMPILED_KVS:-"hf-static --compile,kivi-4 --compile,kivi-4"}
SHAPE=${SHAPE:-llama-3.1-8b}
LAYERS=${E2E_LAYERS:+--layers $E2E_LAYERS}
CLAYERS=${COMPILED_LAYERS:+--layers $COMPILED_LAYERS}
XDIST=${XDIST:-8}
FAULT_SHAPE=${FAULT_SHAPE:-32:4096:1}
PARTS=${PARTS:-"tests attention e2e compiled"}
CODES16=${CODES16:-default}  # attention_micro --gpu-codes16: both = a row with and one without 2-/4-bit codes16
NCU_PRESETS=${NCU_PRESETS:-"kivi-4 fp8-e4m3"}
NCU_CONFIG=${NCU_CONFIG:-32:4096:1}
part() { [[ " $PARTS " == *" $1 "* ]]; }

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, '| triton', triton.__version__,
'| transformers', transformers.__version__, '|', torch.cuda.get_device_name())"

if part env; then
echo "== kvsqueeze env"
timeout 60 python3 -m kvsqueeze env 2>&1 | tee "$OUT/env.txt"
fi

FAULT_CASES=("triton-pool-int4 broadcast mask batch" "triton-pool-int2 gqa padding"
             "triton-pool-int4 gqa padding" "triton-pool-kivi-4 gqa padding")
if part fault; then
# the cases run in the background, beside the tests below (their results are printed after them); the first under
# compute-sanitizer's memcheck, which names the faulting instruction and address
i=0
for case in "${FAULT_CASES[@]}"; do
  tool=(); [ $i = 0 ] && command -v compute-sanitizer >/dev/null && tool=(compute-sanitizer --tool memcheck --print-limit 5)
  CUDA_LAUNCH_BLOCKING=1 KVSQUEEZE_TRITON_DECODE=$FAULT_SHAPE timeout 150 "${tool[@]}" python3 -m pytest -q \
    -p no:cacheprovider "tests/kernels/test_conformance.py::test_kernel_matches_reference[$case]" --tb=long \
    > "$OUT/fault$i.txt" 2>&1 &
  i=$((i + 1))
done
fi

if part tests; then
echo "== Triton kernel tests on the device"
# workers compile the kernels in parallel (pytest-xdist, where installed)
python3 -c "import xdist" 2>/dev/null && WORKERS="-n $XDIST" || WORKERS=
# SIGINT at the limit: pytest still prints the failures it has (a plain kill lost their names once)
# shellcheck disable=SC2086
timeout -s INT -k 15 "${TESTS_TIMEOUT:-240}" python3 -m pytest -q -p no:cacheprovider $WORKERS \
  tests/kernels/test_triton_pool.py tests/kernels/test_triton_formats.py tests/kernels/test_triton_kernels.py tests/kernels/test_triton_prefill.py \
  tests/kernels/test_triton_pack.py tests/kernels/test_triton_static.py "tests/kernels/test_conformance.py" \
  -k "not cpu-" --tb=short -rf > "$OUT/tests_full.txt" 2>&1
grep -E "^FAILED|^ERROR" "$OUT/tests_full.txt" | cut -c1-300 | head -n 60
tail -n 3 "$OUT/tests_full.txt" | tee "$OUT/tests.txt"
fi

if part fault; then
wait
echo "== the one-warp launch's misaligned address (2026-11-27): the conformance suite's Triton cases one process"
echo "   each at KVSQUEEZE_TRITON_DECODE=$FAULT_SHAPE, kernels synchronous (the first under compute-sanitizer)"
i=0
for case in "${FAULT_CASES[@]}"; do
  echo "$case: $(tail -n 1 "$OUT/fault$i.txt")"
  grep -E "Error|error:|kernels/triton_|_kernel|Invalid|Address|at 0x|by thread|=========" "$OUT/fault$i.txt" \
    | head -n 14 | cut -c1-240
  i=$((i + 1))
done
fi

if part attention; then
echo "== attention, one layer per step"
# shellcheck disable=SC2086
timeout 240 python3 benchmarks/attention_micro.py --skip-cpu --gpu-contexts $CONTEXTS --reps 20 --gpu-kv-heads 8 \
  --gpu-batch 1 16 --gpu-presets $PRESETS --gpu-graphs ${CONFIGS:+--gpu-configs $CONFIGS} --gpu-codes16 "$CODES16" \
  --prefill-tokens 8192 --prefill-contexts 24576 --prefill-routes tiled dense --no-prefill-reference 2>&1 \
  | tee "$OUT/attention.md"
fi

if part ncu; then
echo "== Nsight Compute: the decode's partials kernel for $NCU_PRESETS, 32k x 16, launch shape $NCU_CONFIG"
# one process: each preset's first launch (its correctness check) is profiled
# shellcheck disable=SC2086
timeout 150 ncu --clock-control none --kernel-name regex:_partials_kernel --launch-count $(wc -w <<< "$NCU_PRESETS") \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  --section SchedulerStats --section MemoryWorkloadAnalysis \
  python3 benchmarks/attention_micro.py --skip-cpu --gpu-contexts 32768 --gpu-batch 16 --gpu-kv-heads 8 \
  --gpu-presets $NCU_PRESETS --gpu-configs "$NCU_CONFIG" --reps 1 --prefill-tokens 0 > "$OUT/ncu.txt" 2>&1
grep -E "_partials_kernel|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Occupancy|Registers Per|Shared Memory Config|Block Limit|Warp Cycles Per Issued|Issue Slots Busy|No Eligible|Active Warps Per|Eligible Warps|Waves Per SM|==ERR|==WARN" \
  "$OUT/ncu.txt" | head -n 70 | cut -c1-200
fi

if part e2e; then
echo "== end to end: $SHAPE, random weights, context $E2E_CONTEXT x batch $E2E_BATCH"
for kv in $E2E_CACHES; do
  # shellcheck disable=SC2086
  timeout 150 python3 -m kvsqueeze speed --device cuda --random-weights "$SHAPE" $LAYERS --kv "$kv" \
    --context "$E2E_CONTEXT" --batch "$E2E_BATCH" --prefill-chunk "$E2E_CHUNK" --decode-tokens 16 \
    --budget "$E2E_BUDGET" --batch-context "$E2E_CONTEXT" \
    --json "$OUT/speed_$kv.json" 2>&1 \
    | tee "$OUT/speed_$kv.txt" | grep -E "decode|attention path|CUDA peak|capacity|error"
done
fi

if part compiled; then
echo "== batch 1, context $COMPILED_CONTEXT: compiled bf16 StaticCache (CUDA graphs) against kivi-4 compiled as"
echo "   StaticQuantizedCache (CUDA graphs over static_attend_graphed) and kivi-4 eager"
IFS=, read -r -a runs <<< "$COMPILED_KVS"
for kv in "${runs[@]}"; do
  name=${kv// /}
  # shellcheck disable=SC2086
  timeout "${COMPILED_TIMEOUT:-240}" python3 -m kvsqueeze speed --device cuda --random-weights "$SHAPE" $CLAYERS --kv $kv \
    --context "$COMPILED_CONTEXT" --batch 1 --decode-tokens 32 --json "$OUT/speed_b1_$name.json" 2>&1 \
    | tee "$OUT/speed_b1_$name.txt" | grep -E "decode|attention path|error"
done
fi

echo "== summary"
tail -n 3 "$OUT/tests.txt" 2>/dev/null
grep -E "^\| 32/8 \| 16 \| 32768 " "$OUT/attention.md" 2>/dev/null | head -n 60
for kv in $E2E_CACHES; do
  echo "$kv: $(grep -o 'decode [0-9.]* ms/token' "$OUT/speed_$kv.txt" 2>/dev/null)"
done
for name in hf-static--compile kivi-4--compile kivi-4; do
  echo "batch 1 $name: $(grep -o 'decode [0-9.]* ms/token' "$OUT/speed_b1_$name.txt" 2>/dev/null)"
done
