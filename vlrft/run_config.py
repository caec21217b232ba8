"""The run sections every trainer shares (``train``: :class:`RunConfig`, ``data``: :class:`DataSourceConfig`; each
trainer's config extends them) and what may change in them when a run resumes (:func:`resume_changes`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from vlrft.config import ConfigError, load_config, option
from vlrft.run_folder import resuming

# what may differ between a run and its resumption without train.resume_changes=allow (prefixes end in '.')
RESUMABLE_CHANGES = (
    "train.max_steps",
    "train.num_episodes",
    "train.eval_every",
    "train.save_every",
    "train.keep_last",
    "train.log_every",
    "train.resume",
    "train.resume_changes",
    "train.overwrite",
    "train.preempt_signals",
    "train.keep_best",
    "train.on_collapse",
    "train.max_rollbacks",
    "train.max_nonfinite_steps",
    "train.eval_batch_size",
    "train.eval_max_new_tokens",
    "train.max_eval_records",
    "train.log_samples",
    "train.probe_every",
    "train.probe_records",
    "logging.",
    "strategy.timeout_s",
    "strategy.heartbeat_timeout_s",
)


@dataclass
class RunConfig:
    """The run fields of every trainer's ``train`` section: one meaning and one range each."""

    output_dir: str = option("runs/run", "run folder: config, metrics, checkpoints, final model, summary.json")
    max_steps: int = option(60, "optimizer steps (0: num_episodes passes over the training records)", ge=0)
    num_episodes: int = option(1, "passes over the training records when max_steps is 0", ge=1)
    eval_every: int = option(0, "held-out evaluation every N steps besides before and after (0: only those)", ge=0)
    save_every: int = option(0, "checkpoint every N steps besides the last (0: only the last)", ge=0)
    keep_last: int = option(2, "complete checkpoints of this run kept (older ones deleted)", ge=1)
    resume: str = option("auto", "auto: newest complete checkpoint in output_dir; never; or a checkpoint path")
    overwrite: bool = option(False, "clear output_dir first when it holds another run's outputs (else refused)")
    log_every: int = option(1, "training metrics logged every N steps (averaged over them)", ge=1)
    max_nonfinite_steps: int = option(5, "stop after this many consecutive steps skipped for NaN/inf values", ge=1)
    seed: int = option(
        0, "seed of the data order, sampling and every RNG of the run, plus the rank (strategy.seed: new weights)"
    )
    resume_changes: str = option(
        "refuse",
        "a resumed run whose config differs from the run's config.yaml beyond the keys that may change "
        "(RESUMABLE_CHANGES: steps, cadence, logging): refuse, or allow (the new values are used from that step)",
        choices=("refuse", "allow"),
    )
    keep_best: bool = option(
        True, "best/: the model of the best held-out best_metric so far, rewritten when an evaluation improves on it"
    )
    best_metric: str = option(
        "", "the held-out metric best/ follows (a name without eval/); '': the trainer's (accuracy where there is one)"
    )
    best_mode: str = option(
        "auto",
        "max or min of best_metric is best (auto: min for names with loss or nll)",
        choices=("auto", "max", "min"),
    )
    preempt_signals: str = option(
        "SIGTERM,SIGUSR1",
        "signals that stop the run after its current step with a complete checkpoint (exit code 75; the same "
        "command continues it); empty: none",
    )

    def validate(self) -> None:
        if not self.output_dir.strip():  # "" would be the current directory (an unset shell variable)
            raise ValueError(
                f"output_dir={self.output_dir!r} is empty; name the run folder (is a shell variable unset?)"
            )


@dataclass
class DataSourceConfig:
    """The data fields of every trainer's ``data`` section (what the records are is the trainer's)."""

    train_source: str = option(
        "synthetic:color",
        "training records: a file or folder (JSONL, JSON, Parquet, CSV, a datasets folder) or a hub id, or "
        "synthetic:TASK (color, shape, count_shapes, triangle_angle) drawn with train.seed",
        reads=True,
    )
    eval_source: str = option(
        "synthetic:color",
        "held-out records (the same forms; synthetic:TASK drawn with train.seed + 10000); empty: no held-out eval",
        reads=True,
    )
    synthetic_train_size: int = option(1024, "records drawn for a synthetic train_source", ge=1)
    synthetic_eval_size: int = option(64, "records drawn for a synthetic eval_source", ge=1)
    synthetic_options: dict = option({}, "options of the synthetic task, e.g. {num_colors: 4, noise: 24}")
    system_prompt: str = option("", "system prompt for records without one (empty: the chat template's)")
    on_bad_record: str = option(
        "error", "a bad record stops the run (error) or is counted and skipped", choices=("error", "skip")
    )
    video_fps: float = option(2.0, "frames sampled per second of video (qwen-vl-utils' FPS)", gt=0)
    video_min_frames: int = option(4, "fewest frames sampled from a video (rounded up to 2)", ge=2)
    video_max_frames: int = option(768, "most frames sampled from a video (rounded down to 2)", ge=2)
    video_min_pixels: int = option(0, "fewest pixels per video frame; 0: 128 tokens of the patch grid", ge=0)
    video_max_pixels: int = option(0, "most pixels per video frame; 0: 768 tokens of the patch grid", ge=0)
    video_total_pixels: int = option(
        0, "pixel budget of a whole video, shared by its frames; 0: 90% of a 128k-token context", ge=0
    )


def video_settings(data: Any) -> dict[str, Any]:
    """The ``data.video_*`` settings as ``data_pipelines.video.VideoSettings`` keywords (0: its default)."""
    return {
        "fps": float(data.video_fps),
        "min_frames": int(data.video_min_frames),
        "max_frames": int(data.video_max_frames),
        "min_pixels": int(data.video_min_pixels) or None,
        "max_pixels": int(data.video_max_pixels) or None,
        "total_pixels": int(data.video_total_pixels) or None,
    }


def _leaves(node: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(node, dict):
        out: dict[str, Any] = {}
        for k, v in node.items():
            out.update(_leaves(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): node}


def resume_changes(cfg: Any) -> list[tuple[str, Any, Any]]:
    """What a run that will resume changes in its config: ``(key, old, new)`` for each key that differs from the
    run folder's ``config.yaml`` (the config its checkpoints were made with), beyond :data:`RESUMABLE_CHANGES`.
    Refused with the list (ConfigError) unless ``train.resume_changes=allow``; returned when allowed."""
    t, out = cfg.train, Path(cfg.train.output_dir)
    if not resuming(out, t.resume) or not (out / "config.yaml").is_file():
        return []
    try:  # read through the schema, as the new config was: both sides in the same shape (a reward source's own keys)
        old = _leaves(OmegaConf.to_container(OmegaConf.structured(load_config(type(cfg), out / "config.yaml"))))
    except ConfigError:  # a config.yaml the schema refuses now: compared as written
        old = _leaves(OmegaConf.to_container(OmegaConf.load(out / "config.yaml")))
    new = _leaves(OmegaConf.to_container(OmegaConf.structured(cfg)))
    changed = [
        (k, old.get(k), new.get(k))
        for k in sorted(set(old) | set(new))
        if old.get(k) != new.get(k)
        and not any(k == p or (p.endswith(".") and k.startswith(p)) for p in RESUMABLE_CHANGES)
    ]
    if changed and t.resume_changes != "allow":
        listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in changed)
        raise ConfigError(
            f"train.resume: the run in {out} was made with another config ({listed}); resume with its config, "
            "or set train.resume_changes=allow to use the new values from the resumed step, or start a new run "
            "(another train.output_dir, or train.resume=never with train.overwrite=true)"
        )
    return changed
