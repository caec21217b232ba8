"""Metrics for reward-model runs (rank 0): ``metrics.jsonl``, TensorBoard, wandb (offline unless
configured) and a tqdm progress bar."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any


class Tracker:
    def __init__(self, out_dir: Path, cfg: Any, active: bool, start_step: int, total_steps: int):
        self.active = active
        self.out = Path(out_dir)
        self.tb = self.wandb = self.bar = None
        if not active:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        log = cfg.logging
        if log.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.out / "tensorboard"))
        if log.wandb != "disabled":
            import wandb

            self.wandb = wandb.init(project=log.wandb_project, mode=log.wandb, dir=str(self.out),
                                    config=dataclasses.asdict(cfg), resume="allow")  # fmt: skip
        if log.progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="train-reward-model", file=sys.stderr,
                            dynamic_ncols=True)  # fmt: skip

    def print(self, text: str) -> None:
        if self.active:
            (self.bar.write if self.bar else print)(text)

    def advance(self, loss: float) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.4f}")

    def log(self, metrics: dict[str, float], step: int) -> None:
        if not self.active or not metrics:
            return
        with open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        self.print(f"step {step}: " + ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
