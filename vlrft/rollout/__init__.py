"""Rollout engines: generate n samples per prompt on the current policy weights.

The trainer talks to an engine only through :class:`RolloutEngine` (``generate``, ``update_weights``,
``sleep``, ``wake``), so a vLLM engine (colocated, sleep/wake, weight sync by ``load_weights``) plugs in
without changing the trainer. ``hf`` (batched ``generate``) works everywhere, CPU included.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Protocol

import torch

from data_pipelines.collate import EncodedPrompt


@dataclass
class SamplingParams:
    """How to sample: ``temperature == 0`` means greedy."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filtering
    max_new_tokens: int = 64
    stop: list[str] = field(default_factory=list)  # stop strings (kept in the response)


@dataclass
class Rollout:
    """One sampled response; ``response_ids`` ends with EOS when the model stopped by itself."""

    prompt_index: int
    response_ids: torch.Tensor  # [R] int64
    text: str
    finish_reason: str  # "stop" (EOS or a stop string) or "length"


class RolloutEngine(Protocol):
    def generate(self, prompts: list[EncodedPrompt], sampling: SamplingParams) -> list[Rollout]:
        """``sampling.n`` rollouts per prompt, prompt-major (rollouts of prompt 0 first)."""

    def update_weights(self, named_params: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
        """Load the policy's current weights (no-op for an engine that shares the training module)."""

    def sleep(self) -> None:
        """Free the engine's memory (weights, KV cache) while the trainer updates the policy."""

    def wake(self) -> None:
        """Bring the engine back after :meth:`sleep`."""


def make_engine(name: str, model: torch.nn.Module, processor, *, synced: bool = False, micro_batch_size: int = 16):
    if name == "hf":
        from vlrft.rollout.hf_engine import HFRolloutEngine

        return HFRolloutEngine(model, processor, synced=synced, micro_batch_size=micro_batch_size)
    raise ValueError(f"unknown rollout engine {name!r}; available: hf (vllm is planned)")
