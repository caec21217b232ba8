"""One process: plain PyTorch (CPU or one GPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from vlrft.strategies.base import Strategy, atomic_dir, commit_dir, make_optimizer, make_scheduler


class SingleStrategy(Strategy):
    def prepare(self, model: torch.nn.Module, total_steps: int = 1, trainable: bool = True):
        model = self._adapt_model(model) if trainable else model
        dtype = torch.bfloat16 if self.cfg.mixed_precision == "bf16" else None
        model = model.to(device=self.device, dtype=dtype)
        if not trainable:
            model.eval().requires_grad_(False)
            return model, None, None
        self.model = model
        self.optimizer = make_optimizer(model.parameters(), self.optim_cfg)
        self.scheduler = make_scheduler(self.optimizer, self.optim_cfg, total_steps)
        return self.model, self.optimizer, self.scheduler

    def backward(self, loss: torch.Tensor, last_micro_batch: bool = True) -> None:
        loss.backward()

    def step(self) -> float:
        params = [p for p in self.model.parameters() if p.requires_grad]
        max_norm = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(norm)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu() for k, v in self.model.state_dict().items()}

    def save_checkpoint(self, path: str | Path, client_state: dict[str, Any]) -> None:
        final = Path(path)
        tmp = atomic_dir(final)
        torch.save(
            {
                "model": self.model.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "client_state": client_state,
            },
            tmp / "state.pt",
        )
        commit_dir(tmp, final)

    def load_checkpoint(self, path: str | Path) -> dict[str, Any]:
        state = torch.load(Path(path) / "state.pt", map_location=self.device, weights_only=False)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        return state["client_state"]
