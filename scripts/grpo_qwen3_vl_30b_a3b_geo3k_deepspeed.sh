#!/usr/bin/env bash
# GRPO on Geometry3K with Qwen3-VL-30B-A3B-Instruct (mixture of experts: 3B active), DeepSpeed ZeRO-3 (bf16) on two
# nodes of 8 GPUs, with rollout routing replay and the router's load-balancing loss at the model config's
# coefficient. Run it on each node with NODE_RANK=0|1 and MASTER_ADDR=<node 0's address>. Needs the network once.
# Usage: NODE_RANK=0 MASTER_ADDR=10.0.0.1 bash scripts/grpo_qwen3_vl_30b_a3b_geo3k_deepspeed.sh [key=value ...]
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-data/geo3k}
NPROC=${NPROC:-8}
NNODES=${NNODES:-2}
mkdir -p "$DATA"
[ -f "$DATA/train.jsonl" ] || .venv/bin/vlrft prepare-data geo3k --source hiyouga/geometry3k --split train --out "$DATA/train.jsonl"
[ -f "$DATA/test.jsonl" ] || .venv/bin/vlrft prepare-data geo3k --source hiyouga/geometry3k --split test --out "$DATA/test.jsonl"
exec .venv/bin/torchrun --nnodes="$NNODES" --node_rank="${NODE_RANK:?set NODE_RANK}" --nproc_per_node="$NPROC" \
  --master_addr="${MASTER_ADDR:?set MASTER_ADDR}" --master_port="${MASTER_PORT:-29500}" \
  -m vlrft train-policy configs/policy/grpo.yaml \
  model.path=Qwen/Qwen3-VL-30B-A3B-Instruct model.dtype=bfloat16 \
  data.train_source="$DATA/train.jsonl" data.eval_source="$DATA/test.jsonl" data.prompt_template=math_boxed \
  data.max_prompt_length=2048 \
  "reward.sources=[{name: accuracy, kind: verifier, verifier: math_boxed, weight: 1.0}, {name: format, kind: verifier, verifier: format, weight: 0.1}]" \
  strategy.name=deepspeed strategy.zero_stage=3 strategy.mixed_precision=bf16 strategy.gradient_checkpointing=true \
  rollout.routing_replay=true \
  rollout.rollout_batch_size=256 rollout.n_samples_per_prompt=8 rollout.max_new_tokens=2048 \
  rollout.micro_rollout_batch_size=8 rollout.temperature=1.0 \
  train.train_batch_size=512 train.micro_train_batch_size=2 train.num_episodes=10 train.max_steps=0 \
  train.eval_every=5 train.save_every=5 train.output_dir=runs/qwen3_vl_30b_a3b_geo3k_grpo \
  optim.lr=5e-7 optim.weight_decay=0.01 algorithm.kl_coef=0.01 logging.wandb=online "$@"
