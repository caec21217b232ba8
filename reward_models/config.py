"""Typed config of ``vlrft train-reward-model`` (YAML file + ``key.sub=value`` overrides)."""

from __future__ import annotations

from dataclasses import dataclass

from vlrft.config import option
from vlrft.strategies.base import OptimConfig, StrategyConfig
from vlrft.tracking import LoggingConfig


@dataclass
class RMModelConfig:
    """Which reward model to train and what it starts from."""

    kind: str = option(
        "srm", "srm: scalar RM on preference pairs; grm: generative judge on judgment records", choices=("srm", "grm")
    )
    path: str = option(
        "",
        "Qwen(-VL) checkpoint folder to start from; empty: a tiny random Qwen2.5-VL "
        "written to output_dir/tiny_base (demos and tests)",
    )
    pooling: str = option(
        "last_token", "SRM head input: last non-padding token or attention pooling", choices=("last_token", "attention")
    )
    dtype: str = option("float32", "parameter dtype when loading", choices=("float32", "bfloat16"))


@dataclass
class RMDataConfig:
    """Training and held-out data: files/folders read by data_pipelines, or a synthetic task."""

    train_source: str = option(
        "",
        "preference (srm) or judgment (grm) records: JSONL/JSON/Parquet/CSV/"
        "datasets folder; empty: the synthetic task below",
    )
    eval_source: str = option("", "held-out records; empty: synthetic held-out set, or eval_fraction of train")
    eval_fraction: float = option(0.1, "fraction of train_source held out when eval_source is empty", ge=0, lt=1)
    synthetic_task: str = option(
        "color",
        "synthetic task when train_source is empty",
        choices=("color", "shape", "count_shapes", "triangle_angle"),
    )
    synthetic_train_size: int = option(512, "synthetic training records", ge=1)
    synthetic_eval_size: int = option(128, "synthetic held-out records (drawn with another seed)", ge=1)
    synthetic_seed: int = option(0, "seed of the synthetic training set (held-out uses seed + 1)")
    synthetic_options: dict = option(
        {}, "the synthetic task's options, e.g. {num_colors: 2} (data_pipelines.synthetic)"
    )
    group_size: int = option(
        1,
        "keep groups of this many consecutive training records in one batch (e.g. 2: a "
        "prompt's right and wrong candidate judged side by side); batch_size should be a multiple",
        ge=1,
    )
    max_length: int = option(1024, "longest tokenised prompt+response; longer records are an error", ge=1)
    system_prompt: str = option("", "system prompt for records that have none (empty: the template's default)")
    on_bad_record: str = option(
        "error", "a bad record stops the run (error) or is counted and skipped", choices=("error", "skip")
    )


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
class RMTrainConfig:
    """Loop, evaluation and checkpoint settings."""

    output_dir: str = option("runs/reward_model", "run folder: config, metrics, checkpoints, final model")
    max_steps: int = option(200, "optimizer steps", ge=1)
    batch_size: int = option(8, "pairs (srm) or records (grm) per step per process", ge=1)
    eval_every: int = option(50, "held-out accuracy every N steps (0: only at the end)", ge=0)
    eval_batch_size: int = option(16, "batch size for held-out evaluation", ge=1)
    max_eval_records: int = option(0, "cap on held-out records per evaluation (0: all)", ge=0)
    save_every: int = option(0, "checkpoint every N steps (0: no intermediate checkpoints)", ge=0)
    keep_last: int = option(2, "checkpoints kept (older ones deleted)")
    resume: str = option("auto", "auto: resume from the latest complete checkpoint; never; or a checkpoint path")
    overwrite: bool = option(False, "clear output_dir first when it holds another run's outputs (else refused)")
    max_nonfinite_steps: int = option(5, "stop after this many consecutive steps skipped for NaN/inf values", ge=1)
    log_every: int = option(10, "log training metrics every N steps", ge=1)

    def validate(self) -> None:
        if self.max_steps < 1 or self.batch_size < 1 or self.eval_batch_size < 1:
            raise ValueError("max_steps, batch_size and eval_batch_size must be >= 1")
        if self.keep_last < 1:
            raise ValueError(f"keep_last must be >= 1, got {self.keep_last}")


@dataclass
class RewardModelTrainConfig:
    """``vlrft train-reward-model``: an SRM on preference pairs or a GRM on judgment records."""

    model: RMModelConfig = option(RMModelConfig(), "the reward model")
    data: RMDataConfig = option(RMDataConfig(), "training and held-out data")
    loss: RMLossConfig = option(RMLossConfig(), "Bradley-Terry loss (srm)")
    judge: RMJudgeConfig = option(RMJudgeConfig(), "judgment format (grm)")
    optim: OptimConfig = option(OptimConfig(lr=1e-5), "AdamW and learning-rate schedule")
    strategy: StrategyConfig = option(StrategyConfig(), "single process, FSDP2 or DeepSpeed")
    train: RMTrainConfig = option(RMTrainConfig(), "loop, evaluation, checkpoints")
    logging: LoggingConfig = option(
        LoggingConfig(wandb_project="vlrft-reward-model"), "TensorBoard, wandb, progress bar"
    )

    def validate(self) -> None:
        if self.data.group_size < 1 or self.train.batch_size % self.data.group_size:
            raise ValueError(
                f"train.batch_size ({self.train.batch_size}) must be a multiple of data.group_size "
                f"({self.data.group_size} >= 1), so that a group never straddles two batches"
            )
