"""Training strategies behind one small interface (``base.Strategy``), registered by name (``registry``).

The implementations register here, explicitly, by being imported: one module each (``single``, ``fsdp2``,
``deepspeed``; DeepSpeed itself is imported only when its strategy is built). A new strategy is one module with a
class decorated ``@register_strategy("name")`` and its import below.
"""

from vlrft.strategies import deepspeed, fsdp2, single  # noqa: F401 - each registers its strategy
from vlrft.strategies.adapt import adapt_for_device
from vlrft.strategies.base import Strategy
from vlrft.strategies.config import OptimConfig, StrategyConfig
from vlrft.strategies.process import finish_process, init_distributed
from vlrft.strategies.registry import STRATEGIES, register_strategy, strategy_class
from vlrft.strategies.rng import rng_state, seed_everything, set_rng_state


def make_strategy(cfg: StrategyConfig, optim: OptimConfig | None = None) -> Strategy:
    """Build the strategy ``cfg.name`` (initialising torch.distributed from torchrun's environment); an unknown name
    is a one-line error with a did-you-mean."""
    return strategy_class(cfg.name)(cfg, optim)


__all__ = [
    "STRATEGIES",
    "OptimConfig",
    "Strategy",
    "StrategyConfig",
    "adapt_for_device",
    "finish_process",
    "init_distributed",
    "make_strategy",
    "register_strategy",
    "rng_state",
    "seed_everything",
    "set_rng_state",
]
