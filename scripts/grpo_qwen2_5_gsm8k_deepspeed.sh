#!/usr/bin/env bash
# GRPO on GSM8K with the text-only Qwen2.5-1.5B-Instruct, DeepSpeed ZeRO-2 (bf16) on 4 GPUs.
# Needs the network once for the model; the data may be a local copy of the OpenAI jsonl files.
# Usage: GSM8K=path/to/gsm8k_or_hub_id bash scripts/grpo_qwen2_5_gsm8k_deepspeed.sh [key=value ...]
set -euo pipefail
cd "$(dirname "$0")/.."
GSM8K=${GSM8K:-openai/gsm8k}
DATA=${DATA:-data/gsm8k}
NPROC=${NPROC:-4}
mkdir -p "$DATA"
[ -f "$DATA/train.jsonl" ] || .venv/bin/vlrft prepare-data gsm8k --source "$GSM8K" --split train --out "$DATA/train.jsonl"
[ -f "$DATA/test.jsonl" ] || .venv/bin/vlrft prepare-data gsm8k --source "$GSM8K" --split test --out "$DATA/test.jsonl"
exec .venv/bin/torchrun --nproc_per_node="$NPROC" -m vlrft train-policy configs/policy/grpo.yaml \
  model.path=Qwen/Qwen2.5-1.5B-Instruct model.dtype=bfloat16 \
  data.train_source="$DATA/train.jsonl" data.eval_source="$DATA/test.jsonl" data.prompt_template=gsm8k \
  "reward.sources=[{name: accuracy, kind: verifier, verifier: gsm8k, weight: 1.0}]" \
  strategy.name=deepspeed strategy.zero_stage=2 strategy.mixed_precision=bf16 strategy.gradient_checkpointing=true \
  rollout.rollout_batch_size=256 rollout.n_samples_per_prompt=8 rollout.max_new_tokens=1024 \
  rollout.micro_rollout_batch_size=32 train.train_batch_size=512 train.micro_train_batch_size=8 \
  train.num_episodes=3 train.max_steps=0 train.eval_every=10 train.save_every=10 \
  train.output_dir=runs/qwen2_5_1_5b_gsm8k_grpo optim.lr=1e-6 algorithm.kl_coef=0.001 logging.wandb=online "$@"
