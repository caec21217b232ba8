"""Rollout engines: generate n samples per prompt on the current policy weights.

The trainer talks to an engine only through :class:`RolloutEngine` (``generate``, ``update_weights``,
``sleep``, ``wake``). ``hf`` (batched ``generate`` on the policy module, or on an inference copy of it with a
static, compiled decode on CUDA) works everywhere, CPU included; ``vllm`` (vllm_engine.py) is a colocated vLLM
engine with its own weights, synced after each update.
"""

from __future__ import annotations

import torch

from vlrft.rollout.base import Rollout, RolloutEngine, SamplingParams, stack_rollout_logprobs
from vlrft.rollout.hf_engine import HFEngineConfig, HFRolloutEngine
from vlrft.rollout.vllm_engine import VLLMConfig, VLLMRolloutEngine

__all__ = [
    "HFEngineConfig",
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
    hf: HFEngineConfig | None = None,
    distributed: bool = False,
    seed: int = 0,
    device: torch.device | None = None,
):
    """``hf`` generates with ``model`` itself, or (``hf.inference_copy``) with a copy of it loaded from its folder;
    ``vllm`` loads its own copy from ``model``'s folder (``name_or_path``); an engine's own copy is kept in step by
    ``update_weights``. ``synced``: ``model``'s parameters are sharded over the ranks. ``device``: where the policy
    computes (the strategy's device; by default its parameters' device), which the ``hf`` engine's automatic choices
    follow."""
    if name == "hf":
        first = next(model.parameters())
        device = device if device is not None else first.device
        copy_dtype = hf.copy_dtype(first.dtype, device) if hf is not None and hf.wants_copy(synced, device) else None
        static = hf is not None and hf.wants_static_cache(copy_dtype is not None, device)
        return HFRolloutEngine(
            model,
            processor,
            synced=synced,
            micro_batch_size=micro_batch_size,
            copy_dtype=copy_dtype,
            static_cache=static,
            sleep_level=hf.sleep_level if hf is not None else 1,
            device=device,
        )
    if name == "vllm":
        dtype = next(model.parameters()).dtype
        return VLLMRolloutEngine(
            model.name_or_path, processor, vllm, model_dtype=dtype, distributed=distributed, seed=seed
        )
    raise ValueError(f"unknown rollout engine {name!r}; available: hf, vllm")
