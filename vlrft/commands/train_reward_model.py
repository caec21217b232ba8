"""``vlrft train-reward-model [CONFIG.yaml] [key.sub=value ...]``: train a scalar or generative reward model."""

from __future__ import annotations

import argparse


def add_parser(sub: argparse._SubParsersAction) -> None:
    from reward_models.config import RewardModelTrainConfig
    from vlrft.config import describe

    p = sub.add_parser(
        "train-reward-model",
        help="train a scalar (Bradley-Terry) or generative (judge) reward model",
        description="Train an SRM on preference pairs (model.kind=srm) or a GRM judge on judgment records "
        "(model.kind=grm), with held-out pairwise/judgment accuracy every train.eval_every steps, checkpoints "
        "with exact resume (train.resume=auto) and the final model in OUTPUT_DIR/model. With no data source it "
        "trains on a synthetic visual task; with no model.path, on a tiny random Qwen2.5-VL. Ready configs: "
        "configs/reward_model/*.yaml. Run under torchrun for fsdp2/deepspeed (strategy.name=...).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config keys (YAML or key.sub=value):\n" + "\n".join(describe(RewardModelTrainConfig)),
    )
    p.add_argument("items", nargs="*", metavar="[CONFIG.yaml] [key=value ...]",
                   help="optional YAML config, then dotted overrides such as train.max_steps=100")  # fmt: skip
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from reward_models.config import RewardModelTrainConfig
    from reward_models.trainer import train_reward_model
    from vlrft.commands.train_policy import split_config_args
    from vlrft.config import load_config

    path, overrides = split_config_args(args.items)
    cfg = load_config(RewardModelTrainConfig, path, overrides)
    train_reward_model(cfg)
    return 0
