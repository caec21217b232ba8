"""The registry of rollout engines: ``rollout.engine`` -> the function that builds that engine.

Each engine module registers its builder with :func:`register_engine`, which declares the engine's one-line
description (``rollout.engine``'s help lists them). The engine's options are its section of the rollout config, the
field named as the engine (``rollout.hf``, ``rollout.vllm``); ``vlrft/rollout/config.py`` imports each engine
module for that section, so every engine is registered once ``vlrft.rollout`` is imported. ``make_engine`` looks the
name up; code outside the engines asks an engine what it does (``owns_weights``, ``needs_all_params``,
``weight_dtype``), never its name. A new engine is one module with its registered builder, plus its section in
``RolloutConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from vlrft.registries import add, lookup

# the engine of a config that names none (vlrft.rollout.hf registers it)
DEFAULT_ENGINE = "hf"


@dataclass(frozen=True)
class EngineEntry:
    """One engine: ``build(section, model, processor, *, micro_batch_size, synced, distributed, seed, device)``
    returns a :class:`~vlrft.rollout.base.RolloutEngine` (``section``: the engine's own options, e.g. ``rollout.hf``;
    each builder takes the keywords it needs and ignores the others), and what ``rollout.engine``'s help says of it."""

    build: Callable
    help: str


# name -> entry; filled by @register_engine in each engine module
ENGINES: dict[str, EngineEntry] = {}


def register_engine(name: str, help: str) -> Callable[[Callable], Callable]:
    """Decorator: register the builder of the engine ``name`` (what ``rollout.engine`` selects)."""

    def register(build: Callable) -> Callable:
        add(ENGINES, name, EngineEntry(build, help), "rollout engine")
        return build

    return register


def engine_entry(name: str) -> EngineEntry:
    """The entry registered under ``name``; an unknown name is a one-line :class:`ConfigError` with a did-you-mean."""
    return lookup(ENGINES, name, "rollout engine")
