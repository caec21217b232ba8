"""Training strategies: ``single``, ``fsdp2`` and ``deepspeed`` behind one small interface."""

from vlrft.strategies.base import (
    OptimConfig,
    Strategy,
    StrategyConfig,
    finish_process,
    init_distributed,
    rng_state,
    seed_everything,
    set_rng_state,
)
from vlrft.strategies.deepspeed import DeepSpeedStrategy
from vlrft.strategies.fsdp2 import FSDP2Strategy
from vlrft.strategies.single import SingleStrategy


def make_strategy(cfg: StrategyConfig, optim: OptimConfig | None = None) -> Strategy:
    """Build the strategy ``cfg.name`` (initialising torch.distributed from torchrun's environment)."""
    if cfg.name == "single":
        return SingleStrategy(cfg, optim)
    if cfg.name == "fsdp2":
        return FSDP2Strategy(cfg, optim)
    if cfg.name == "deepspeed":
        return DeepSpeedStrategy(cfg, optim)
    raise ValueError(f"unknown strategy {cfg.name!r}; choose single, fsdp2 or deepspeed")


__all__ = [
    "OptimConfig",
    "Strategy",
    "StrategyConfig",
    "finish_process",
    "init_distributed",
    "make_strategy",
    "rng_state",
    "seed_everything",
    "set_rng_state",
]
