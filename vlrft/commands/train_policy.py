"""``vlrft train-policy [CONFIG.yaml] [key.sub=value ...]``: RL fine-tuning of a Qwen-VL policy."""

from __future__ import annotations

import argparse


def split_config_args(items: list[str]) -> tuple[str | None, list[str]]:
    """``[CONFIG.yaml] key=value ...`` -> (config path or None, overrides)."""
    if items and "=" not in items[0]:
        return items[0], items[1:]
    return None, list(items)


def add_parser(sub: argparse._SubParsersAction) -> None:
    from vlrft.config import describe
    from vlrft.trainer.config import PolicyTrainConfig

    p = sub.add_parser(
        "train-policy",
        help="train a Qwen-VL / Qwen policy with GRPO-family algorithms or PPO",
        description="Train a policy with RL. With no config, builds a tiny Qwen2.5-VL and trains it with GRPO "
        "on a synthetic colour task, evaluating held-out prompts before and after. Ready configs: "
        "configs/policy/*.yaml. Run under torchrun for fsdp2/deepspeed (strategy.name=...).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config keys (YAML or key.sub=value):\n" + "\n".join(describe(PolicyTrainConfig)),
    )
    p.add_argument("items", nargs="*", metavar="[CONFIG.yaml] [key=value ...]",
                   help="optional YAML config, then dotted overrides such as algorithm.kl_coef=0.01")  # fmt: skip
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from vlrft.config import load_config
    from vlrft.trainer.config import PolicyTrainConfig
    from vlrft.trainer.run import train_policy

    path, overrides = split_config_args(args.items)
    cfg = load_config(PolicyTrainConfig, path, overrides)
    train_policy(cfg)
    return 0
