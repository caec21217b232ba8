"""Rollout engines: generate n samples per prompt on the current policy weights.

The trainer talks to an engine only through :class:`RolloutEngine` (``generate``, ``update_weights``,
``sleep``, ``wake``). ``hf`` (batched ``generate`` on the policy module) works everywhere, CPU included;
``vllm`` (vllm_engine.py) is a colocated vLLM engine with its own weights, synced after each update.
"""

from __future__ import annotations

import torch

from vlrft.rollout.base import Rollout, RolloutEngine, SamplingParams, stack_rollout_logprobs
from vlrft.rollout.hf_engine import HFRolloutEngine
from vlrft.rollout.vllm_engine import VLLMConfig, VLLMRolloutEngine

__all__ = [
    "HFRolloutEngine",
    "Rollout",
    "RolloutEngine",
    "SamplingParams",
    "VLLMConfig",
    "VLLMRolloutEngine",
    "make_engine",
    "stack_rollout_logprobs",
]


def make_engine(
    name: str,
    model: torch.nn.Module,
    processor,
    *,
    synced: bool = False,
    micro_batch_size: int = 16,
    vllm: VLLMConfig | None = None,
    distributed: bool = False,
    seed: int = 0,
):
    """``hf`` generates with ``model`` itself; ``vllm`` loads its own copy from ``model``'s folder
    (``name_or_path``) and is kept in step by ``update_weights``."""
    if name == "hf":
        return HFRolloutEngine(model, processor, synced=synced, micro_batch_size=micro_batch_size)
    if name == "vllm":
        dtype = next(model.parameters()).dtype
        return VLLMRolloutEngine(
            model.name_or_path, processor, vllm, model_dtype=dtype, distributed=distributed, seed=seed
        )
    raise ValueError(f"unknown rollout engine {name!r}; available: hf, vllm")
