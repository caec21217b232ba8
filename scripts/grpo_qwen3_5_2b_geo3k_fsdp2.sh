#!/usr/bin/env bash
# GRPO on Geometry3K with Qwen3.5-2B (dense: Gated DeltaNet + full attention layers), FSDP2 (bf16) on one node of
# 8 GPUs. The hybrid layers take the plain (not group-shared) training forward: docs/tiny-models.md#qwen35-and-mixture-of-experts.
# Needs the network once (model and dataset from the hub). Usage: bash scripts/grpo_qwen3_5_2b_geo3k_fsdp2.sh [key=value ...]
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-data/geo3k}
NPROC=${NPROC:-8}
mkdir -p "$DATA"
[ -f "$DATA/train.jsonl" ] || .venv/bin/vlrft prepare-data geo3k --source hiyouga/geometry3k --split train --out "$DATA/train.jsonl"
[ -f "$DATA/test.jsonl" ] || .venv/bin/vlrft prepare-data geo3k --source hiyouga/geometry3k --split test --out "$DATA/test.jsonl"
exec .venv/bin/torchrun --nproc_per_node="$NPROC" -m vlrft train-policy configs/policy/grpo.yaml \
  model.path=Qwen/Qwen3.5-2B model.dtype=bfloat16 \
  data.train_source="$DATA/train.jsonl" data.eval_source="$DATA/test.jsonl" data.prompt_template=math_boxed \
  data.max_prompt_length=2048 \
  "reward.sources=[{name: accuracy, kind: verifier, verifier: math_boxed, weight: 1.0}, {name: format, kind: verifier, verifier: format, weight: 0.1}]" \
  strategy.name=fsdp2 strategy.mixed_precision=bf16 strategy.gradient_checkpointing=true \
  rollout.rollout_batch_size=512 rollout.n_samples_per_prompt=5 rollout.max_new_tokens=2048 \
  rollout.micro_rollout_batch_size=16 rollout.temperature=1.0 \
  train.train_batch_size=640 train.micro_train_batch_size=4 train.num_episodes=15 train.max_steps=0 \
  train.eval_every=5 train.save_every=5 train.output_dir=runs/qwen3_5_2b_geo3k_grpo \
  optim.lr=1e-6 optim.weight_decay=0.01 algorithm.kl_coef=0.01 logging.wandb=online "$@"
