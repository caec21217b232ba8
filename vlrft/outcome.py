"""What a run keeps when it goes wrong (``vlrft.loop`` calls it): the best model so far (``best/``, by the held-out
``train.best_metric``) and what a sustained collapse does (``train.on_collapse``: warn, stop or roll back).

``best/`` is written like ``final/`` (into ``best.tmp``, then renamed over the old one), whenever an evaluation
improves on the best value so far (strictly: a tie keeps the earlier model), the step 0 evaluation included; its
``best.json`` and the run's ``summary.json`` say ``{step, metric, value}``. The best value so far is part of every
checkpoint, so a resumed run compares against the same figure.

A trainer says when its run is in a sustained collapse (:meth:`vlrft.loop.Trainer.collapse_start`: the policy's
answer-collapse alarm, ``vlrft.trainer.collapse``). With ``on_collapse: stop`` the run ends there (one line, exit code
2; ``best/`` and the checkpoints stay); with ``rollback`` it goes back to the newest complete checkpoint from before
the collapse began, multiplies the learning rate by ``collapse_lr_factor`` and continues, at most ``max_rollbacks``
times (each a console line, in ``summary.json`` under ``rollbacks``); with ``warn`` (the default) the alarm is all.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vlrft.checkpoints import checkpoint_step
from vlrft.errors import KnownError

BEST = "best"
LOWER_IS_BETTER = ("loss", "nll", "perplexity", "error")  # best_mode auto: these names are minimised


class CollapseError(KnownError):
    """A run stopped because its policy collapsed (``train.on_collapse: stop``, or ``rollback`` with nothing left
    to roll back to)."""


def lower_is_better(metric: str, mode: str) -> bool:
    """``train.best_mode`` for ``metric``: ``min``, ``max``, or ``auto`` (min for loss-like names)."""
    return mode == "min" or (mode == "auto" and any(word in metric for word in LOWER_IS_BETTER))


class BestModel:
    """The best held-out value so far and the step it was reached at; :meth:`offer` says when a new one is better."""

    def __init__(self, train: Any, default_metric: str | None):
        self.enabled = bool(getattr(train, "keep_best", False))
        self.metric = getattr(train, "best_metric", "") or default_metric or ""
        self.lower = lower_is_better(self.metric, getattr(train, "best_mode", "auto"))
        self.step: int | None = None
        self.value: float | None = None
        self.missing_said = False

    def offer(self, step: int, metrics: dict[str, float]) -> bool:
        """Whether ``metrics`` (one held-out evaluation, names without ``eval/``) beats the best so far (then it is
        the best); a NaN never does."""
        if not self.enabled or not self.metric or self.metric not in metrics:
            return False
        value = float(metrics[self.metric])
        if value != value:
            return False
        if self.value is not None and not (value < self.value if self.lower else value > self.value):
            return False
        self.step, self.value = step, value
        return True

    def missing(self, metrics: dict[str, float]) -> str | None:
        """The one warning for held-out metrics without the configured one (said once per run), or None."""
        if not self.enabled or self.missing_said or not metrics or self.metric in metrics:
            return None
        self.missing_said = True
        if not self.metric:
            return None
        return (
            f"warning: train.best_metric={self.metric!r} is not among the held-out metrics "
            f"({', '.join(sorted(metrics))}); best/ is not written"
        )

    def record(self) -> dict[str, Any] | None:
        """``{step, metric, value}`` of the best model, or None before one."""
        if self.step is None:
            return None
        return {"step": self.step, "metric": self.metric, "value": self.value}

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "value": self.value}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        state = state or {}
        self.step, self.value = state.get("step"), state.get("value")


def best_json(record: dict[str, Any]) -> str:
    return json.dumps(record, indent=2) + "\n"


class CollapsePolicy:
    """``train.on_collapse`` and its rollbacks so far (part of the checkpoint: a resumed run keeps its count and
    its learning-rate scale)."""

    def __init__(self, train: Any):
        self.mode = getattr(train, "on_collapse", "warn")
        self.factor = float(getattr(train, "collapse_lr_factor", 0.5))
        self.max_rollbacks = int(getattr(train, "max_rollbacks", 2))
        self.rollbacks: list[dict[str, Any]] = []

    @property
    def lr_scale(self) -> float:
        return self.factor ** len(self.rollbacks)

    def target(self, complete: list[Path], begin: int) -> Path | None:
        """The newest of the ``complete`` checkpoints (oldest first) from before step ``begin`` (the collapse's first
        step) that no earlier rollback restored, or None. A restored checkpoint that collapsed again is already on
        the way to the collapse (its held-out value may have fallen before the alarm's window began): restoring it
        once more at a lower rate collapsed again on an Intel Xeon (the rollback proof, docs/train-policy.md), so the
        next rollback goes to the checkpoint before it."""
        restored = {r["to_step"] for r in self.rollbacks}
        before = [p for p in complete if checkpoint_step(p) < begin and checkpoint_step(p) not in restored]
        return before[-1] if before else None

    def state_dict(self) -> dict[str, Any]:
        return {"rollbacks": list(self.rollbacks)}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self.rollbacks = list((state or {}).get("rollbacks", []))
