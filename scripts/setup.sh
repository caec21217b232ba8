#!/usr/bin/env bash
# Sets up .venv with vlrft and everything it needs. Safe to run again (it only installs what is missing).
#   bash scripts/setup.sh          # runtime
#   bash scripts/setup.sh --dev    # plus the test tools
# Torch: an already-installed torch is kept (on a GPU machine, its CUDA build stays). Otherwise a GPU
# machine gets the default (CUDA) build and a machine without one gets $VLRFT_TORCH_SPEC
# (default torch==2.13.0, the CPU wheel this project's machines carry). Set VLRFT_TORCH_SPEC, e.g. to
# "torch --index-url https://download.pytorch.org/whl/cpu", on other CPU-only machines.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
[ "${1:-}" = "--dev" ] && extras="[dev]"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
quiet() { grep -v "is ignored: it is neither" || true; }  # this machine's pip config names a missing index folder
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "${pip[@]}" torch 2>&1 | quiet
  else
    # shellcheck disable=SC2086
    "${pip[@]}" ${VLRFT_TORCH_SPEC:-torch==2.13.0} 2>&1 | quiet
  fi
fi
# DeepSpeed builds from source; its CUDA ops are compiled on first use (or never, on CPU).
DS_BUILD_OPS=0 "${pip[@]}" -e ".${extras}" 2>&1 | quiet
.venv/bin/python -c "import vlrft, torch; print(f'vlrft ready: torch {torch.__version__}, cuda={torch.cuda.is_available()}')"
