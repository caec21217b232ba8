"""Typed configs of ``vlrft train-sft`` and ``vlrft train-dpo`` (YAML file + ``key.sub=value`` overrides).

With no config the commands use their embedded demos (``sft_demo.yaml``, ``dpo_demo.yaml`` next to this
file): ``train-sft`` fine-tunes a tiny random Qwen2.5-VL on demonstrations of the synthetic colour task
and ``train-dpo`` optimises the same tiny model on right-vs-wrong answer pairs of it, both printing
held-out results before and after.
"""

from __future__ import annotations

from dataclasses import dataclass

from vlrft.algorithms import LOSS_AGG_MODES, PREFERENCE_LOSSES
from vlrft.config import option
from vlrft.micro_batching import micro_batch_tokens_option
from vlrft.run_config import DataSourceConfig, RunConfig
from vlrft.strategies.config import OptimConfig, StrategyConfig
from vlrft.tools import ToolsConfig
from vlrft.tracking import LoggingConfig
from vlrft.trainer.config import PolicyModelConfig


@dataclass
class SupervisedDataConfig(DataSourceConfig):
    """Training and held-out data (``vlrft.loop.DataSourceConfig``). train-sft trains on chat records (`messages`,
    `prompt` + `response`, or prompt records with `answer`: docs/sft.md) and evaluates on prompt records with
    `answer`; train-dpo trains and evaluates on preference pairs (`prompt`, `chosen`, `rejected`, `images`)."""

    response_template: str = option(
        "{answer}", "synthetic tasks: the demonstration (sft) / both responses (dpo) made from the answer"
    )
    prompt_template: str = option("plain", "name in PROMPT_TEMPLATES or a format string with {prompt}")
    max_length: int = option(1024, "longest conversation in tokens (images included); longer is an error")


@dataclass
class SupervisedTrainConfig(RunConfig):
    """The run (``vlrft.loop.RunConfig``) and the batches of train-sft and train-dpo."""

    batch_size: int = option(16, "records (sft) or pairs (dpo) per step per process", ge=1)
    micro_batch_size: int = option(0, "records per forward for gradient accumulation (0: the whole batch)", ge=0)
    micro_batch_tokens: int = micro_batch_tokens_option()
    eval_batch_size: int = option(16, "prompts per generate call in held-out evaluation", ge=1)
    eval_max_new_tokens: int = option(8, "greedy answer length limit in held-out evaluation", ge=1)
    eval_verifier: str = option("vocab_answer", "rule verifier scoring held-out greedy answers (reward_models)")


@dataclass
class SFTLossConfig:
    """The SFT loss (vlrft.algorithms.sft)."""

    loss_agg_mode: str = option(
        "token-mean", "aggregation of the token NLL over the whole step", choices=("token-mean", "seq-mean-token-mean")
    )


@dataclass
class DPOLossConfig:
    """The preference loss (vlrft.algorithms.preference) and its reference model."""

    loss_type: str = option("sigmoid", "sigmoid: DPO (with label_smoothing: cDPO); ipo: IPO", choices=PREFERENCE_LOSSES)
    beta: float = option(0.1, "DPO beta (IPO tau): strength of the implicit KL to the reference")
    label_smoothing: float = option(0.0, "conservative DPO: probability that a preference label is flipped")
    rpo_alpha: float = option(0.0, "RPO: weight of the chosen response's length-normalised NLL (0: off)")
    precompute_ref: bool = option(
        False, "reference log-probs of every pair in a first pass, then the reference model is freed"
    )

    def validate(self) -> None:
        if not self.beta > 0:
            raise ValueError(f"beta must be > 0, got {self.beta}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label_smoothing must lie in [0, 0.5), got {self.label_smoothing}")


@dataclass
class SFTTrainConfig:
    """``vlrft train-sft``: supervised fine-tuning on chat records, loss on assistant tokens only."""

    model: PolicyModelConfig = option(PolicyModelConfig(), "the model to fine-tune")
    data: SupervisedDataConfig = option(SupervisedDataConfig(synthetic_train_size=256), "training and held-out data")
    sft: SFTLossConfig = option(SFTLossConfig(), "the loss")
    tools: ToolsConfig = option(
        ToolsConfig(), "tools listed in the system turn of tool trajectories; synthetic demonstrations call them"
    )
    optim: OptimConfig = option(OptimConfig(lr=3e-3), "AdamW and learning-rate schedule")
    strategy: StrategyConfig = option(StrategyConfig(), "single process, FSDP2 or DeepSpeed; LoRA; frozen tower")
    train: SupervisedTrainConfig = option(
        SupervisedTrainConfig(output_dir="runs/train-sft", log_every=10), "the run, batches, evaluation"
    )
    logging: LoggingConfig = option(LoggingConfig(wandb_project="vlrft-sft"), "TensorBoard, wandb, progress bar")

    def validate(self) -> None:
        if self.sft.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"sft.loss_agg_mode {self.sft.loss_agg_mode!r} is not one of {LOSS_AGG_MODES}")


@dataclass
class DPOTrainConfig:
    """``vlrft train-dpo``: offline preference optimisation on preference pairs with images."""

    model: PolicyModelConfig = option(PolicyModelConfig(), "the policy (and its frozen reference)")
    data: SupervisedDataConfig = option(
        SupervisedDataConfig(synthetic_train_size=256), "training and held-out preference pairs"
    )
    dpo: DPOLossConfig = option(DPOLossConfig(), "the preference loss")
    optim: OptimConfig = option(OptimConfig(lr=3e-3), "AdamW and learning-rate schedule")
    strategy: StrategyConfig = option(StrategyConfig(), "single process, FSDP2 or DeepSpeed; LoRA; frozen tower")
    train: SupervisedTrainConfig = option(
        SupervisedTrainConfig(output_dir="runs/train-dpo", log_every=10), "the run, batches, evaluation"
    )
    logging: LoggingConfig = option(LoggingConfig(wandb_project="vlrft-dpo"), "TensorBoard, wandb, progress bar")
