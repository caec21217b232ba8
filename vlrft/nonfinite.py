"""The non-finite guard of the training loops: what a trainer does with a step that went NaN.

The strategies skip a bad optimizer step themselves (``Strategy.step``: loss or global gradient norm not
finite -> gradients dropped, parameters and optimizer state untouched, ``last_step_skipped`` and
``nonfinite_quantity`` set). A trainer adds three lines around its loop:

    guard = NonFiniteGuard(cfg.train.max_nonfinite_steps)
    if guard.values_finite(strategy, rewards=r, advantages=a):   # skip the update on bad inputs
        ...; strategy.step(); guard.observe(strategy)             # after every optimizer step
    metrics.update(guard.end_step(step))                          # counts; raises after N in a row

``train/nonfinite_skipped`` counts the skipped steps of the run; after ``max_consecutive`` skipped steps
in a row the run stops with :class:`~vlrft.errors.NonFiniteError` naming the step and the quantity.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch

from vlrft.errors import NonFiniteError


class NonFiniteGuard:
    def __init__(self, max_consecutive: int, skipped: int = 0):
        self.max_consecutive = max_consecutive
        self.skipped = skipped  # skipped steps over the whole run (restored on resume)
        self.consecutive = 0
        self._quantity: str | None = None  # the first non-finite quantity of the current step

    def values_finite(self, strategy: Any, **tensors: torch.Tensor) -> bool:
        """True when every tensor is finite on every rank; otherwise the step is marked skipped with the
        first non-finite name (the same on every rank)."""
        for name, t in tensors.items():
            bad = float(t is not None and not bool(torch.isfinite(t.detach()).all()))
            if strategy.all_reduce(torch.tensor(bad), "max").item() > 0:
                self._quantity = self._quantity or name
                return False
        return True

    def observe(self, strategy: Any) -> None:
        """Read the strategy's verdict on the optimizer step it just took."""
        if strategy.last_step_skipped and self._quantity is None:
            self._quantity = strategy.nonfinite_quantity or "grad_norm"

    def end_step(self, step: int) -> dict[str, float]:
        """Close trainer step ``step``: count it when it was skipped, stop after too many in a row."""
        quantity, self._quantity = self._quantity, None
        if quantity is None:
            self.consecutive = 0
        else:
            self.skipped += 1
            self.consecutive += 1
            if self.consecutive >= self.max_consecutive:
                raise NonFiniteError(
                    f"step {step}: {quantity} was NaN or infinite for {self.consecutive} consecutive steps "
                    f"(train.max_nonfinite_steps={self.max_consecutive}); every such step was skipped and no "
                    "non-finite weights were written. Lower optim.lr, keep optim.eps > 0, check the rewards"
                )
        return {"train/nonfinite_skipped": float(self.skipped)}

    @contextmanager
    def sampling(self, step: int) -> Iterator[None]:
        """Around a rollout: finite weights can still overflow into NaN logits (an absurd learning rate), and
        torch's sampler then fails naming no cause; say which step and what to change instead."""
        try:
            yield
        except RuntimeError as exc:
            if "probability tensor contains" not in str(exc):
                raise
            raise NonFiniteError(
                f"step {step}: the policy's next-token probabilities are NaN or infinite in the rollout (the "
                "weights after the previous step overflow); lower optim.lr or resume from an earlier checkpoint"
            ) from exc

    @property
    def last_quantity(self) -> str | None:
        return self._quantity
