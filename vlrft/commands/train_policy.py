"""``vlrft train-policy [CONFIG.yaml ...] [key.sub=value ...]``: RL fine-tuning of a Qwen-VL policy."""

from __future__ import annotations

import argparse
from pathlib import Path

from vlrft.commands import add_config_command

# used when no CONFIG.yaml is given: the tiny GRPO colour-naming run (the README's quick start)
DEMO_CONFIG = Path(__file__).resolve().parents[1] / "trainer" / "demo.yaml"


def add_parser(sub: argparse._SubParsersAction) -> None:
    add_config_command(
        sub,
        "train-policy",
        schema="vlrft.trainer.config:PolicyTrainConfig",
        default=DEMO_CONFIG,
        train=run,
        help="train a Qwen-VL / Qwen policy with GRPO-family algorithms or PPO",
        description="Train a policy with RL. With no CONFIG, uses the embedded default (vlrft/trainer/demo.yaml): "
        "builds a tiny Qwen2.5-VL and trains it with GRPO on a synthetic colour-naming task, evaluating "
        "held-out prompts before and after (a few minutes on a laptop CPU). Ready recipes: configs/policy/*.yaml; "
        "launch scripts for real scales: scripts/. Run under torchrun for fsdp2/deepspeed (strategy.name=...).",
    )


def run(cfg: object) -> None:
    from vlrft.trainer.run import train_policy

    train_policy(cfg)
