#!/usr/bin/env bash
# GRPO on Geometry3K with Qwen2.5-VL-7B-Instruct, FSDP2 (bf16) on one node of 8 GPUs, rollouts by vLLM:
# one colocated vLLM engine per GPU (the trainer's own processes), asleep while the policy trains, woken
# and sent the new weights after each optimizer step; token-level truncated IS corrects the mismatch.
# Needs .venv-vllm (bash scripts/setup.sh --vllm) and the network once (model and dataset from the hub).
# Usage: bash scripts/grpo_qwen2_5_vl_7b_geo3k_fsdp2_vllm.sh [key=value ...]
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-data/geo3k}
NPROC=${NPROC:-8}
mkdir -p "$DATA"
[ -f "$DATA/train.jsonl" ] || .venv-vllm/bin/vlrft prepare-data geo3k --source hiyouga/geometry3k --split train --out "$DATA/train.jsonl"
[ -f "$DATA/test.jsonl" ] || .venv-vllm/bin/vlrft prepare-data geo3k --source hiyouga/geometry3k --split test --out "$DATA/test.jsonl"
exec .venv-vllm/bin/torchrun --nproc_per_node="$NPROC" -m vlrft train-policy configs/policy/grpo.yaml \
  model.path=Qwen/Qwen2.5-VL-7B-Instruct model.dtype=bfloat16 \
  data.train_source="$DATA/train.jsonl" data.eval_source="$DATA/test.jsonl" data.prompt_template=math_boxed \
  data.max_prompt_length=2048 \
  "reward.sources=[{name: accuracy, kind: verifier, verifier: math_boxed, weight: 1.0}, {name: format, kind: verifier, verifier: format, weight: 0.1}]" \
  strategy.name=fsdp2 strategy.mixed_precision=bf16 strategy.gradient_checkpointing=true \
  rollout.engine=vllm rollout.vllm.gpu_memory_utilization=0.35 rollout.vllm.max_model_len=4096 \
  rollout.vllm.sleep_level=1 rollout.vllm.dtype=bfloat16 \
  rollout.rollout_batch_size=512 rollout.n_samples_per_prompt=5 rollout.max_new_tokens=2048 \
  rollout.micro_rollout_batch_size=64 rollout.temperature=1.0 \
  algorithm.rollout_correction=token_tis algorithm.rollout_is_cap=2.0 \
  train.train_batch_size=640 train.micro_train_batch_size=4 train.num_episodes=15 train.max_steps=0 \
  train.eval_every=5 train.save_every=5 train.output_dir=runs/qwen2_5_vl_7b_geo3k_grpo_vllm \
  optim.lr=1e-6 optim.weight_decay=0.01 algorithm.kl_coef=0.01 logging.wandb=online "$@"
