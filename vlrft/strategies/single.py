"""One process: plain PyTorch (CPU or one GPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from vlrft.strategies.base import Strategy
from vlrft.strategies.registry import DEFAULT_STRATEGY, register_strategy


class Autocast(torch.nn.Module):
    """``module``'s forward under ``torch.autocast`` in bf16 (``strategy.mixed_precision``): matmuls compute in bf16
    while the parameters, their gradients and the AdamW state stay in their own dtype (the fp32 master weights)."""

    def __init__(self, module: torch.nn.Module, device_type: str):
        super().__init__()
        self.module, self.device_type = module, device_type

    def forward(self, *args, **kwargs):
        with torch.autocast(self.device_type, dtype=torch.bfloat16):
            return self.module(*args, **kwargs)


@register_strategy(DEFAULT_STRATEGY)  # a config that names no strategy trains in one process
class SingleStrategy(Strategy):
    def prepare(self, model: torch.nn.Module, total_steps: int = 1, trainable: bool = True):
        model = self._prepared(model, trainable)
        model, optimizer, scheduler = self._with_optimizer(model.to(self.device), total_steps, trainable)
        computed = Autocast(model, self.device.type) if self.cfg.bf16 else model  # what forwards call
        if trainable:
            self._train_module = computed
        return computed, optimizer, scheduler

    @property
    def train_module(self) -> torch.nn.Module:
        """The model, or its bf16 autocast wrapper (``strategy.mixed_precision``)."""
        return getattr(self, "_train_module", self.model)

    def unwrap(self, model: torch.nn.Module | None = None) -> torch.nn.Module:
        model = model if model is not None else self.model
        return model.module if isinstance(model, Autocast) else model

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
