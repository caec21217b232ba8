"""``vlrft train-reward-model [CONFIG.yaml] [key.sub=value ...]``: train a scalar or generative reward model."""

from __future__ import annotations

import argparse

from vlrft.commands import add_config_command


def add_parser(sub: argparse._SubParsersAction) -> None:
    add_config_command(
        sub,
        "train-reward-model",
        schema="reward_models.config:RewardModelTrainConfig",
        default=None,  # the schema's defaults: synthetic data, a tiny random model
        train=run,
        help="train a scalar (Bradley-Terry) or generative (judge) reward model",
        description="Train an SRM on preference pairs (model.kind=srm) or a GRM judge on judgment records "
        "(model.kind=grm), with held-out pairwise/judgment accuracy every train.eval_every steps, checkpoints "
        "with exact resume (train.resume=auto) and the final model in OUTPUT_DIR/final. With no data source it "
        "trains on a synthetic visual task; with no model.path, on a tiny random Qwen2.5-VL. Ready configs: "
        "configs/reward_model/*.yaml. Run under torchrun for fsdp2/deepspeed (strategy.name=...).",
    )


def run(cfg: object) -> None:
    from vlrft.trainer.reward_model_run import train_reward_model

    train_reward_model(cfg)  # its preflight first: model folder, data, output folder
