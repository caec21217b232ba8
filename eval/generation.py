"""Generation for evaluation, through a rollout engine (``vlrft.rollout``): the same prompt encoding,
batching and sampling as the policy trainer (``vlrft.rollout.generation.sample_rollouts``). Greedy when
``temperature == 0`` (n > 1 then repeats the single greedy response); seeded sampling otherwise, on a forked RNG
so that an in-training evaluation leaves the trainer's RNG untouched.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from vlrft.rollout.base import SamplingParams, Trajectory
from vlrft.rollout.generation import sample_rollouts
from vlrft.rollout.trajectories import TrajectoryRunner


@dataclass
class Generation:
    text: str  # the response (a trajectory's last assistant turn)
    num_tokens: (
        int  # generated tokens, EOS included when the model stopped by itself (a trajectory: all after the prompt)
    )
    finish_reason: str  # "stop" (EOS) or "length" (max_new_tokens reached); trajectories also "budget", "max_turns"
    trajectory: Trajectory | None = None  # multi-turn rollouts with tools: the turns, calls and returned images


def generate_with_engine(
    engine: Any,
    processor: Any,
    records: list[Any],
    sampling: SamplingParams,
    *,
    seed: int = 0,
    system_prompt: str | None,
    prompt_template: str | None,
    image_kwargs: dict[str, Any] | None = None,
    trajectories: TrajectoryRunner | None = None,
) -> list[list[Generation]]:
    """``sampling.n`` responses per record (prompt-major) from ``engine``, sampled with the CPU and GPU generators
    seeded with ``seed``; greedy (``temperature == 0``): the one greedy response, repeated n times. In training
    ``engine`` is the trainer's own (sharded models, vLLM). ``image_kwargs`` size images that are not loaded yet
    (default: the processor's own bounds). ``trajectories``: multi-turn rollouts with tools through that runner (on
    its engine)."""

    sample = sampling.temperature > 0
    # the engine's sampler draws from the global CPU or current-GPU generator: fork both
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
        torch.manual_seed(seed)
        _, rollouts = sample_rollouts(
            engine,
            processor,
            records,
            sampling if sample else replace(sampling, n=1),
            system_prompt=system_prompt,
            prompt_template=prompt_template,
            image_kwargs=image_kwargs,
            trajectories=trajectories,
        )
    results: list[list[Generation]] = [[] for _ in records]
    for r in rollouts:
        results[r.prompt_index].append(Generation(r.text, int(r.response_ids.numel()), r.finish_reason, r.trajectory))
    return results if sample else [g * sampling.n for g in results]
