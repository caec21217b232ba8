#!/usr/bin/env bash
# Asynchronous GRPO on Geometry3K with Qwen2.5-VL-7B-Instruct on two nodes of 8 GPUs (docs/async.md). Run this
# script on both nodes, NODE_RANK=0 on the one at MASTER_ADDR and NODE_RANK=1 on the other:
#   NODE_RANK=0 MASTER_ADDR=node0 bash scripts/async_two_nodes.sh      # on node0
#   NODE_RANK=1 MASTER_ADDR=node0 bash scripts/async_two_nodes.sh      # on node1
# rollout_ranks 4 is a multiple of the 2 nodes: local ranks 0 and 1 of each node sample and score, the other 12
# ranks train with FSDP2 (rollout_batch_size is a multiple of 12). The run folder (train.output_dir) and the data
# must be on a file system both nodes share: every rank reads the prompts, and the checkpoints live there. Not yet
# run on GPUs (docs/async.md).
# Needs the network once (model and dataset from the hub). Usage: bash scripts/async_two_nodes.sh [key=value ...]
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=${DATA:-data/geo3k}
NODE_RANK=${NODE_RANK:?set NODE_RANK=0 or 1}
MASTER_ADDR=${MASTER_ADDR:?set MASTER_ADDR to the host name of node 0}
MASTER_PORT=${MASTER_PORT:-29500}
if [ "$NODE_RANK" = 0 ]; then
  mkdir -p "$DATA"
  [ -f "$DATA/train.jsonl" ] || .venv/bin/vlrft prepare-data geo3k --source hiyouga/geometry3k --split train --out "$DATA/train.jsonl"
  [ -f "$DATA/test.jsonl" ] || .venv/bin/vlrft prepare-data geo3k --source hiyouga/geometry3k --split test --out "$DATA/test.jsonl"
fi
exec .venv/bin/torchrun --nnodes=2 --node_rank="$NODE_RANK" --master_addr="$MASTER_ADDR" --master_port="$MASTER_PORT" \
  --nproc_per_node=8 -m vlrft train-policy configs/policy/grpo.yaml configs/policy/async.yaml \
  rollout.asynchronous.rollout_ranks=4 \
  model.path=Qwen/Qwen2.5-VL-7B-Instruct model.dtype=bfloat16 \
  data.train_source="$DATA/train.jsonl" data.eval_source="$DATA/test.jsonl" data.prompt_template=math_boxed \
  data.max_prompt_length=2048 \
  "reward.sources=[{name: accuracy, kind: verifier, verifier: math_boxed, weight: 1.0}, {name: format, kind: verifier, verifier: format, weight: 0.1}]" \
  strategy.name=fsdp2 strategy.mixed_precision=bf16 strategy.gradient_checkpointing=true \
  rollout.rollout_batch_size=384 rollout.n_samples_per_prompt=5 rollout.max_new_tokens=2048 \
  rollout.micro_rollout_batch_size=16 rollout.temperature=1.0 \
  train.micro_train_batch_size=4 train.num_episodes=15 train.max_steps=0 \
  train.eval_every=5 train.save_every=5 train.output_dir=runs/qwen2_5_vl_7b_geo3k_async_2n \
  optim.lr=1e-6 optim.weight_decay=0.01 algorithm.kl_coef=0.01 logging.wandb=online "$@"
