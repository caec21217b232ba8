"""``vlrft train-policy [CONFIG.yaml] [key.sub=value ...]``: RL fine-tuning of a Qwen-VL policy."""

from __future__ import annotations

import argparse
from pathlib import Path

# used when no CONFIG.yaml is given: the tiny GRPO colour-naming run (the README's quick start)
DEMO_CONFIG = Path(__file__).resolve().parents[1] / "trainer" / "demo.yaml"


def split_config_args(items: list[str]) -> tuple[list[str], list[str]]:
    """``[CONFIG.yaml ...] key=value ...`` -> (config paths, later ones winning; overrides)."""
    n = next((i for i, item in enumerate(items) if "=" in item), len(items))
    return list(items[:n]), list(items[n:])


def add_parser(sub: argparse._SubParsersAction) -> None:
    from vlrft.config import describe
    from vlrft.trainer.config import PolicyTrainConfig

    p = sub.add_parser(
        "train-policy",
        help="train a Qwen-VL / Qwen policy with GRPO-family algorithms or PPO",
        description="Train a policy with RL. With no CONFIG, uses the embedded default (vlrft/trainer/demo.yaml): "
        "builds a tiny Qwen2.5-VL and trains it with GRPO on a synthetic colour-naming task, evaluating "
        "held-out prompts before and after (a few minutes on a laptop CPU). Ready recipes: configs/policy/*.yaml; "
        "launch scripts for real scales: scripts/. Run under torchrun for fsdp2/deepspeed (strategy.name=...).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config keys (YAML or key.sub=value):\n" + "\n".join(describe(PolicyTrainConfig)),
    )
    p.add_argument("items", nargs="*", metavar="[CONFIG.yaml ...] [key=value ...]",
                   help="optional YAML configs (later ones win), then dotted overrides such as "
                   "algorithm.kl_coef=0.01")  # fmt: skip
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from vlrft.config import load_config
    from vlrft.trainer.config import PolicyTrainConfig
    from vlrft.trainer.run import train_policy

    paths, overrides = split_config_args(args.items)
    cfg = load_config(PolicyTrainConfig, paths or DEMO_CONFIG, overrides)
    train_policy(cfg)
    return 0
