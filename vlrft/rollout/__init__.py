"""Rollout engines: generate n samples per prompt on the current policy weights.

The trainer talks to an engine only through :class:`RolloutEngine` (``generate``, ``update_weights``,
``sleep``, ``wake``). Engines are registered by name (``registry``: ``@register_engine``), each with its section of
:class:`RolloutConfig`: ``hf`` (hf.py: batched ``generate`` on the policy module, hf_engine.py, or on an inference
copy of it, inference_copy.py, with a static, compiled decode on CUDA, static_cache.py) works everywhere, CPU
included; ``vllm`` (vllm_engine.py) is a colocated vLLM engine with its own weights, synced after each update.
A new engine is one module with its registered builder, plus its section in ``RolloutConfig`` (config.py).
"""

from __future__ import annotations

import dataclasses

import torch

from vlrft.rollout.base import Rollout, RolloutEngine, SamplingParams, stack_rollout_logprobs
from vlrft.rollout.config import RolloutConfig
from vlrft.rollout.hf import HFEngineConfig
from vlrft.rollout.hf_engine import HFRolloutEngine
from vlrft.rollout.inference_copy import InferenceCopyEngine
from vlrft.rollout.registry import DEFAULT_ENGINE, ENGINES, engine_entry, register_engine
from vlrft.rollout.vllm_engine import VLLMConfig, VLLMRolloutEngine

__all__ = [
    "DEFAULT_ENGINE",
    "ENGINES",
    "HFEngineConfig",
    "HFRolloutEngine",
    "InferenceCopyEngine",
    "Rollout",
    "RolloutConfig",
    "RolloutEngine",
    "SamplingParams",
    "VLLMConfig",
    "VLLMRolloutEngine",
    "make_engine",
    "register_engine",
    "stack_rollout_logprobs",
]


def make_engine(
    rollout: RolloutConfig | str,
    model: torch.nn.Module,
    processor,
    *,
    synced: bool = False,
    distributed: bool = False,
    seed: int = 0,
    device: torch.device | None = None,
    **sections,
) -> RolloutEngine:
    """The engine ``rollout.engine`` on ``model``, built from its section of ``rollout`` (``rollout.hf``, ...) with
    ``rollout.micro_rollout_batch_size`` prompts per generate call. ``synced``: ``model``'s parameters are sharded
    over the ranks; ``distributed``: one engine per torchrun rank; ``seed``: an engine's own sampler seed;
    ``device``: where the policy computes (the strategy's device; by default its parameters' device), which an
    engine's automatic choices follow. An engine with a copy of its own (``owns_weights``) is kept in step by
    ``update_weights``.

    ``rollout`` may also be an engine's name, for tests and scripts: :meth:`RolloutConfig.on_model` of it, with
    sections given by keyword (``make_engine("hf", model, processor, hf=HFEngineConfig(...))``)."""
    if isinstance(rollout, str):
        rollout = dataclasses.replace(RolloutConfig.on_model(rollout), **sections)
    elif sections:
        raise TypeError(f"make_engine: the sections {', '.join(sections)} belong in the rollout config")
    entry = engine_entry(rollout.engine)
    return entry.build(
        getattr(rollout, rollout.engine),  # the engine's own section, named as the engine
        model,
        processor,
        micro_batch_size=rollout.micro_rollout_batch_size,
        synced=synced,
        distributed=distributed,
        seed=seed,
        device=device,
        routing_replay=rollout.routing_replay,
    )
