"""The optimizer and learning-rate schedule every strategy builds from ``optim`` (:class:`OptimConfig`)."""

from __future__ import annotations

import math

import torch

from vlrft.strategies.config import OptimConfig


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int):
    """Linear warm-up to ``lr``, then constant, cosine or linear decay to ``min_lr_ratio * lr``."""

    def factor(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.lr_scheduler == "constant" or total_steps <= cfg.warmup_steps:
            return 1.0
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
        decay = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.lr_scheduler == "cosine" else 1 - progress
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * decay

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def make_optimizer(params, cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable ``params``, torch's per-tensor loop. Its fused kernel (``fused=True``) is 3x faster
    on CPU (13 ms against 38 ms for 21 M parameters, docs/benchmarks.md) but rounds differently by a few ulps, which
    moves two learning proofs of the slow suite off the trajectories they were shown on (the tools proof's SFT stage
    reached 0.75, the judge RL proof stayed at the positive verdict); it waits until those proofs hold across float
    rounding."""
    return torch.optim.AdamW(
        [p for p in params if p.requires_grad],
        lr=cfg.lr,
        betas=tuple(cfg.betas),
        eps=cfg.eps,
        weight_decay=cfg.weight_decay,
    )
