#!/usr/bin/env bash
# GRPO on Geometry3K with the calculator tool (multi-turn, docs/tools.md), Qwen2.5-VL-7B-Instruct, FSDP2 (bf16) on
# one node of 8 GPUs; the recipe is configs/policy/geo3k_calculator.yaml. Beside the single-turn
# scripts/grpo_qwen2_5_vl_7b_geo3k_fsdp2.sh. Needs the network once (model and dataset from the hub).
# Usage: bash scripts/grpo_qwen2_5_vl_7b_geo3k_calculator.sh [key=value ...]
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-data/geo3k}
NPROC=${NPROC:-8}
mkdir -p "$DATA"
[ -f "$DATA/train.jsonl" ] || .venv/bin/vlrft prepare-data geo3k --source hiyouga/geometry3k --split train --out "$DATA/train.jsonl"
[ -f "$DATA/test.jsonl" ] || .venv/bin/vlrft prepare-data geo3k --source hiyouga/geometry3k --split test --out "$DATA/test.jsonl"
exec .venv/bin/torchrun --nproc_per_node="$NPROC" -m vlrft train-policy configs/policy/geo3k_calculator.yaml \
  model.path=Qwen/Qwen2.5-VL-7B-Instruct model.dtype=bfloat16 \
  data.train_source="$DATA/train.jsonl" data.eval_source="$DATA/test.jsonl" \
  strategy.name=fsdp2 strategy.mixed_precision=bf16 strategy.gradient_checkpointing=true \
  rollout.rollout_batch_size=512 rollout.micro_rollout_batch_size=16 \
  train.train_batch_size=640 train.micro_train_batch_size=4 train.num_episodes=15 train.max_steps=0 \
  train.eval_every=5 train.save_every=5 train.output_dir=runs/qwen2_5_vl_7b_geo3k_calculator \
  optim.lr=1e-6 optim.weight_decay=0.01 logging.wandb=online "$@"
