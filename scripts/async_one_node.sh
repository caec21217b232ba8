#!/usr/bin/env bash
# Asynchronous GRPO on Geometry3K with Qwen2.5-VL-7B-Instruct on one node of 8 GPUs (docs/async.md): torchrun
# starts 8 processes; local ranks 0 and 1 (rollout_ranks 2) sample and score with the hf engine, each on a whole
# bf16 copy of the policy, while the other 6 train it with FSDP2 and publish every new version to them. After the
# first step every step trains on samples one update old, weighted by decoupled PPO (configs/policy/async.yaml after
# the GRPO recipe). rollout_batch_size is a multiple of the 6 trainer ranks. Not yet run on GPUs (docs/async.md).
# Needs the network once (model and dataset from the hub). Usage: bash scripts/async_one_node.sh [key=value ...]
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-data/geo3k}
mkdir -p "$DATA"
[ -f "$DATA/train.jsonl" ] || .venv/bin/vlrft prepare-data geo3k --source hiyouga/geometry3k --split train --out "$DATA/train.jsonl"
[ -f "$DATA/test.jsonl" ] || .venv/bin/vlrft prepare-data geo3k --source hiyouga/geometry3k --split test --out "$DATA/test.jsonl"
exec .venv/bin/torchrun --nproc_per_node=8 -m vlrft train-policy configs/policy/grpo.yaml configs/policy/async.yaml \
  rollout.asynchronous.rollout_ranks=2 \
  model.path=Qwen/Qwen2.5-VL-7B-Instruct model.dtype=bfloat16 \
  data.train_source="$DATA/train.jsonl" data.eval_source="$DATA/test.jsonl" data.prompt_template=math_boxed \
  data.max_prompt_length=2048 \
  "reward.sources=[{name: accuracy, kind: verifier, verifier: math_boxed, weight: 1.0}, {name: format, kind: verifier, verifier: format, weight: 0.1}]" \
  strategy.name=fsdp2 strategy.mixed_precision=bf16 strategy.gradient_checkpointing=true \
  rollout.rollout_batch_size=384 rollout.n_samples_per_prompt=5 rollout.max_new_tokens=2048 \
  rollout.micro_rollout_batch_size=16 rollout.temperature=1.0 \
  train.micro_train_batch_size=4 train.num_episodes=15 train.max_steps=0 \
  train.eval_every=5 train.save_every=5 train.output_dir=runs/qwen2_5_vl_7b_geo3k_async \
  optim.lr=1e-6 optim.weight_decay=0.01 algorithm.kl_coef=0.01 logging.wandb=online "$@"
