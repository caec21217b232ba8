"""``vlrft train-sft [CONFIG.yaml ...] [key.sub=value ...]``: supervised fine-tuning of a Qwen-VL policy or judge."""

from __future__ import annotations

import argparse
from pathlib import Path

from vlrft.commands import add_config_command

# used when no CONFIG.yaml is given: the tiny demo run
DEMO_CONFIG = Path(__file__).resolve().parents[1] / "trainer" / "sft_demo.yaml"


def add_parser(sub: argparse._SubParsersAction) -> None:
    add_config_command(
        sub,
        "train-sft",
        schema="vlrft.trainer.supervised_config:SFTTrainConfig",
        default=DEMO_CONFIG,
        train=run,
        help="supervised fine-tuning on chat records (loss on assistant tokens only)",
        description="Fine-tune on conversations (single or multi-turn, images in any turn, text-only) with the loss "
        "on the assistant's tokens only. With no CONFIG it trains a tiny random Qwen2.5-VL on demonstrations of a "
        "synthetic colour task and prints held-out accuracy before and after (about a minute on a laptop CPU). "
        "The model goes to OUTPUT_DIR/final (train-policy model.path=..., vlrft eval). Ready configs: "
        "configs/sft/*.yaml. Run under torchrun for fsdp2/deepspeed (strategy.name=...).",
    )


def run(cfg: object) -> None:
    from vlrft.trainer.supervised_run import train_sft

    train_sft(cfg)
