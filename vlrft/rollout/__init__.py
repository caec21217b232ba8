"""Rollout engines: generate n samples per prompt on the current policy weights.

The trainer talks to an engine only through :class:`RolloutEngine` (``generate``, ``update_weights``,
``sleep``, ``wake``), so a vLLM engine (colocated, sleep/wake, weight sync by ``load_weights``) plugs in
without changing the trainer. ``hf`` (batched ``generate``) works everywhere, CPU included.
"""

from __future__ import annotations

import torch

from vlrft.rollout.base import Rollout, RolloutEngine, SamplingParams
from vlrft.rollout.hf_engine import HFRolloutEngine

__all__ = ["HFRolloutEngine", "Rollout", "RolloutEngine", "SamplingParams", "make_engine"]


def make_engine(name: str, model: torch.nn.Module, processor, *, synced: bool = False, micro_batch_size: int = 16):
    if name == "hf":
        return HFRolloutEngine(model, processor, synced=synced, micro_batch_size=micro_batch_size)
    raise ValueError(f"unknown rollout engine {name!r}; available: hf (vllm is planned)")
