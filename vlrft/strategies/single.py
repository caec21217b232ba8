"""One process: plain PyTorch (CPU or one GPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from vlrft.strategies.base import Strategy


class SingleStrategy(Strategy):
    def prepare(self, model: torch.nn.Module, total_steps: int = 1, trainable: bool = True):
        model = self._adapt_model(model) if trainable else model
        dtype = torch.bfloat16 if self.cfg.mixed_precision == "bf16" else None
        return self._with_optimizer(model.to(device=self.device, dtype=dtype), total_steps, trainable)

    def backward(self, loss: torch.Tensor, last_micro_batch: bool = True) -> None:
        self._check_loss(loss)
        loss.backward()

    def step(self) -> float:
        return self._clip_and_step()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}

    def save_checkpoint(self, path: str | Path, client_state: dict[str, Any]) -> None:
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "client_state": client_state,
        }
        self._save_atomically(path, lambda tmp: torch.save(state, tmp / "state.pt"))

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        state = torch.load(Path(path) / "state.pt", map_location=self.device, weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        return state["client_state"]
