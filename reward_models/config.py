"""Typed config of ``vlrft train-reward-model`` (YAML file + ``key.sub=value`` overrides)."""

from __future__ import annotations

from dataclasses import dataclass

from vlrft.config import option
from vlrft.micro_batching import micro_batch_tokens_option
from vlrft.models.loading import ModelConfig
from vlrft.run_config import DataSourceConfig, RunConfig
from vlrft.strategies.config import OptimConfig, StrategyConfig
from vlrft.tracking import LoggingConfig


@dataclass
class RMModelConfig(ModelConfig):
    """Which reward model to train and what it starts from (``path`` empty: a tiny random model written to
    output_dir/initial-model, for demos and tests)."""

    kind: str = option(
        "srm", "srm: scalar RM on preference pairs; grm: generative judge on judgment records", choices=("srm", "grm")
    )
    pooling: str = option(
        "last_token", "SRM head input: last non-padding token or attention pooling", choices=("last_token", "attention")
    )


@dataclass
class RMDataConfig(DataSourceConfig):
    """Training and held-out data (``vlrft.loop.DataSourceConfig``): preference pairs (srm) or judgment records
    (grm), from files or synthetic:TASK."""

    eval_fraction: float = option(
        0.1,
        "eval_source empty and train_source a file: this fraction of it is held out (0: no held-out eval)",
        ge=0,
        lt=1,
    )
    group_size: int = option(
        1,
        "keep groups of this many consecutive training records in one batch (e.g. 2: a "
        "prompt's right and wrong candidate judged side by side); batch_size should be a multiple",
        ge=1,
    )
    max_length: int = option(1024, "longest tokenised prompt+response; longer records are an error", ge=1)


@dataclass
class RMLossConfig:
    """Bradley-Terry loss options (SRM)."""

    use_margin: bool = option(True, "subtract each pair's `margin` inside the sigmoid (Llama 2 eq. 2)")
    tie_mode: str = option("half", "ties: BT with target 1/2 (half) or Rao-Kupper", choices=("half", "rao_kupper"))
    log_theta: float = option(1.0, "Rao-Kupper tau = log(theta) > 0: width of the tie region", gt=0)


@dataclass
class RMJudgeConfig:
    """Generative reward model (judge) options."""

    mode: str = option(
        "pointwise", "judgment format: pointwise yes/no/score, or pairwise A/B", choices=("pointwise", "pairwise")
    )
    max_new_tokens: int = option(
        24, "judgment length limit in tokens when evaluating (<answer>yes</answer> is ~11 tiny-tokenizer tokens)", ge=1
    )
    score_max: float = option(1.0, "pointwise numeric scores are divided by this", gt=0)
    verdict_loss_weight: float = option(
        1.0,
        "loss weight of the verdict tokens (inside the last <answer> tag) relative to the other target tokens",
        ge=0,
    )


@dataclass
class RMTrainConfig(RunConfig):
    """The run (``vlrft.loop.RunConfig``), batches and held-out evaluation of a reward model."""

    batch_size: int = option(8, "pairs (srm) or records (grm) per step per process", ge=1)
    micro_batch_tokens: int = micro_batch_tokens_option()
    eval_batch_size: int = option(16, "batch size for held-out evaluation", ge=1)
    max_eval_records: int = option(0, "cap on held-out records per evaluation (0: all)", ge=0)


@dataclass
class RewardModelTrainConfig:
    """``vlrft train-reward-model``: an SRM on preference pairs or a GRM on judgment records."""

    model: RMModelConfig = option(RMModelConfig(), "the reward model")
    data: RMDataConfig = option(
        RMDataConfig(synthetic_train_size=512, synthetic_eval_size=128), "training and held-out data"
    )
    loss: RMLossConfig = option(RMLossConfig(), "Bradley-Terry loss (srm)")
    judge: RMJudgeConfig = option(RMJudgeConfig(), "judgment format (grm)")
    optim: OptimConfig = option(OptimConfig(lr=1e-5), "AdamW and learning-rate schedule")
    strategy: StrategyConfig = option(StrategyConfig(), "single process, FSDP2 or DeepSpeed")
    train: RMTrainConfig = option(
        RMTrainConfig(output_dir="runs/reward_model", max_steps=200, eval_every=50, log_every=10),
        "the run, batches, evaluation",
    )
    logging: LoggingConfig = option(
        LoggingConfig(wandb_project="vlrft-reward-model"), "TensorBoard, wandb, progress bar"
    )

    def validate(self) -> None:
        if self.data.group_size < 1 or self.train.batch_size % self.data.group_size:
            raise ValueError(
                f"train.batch_size ({self.train.batch_size}) must be a multiple of data.group_size "
                f"({self.data.group_size} >= 1), so that a group never straddles two batches"
            )
