"""``vlrft train-dpo [CONFIG.yaml ...] [key.sub=value ...]``: offline preference optimisation (DPO, IPO, cDPO, RPO)."""

from __future__ import annotations

import argparse
from pathlib import Path

from vlrft.commands import add_config_command

# used when no CONFIG.yaml is given: the tiny demo run
DEMO_CONFIG = Path(__file__).resolve().parents[1] / "trainer" / "dpo_demo.yaml"


def add_parser(sub: argparse._SubParsersAction) -> None:
    add_config_command(
        sub,
        "train-dpo",
        schema="vlrft.trainer.supervised_config:DPOTrainConfig",
        default=DEMO_CONFIG,
        train=run,
        help="DPO / IPO / conservative DPO / RPO on preference pairs with images",
        description="Optimise a policy on preference pairs (prompt, images, chosen, rejected) against a frozen "
        "reference. With no CONFIG it trains a tiny random Qwen2.5-VL on right-vs-wrong answers of a synthetic "
        "colour task and prints the held-out preference accuracy of the implicit reward and the greedy answer "
        "accuracy before and after. The model goes to OUTPUT_DIR/final. Ready configs: configs/dpo/*.yaml. "
        "Run under torchrun for fsdp2/deepspeed (strategy.name=...).",
    )


def run(cfg: object) -> None:
    from vlrft.trainer.supervised_run import train_dpo

    train_dpo(cfg)
