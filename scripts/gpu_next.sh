#!/usr/bin/env bash
# The next GPU call of issue 27 as one command (docs/benchmarks.md, "What would make the remaining GPU figures"): a
# drawn session has 15 minutes of device time, its machine's start included, so this is sized for one call of about
# 9 minutes (the third run's call, 540 s, was cut in its fifth configuration: see that run's section). In order of
# what each answers, each step logged with its time and exit status, every figure written under OUT as it comes:
#   1. the CUDA-only tests of the fast path's device code (the patch product, the compiled decode: one graph, no
#      break since d919766);
#   2. the decode with the grouped decode attention, traced whole again (gpu_sweep.py keep, 2 steps: step 1
#      compiles, step 2 is the figure; the third run's 38.5 ms a step was the broken graph);
#   3. the update with compiled blocks, checkpointed (what an 80 GB H100 needs at 3B; the third run's CheckpointError,
#      fixed by d919766), 2 steps;
#   4. 7B with its AdamW state resident, PyTorch's allocator capped at 79.2 GiB: whether 3 steps run as they would on
#      an 80 GB H100, fragmentation included (gpu_sweep.py 7b --memory-cap-gib 79.2; not on the tiny smoke);
#   5. keep's third step profiled (its own JSON folder), as time allows.
# A step that fails does not stop the next; gpu_sweep.py skips configurations whose JSON is complete, so running the
# same command again continues a cut call. The device tool returns at most 8 files: the steps' output goes to one
# log (steps.log), the JSON to json*/ (the runs' own folders below them do not come back).
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

step() {  # step NAME COMMAND...: run it, its output appended to OUT/steps.log, its time and status to the log
  local name=$1 start rc
  shift
  start=$(date +%s)
  echo "[$(date -u +%T)] $name: $*" | tee -a "$log"
  echo "===== [$(date -u +%T)] $name: $*" >> "$out/steps.log"
  "$@" >> "$out/steps.log" 2>&1  # straight into the log: a step cut by the call's limit keeps what it printed
  rc=$?
  echo "[$(date -u +%T)] $name: exit $rc after $(($(date +%s) - start)) s" | tee -a "$log"
  tail -n 3 "$out/steps.log" | sed 's/^/    /' | tee -a "$log"
}

{ nvidia-smi || true; "$py" -c "import torch, transformers; print(torch.__version__, transformers.__version__)"; \
  git log --oneline -1 || true; } >> "$log" 2>&1
step cuda_tests "$py" -m pytest -q -rs -p no:cacheprovider tests/test_patch_embedding.py \
  tests/test_rollout_compiled_decode.py -m "not distributed"
step keep "$py" scripts/gpu_sweep.py --shape "$shape" --model-dir "$model" --json-dir "$out/json" \
  --only keep --steps 2 "${extra[@]}"
step ckpt_blocks "$py" scripts/gpu_sweep.py --shape "$shape" --model-dir "$model" --json-dir "$out/json" \
  --only ckpt-blocks --steps 2 "${extra[@]}"
if [ "$shape" = 3b ]; then
  step 7b_80gb "$py" scripts/gpu_sweep.py --shape "$shape" --model-dir "$model" --json-dir "$out/json-80gb" \
    --only 7b --steps 3 --memory-cap-gib 79.2 "${extra[@]}"
fi
step keep_profile "$py" scripts/gpu_sweep.py --shape "$shape" --model-dir "$model" --json-dir "$out/json-profile" \
  --only keep --steps 3 --profile-step 3 "${extra[@]}"
echo "[$(date -u +%T)] done: $(cd "$out" && ls json*/*.json 2>/dev/null | tr '\n' ' ')" | tee -a "$log"
