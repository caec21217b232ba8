"""The policy trainer's checkpoints: what a policy checkpoint holds beside the strategy's own state (step,
prompt cursor, RNG states, KL controller, reward normaliser, DAPO history, the count of skipped non-finite
steps), how it is written (the critic's first: a policy checkpoint implies its critic is complete) and
how a run resumes from it (verified checkpoint, logs of redone steps dropped, engine given the weights)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vlrft import checkpoints
from vlrft.strategies import rng_state, set_rng_state
from vlrft.tracking import truncate_run_logs


def client_state(trainer: Any) -> dict[str, Any]:
    return {
        "step": trainer.step,
        "cursor": trainer.cursor,
        "rng": rng_state(),
        "kl_coef": trainer.kl_ctl.value,
        "normalizer": trainer.normalizer.state_dict() if trainer.normalizer is not None else None,
        "history": trainer.history,
        "nonfinite_skipped": trainer.guard.skipped,
    }


def save_checkpoint(trainer: Any) -> Path:
    keep, out, step = trainer.cfg.train.keep_last, trainer.out, trainer.step
    if trainer.critic is not None:  # written first: a policy checkpoint implies its critic is complete
        checkpoints.save_checkpoint(trainer.critic_strategy, out / "critic_checkpoints", step, {"step": step}, keep)
    return checkpoints.save_checkpoint(trainer.strategy, out / "checkpoints", step, client_state(trainer), keep)


def resume(trainer: Any) -> None:
    """Resume ``trainer`` from the checkpoint ``train.resume`` names (``auto``: the newest verified one)."""
    out = trainer.out
    log = trainer.tracker.print if trainer.tracker is not None else print
    path = checkpoints.resume_path(out / "checkpoints", trainer.cfg.train.resume, log=log)
    if path is None:
        return
    state = trainer.strategy.load_checkpoint(path)
    if trainer.critic is not None:
        critic = checkpoints.resume_path(out, str(out / "critic_checkpoints" / path.name), key="critic")
        trainer.critic_strategy.load_checkpoint(critic)
    trainer.step, trainer.cursor, trainer.history = state["step"], state["cursor"], state["history"]
    trainer.kl_ctl.value = state["kl_coef"]
    trainer.guard.skipped = state.get("nonfinite_skipped", 0)
    if trainer.normalizer is not None and state["normalizer"] is not None:
        trainer.normalizer.load_state_dict(state["normalizer"])
    set_rng_state(state["rng"])
    if trainer.strategy.is_rank0:  # logs written after the checkpoint belong to steps that will be redone
        truncate_run_logs(out, trainer.step)
    trainer.strategy.barrier()
    trainer._sync_engine()  # an engine with its own weights still holds the initial ones
    if trainer.tracker is not None:
        trainer.tracker.print(f"resumed from {path} at step {trainer.step}")
