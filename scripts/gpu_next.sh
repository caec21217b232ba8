#!/usr/bin/env bash
# The next GPU call of issue 27 as one command (docs/benchmarks.md, "What would make the remaining GPU figures"): a
# drawn session has 15 minutes of device time, its machine's start included, so this is sized for one call of about
# 9 minutes. In order, each step logged with its time and exit status, every figure written under OUT as it comes:
#   1. the CUDA-only tests of the fast path's device code (the patch product, the compiled decode), skipped elsewhere;
#   2. the update's MFU with compiled blocks, checkpointed (what an 80 GB H100 needs at 3B) and not (gpu_sweep.py
#      ckpt-blocks, blocks; step 1 compiles, step 2 is the figure);
#   3. the decode with the grouped decode attention, its last step profiled (gpu_sweep.py keep);
#   4. 7B with its AdamW state resident, PyTorch's allocator capped at 79.2 GiB: whether 3 steps run as they would on
#      an 80 GB H100, fragmentation included (gpu_sweep.py 7b --memory-cap-gib 79.2; not on the tiny smoke).
# A step that fails does not stop the next; gpu_sweep.py skips configurations whose JSON is complete, so running the
# same command again continues a cut call.
#
#   bash scripts/gpu_next.sh [OUT]        # OUT: $OUT where the device tool sets it, else runs/gpu_next
#   GPU_NEXT_SHAPE=tiny GPU_NEXT_ARGS="--max-new-tokens 8 --image-tokens 16" bash scripts/gpu_next.sh /tmp/g  # CPU smoke
#
# On the device image (torch 2.11 + CUDA, transformers 5.17, no network) vlrft's one missing import is omegaconf:
# carry a folder holding omegaconf and antlr4 (pure Python, 3.7 MB) and name it in VLRFT_EXTRA_PATH:
#   mkdir -p .gpu-extra && cp -r .venv/lib/python3.*/site-packages/{omegaconf,antlr4} .gpu-extra/   # here, once
#   device tool: run(carry=[".gpu-extra"], command="VLRFT_EXTRA_PATH=$PWD/.gpu-extra bash scripts/gpu_next.sh")
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-runs/gpu_next}}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export PYTHONPATH="${VLRFT_EXTRA_PATH:+$VLRFT_EXTRA_PATH:}$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=offline
py=${PYTHON:-python}
shape=${GPU_NEXT_SHAPE:-3b}
model=${GPU_NEXT_MODEL:-/tmp/vlrft-gpu-next-$shape}
read -r -a extra <<< "${GPU_NEXT_ARGS:-}"
log="$out/gpu_next.log"

step() {  # step NAME COMMAND...: run it, its output to OUT/NAME.txt, its time and status to the log
  local name=$1 start rc
  shift
  start=$(date +%s)
  echo "[$(date -u +%T)] $name: $*" | tee -a "$log"
  "$@" > "$out/$name.txt" 2>&1
  rc=$?
  echo "[$(date -u +%T)] $name: exit $rc after $(($(date +%s) - start)) s" | tee -a "$log"
  tail -n 3 "$out/$name.txt" | sed 's/^/    /' | tee -a "$log"
}

{ nvidia-smi || true; "$py" -c "import torch, transformers; print(torch.__version__, transformers.__version__)"; \
  git log --oneline -1 || true; } > "$out/machine.txt" 2>&1
step cuda_tests "$py" -m pytest -q -rs -p no:cacheprovider tests/test_patch_embedding.py \
  tests/test_rollout_compiled_decode.py -m "not distributed"
step blocks "$py" scripts/gpu_sweep.py --shape "$shape" --model-dir "$model" --json-dir "$out/json" \
  --only ckpt-blocks,blocks --steps 2 "${extra[@]}"
step keep "$py" scripts/gpu_sweep.py --shape "$shape" --model-dir "$model" --json-dir "$out/json" \
  --only keep --steps 3 --profile-step 3 "${extra[@]}"
if [ "$shape" = 3b ]; then
  step 7b_80gb "$py" scripts/gpu_sweep.py --shape "$shape" --model-dir "$model" --json-dir "$out/json-80gb" \
    --only 7b --steps 3 --memory-cap-gib 79.2 "${extra[@]}"
fi
echo "[$(date -u +%T)] done: $(cd "$out" && ls json/*.json json-80gb/*.json 2>/dev/null | tr '\n' ' ')" | tee -a "$log"
