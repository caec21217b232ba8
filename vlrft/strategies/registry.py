"""The registry of training strategies: ``strategy.name`` -> the class that implements it.

Each implementation module registers its :class:`~vlrft.strategies.base.Strategy` subclass with
:func:`register_strategy`; ``vlrft/strategies/__init__.py`` imports every implementation module, so they are all
registered once the package is imported, and ``make_strategy`` looks the name up (:func:`strategy_class`).
``StrategyConfig.name`` takes its choices from :data:`STRATEGIES`, and code outside the implementations asks the
strategy what it does (``strategy.shards_parameters``, ``strategy.wraps_in_deepspeed``), never its name. A new
strategy is one module with its registered class, plus its import in the package ``__init__``.
"""

from __future__ import annotations

from typing import Callable, TypeVar

from vlrft.registries import add, lookup

T = TypeVar("T", bound=type)

# name -> strategy class; filled by @register_strategy on each implementation class
STRATEGIES: dict[str, type] = {}

# the strategy of a config that names none: one process, plain PyTorch (vlrft.strategies.single registers it)
DEFAULT_STRATEGY = "single"


def register_strategy(name: str) -> Callable[[T], T]:
    """Class decorator: register a strategy class under ``name`` (what ``strategy.name`` selects) and set the
    class's ``name`` to it."""

    def register(cls: T) -> T:
        add(STRATEGIES, name, cls, "strategy")
        cls.name = name
        return cls

    return register


def strategy_class(name: str) -> type:
    """The class registered under ``name``; an unknown name is a one-line error with a did-you-mean."""
    return lookup(STRATEGIES, name, "strategy")
