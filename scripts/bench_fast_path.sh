#!/usr/bin/env bash
# The CPU before/after table of issue 27 (the GPU fast path): scripts/bench_grpo_step.py's efficiency lines at the
# 21 M row (2 prompts x 16 samples x 48 tokens, 144 image tokens, one torch thread) for main before issue 27 and for
# each item's commit with that item switched on. Each row runs the CURRENT bench script on the code of its commit (a detached
# worktree on PYTHONPATH, this checkout's .venv), so every row counts FLOPs the same way. Run it on a quiet machine:
#
#   bash scripts/bench_fast_path.sh [OUT_DIR]        # default OUT_DIR: runs/bench_fast_path
#
# OUT_DIR/<row>.txt holds each bench's output; the table (rows x update / rollout ratios) is printed at the end.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$here/runs/bench_fast_path}"
mkdir -p "$out"
py="$here/.venv/bin/python"
bench=(--sides vlrft --threads 1 --block 3 --rounds 3 --hidden 512 --layers 6 --heads 4 --vision-depth 6
  --vision-hidden 256 --image-tokens 144 --prompts 2 --generations 16 --max-new-tokens 48)
commit() { git -C "$here" log --format=%h -1 --grep="$1"; }
# label | commit | train-policy overrides switching the item on ("before": main just before issue 27's first change)
rows=(
  "before|ed3cc66|"
  "item3-token-budget|$(commit 'issue 27 item 3')|train.micro_batch_tokens=4096"
  "item1-inference-copy|$(commit 'issue 27 items 1 and 2')|rollout.hf.inference_copy=on"
  "item2-static-cache|$(commit 'issue 27 items 1 and 2')|rollout.hf.inference_copy=on rollout.hf.compile=on"
  "item4-bf16-autocast|$(commit 'issue 27 item 4')|strategy.mixed_precision=bf16"
  "item5-packed-attention|$(commit 'issue 27 item 5: packed')|"
  "tip-defaults|$(git -C "$here" rev-parse --short HEAD)|"
)
for row in "${rows[@]}"; do
  IFS='|' read -r label rev overrides <<<"$row"
  tree="$(mktemp -d)/tree"
  git -C "$here" worktree add --detach -q "$tree" "$rev"
  # shellcheck disable=SC2086
  PYTHONPATH="$tree" "$py" "$here/scripts/bench_grpo_step.py" "${bench[@]}" $overrides >"$out/$label.txt" 2>&1 || true
  git -C "$here" worktree remove --force "$tree"
  echo "$label ($rev${overrides:+, $overrides}): $(grep -E '^(fp32 GEMM|update|rollout)' "$out/$label.txt" | tr '\n' ' ')"
done
