"""Generation for evaluation, through a rollout engine (``vlrft.rollout``): the same prompt encoding,
batching and sampling as the policy trainer. Greedy when ``temperature == 0`` (n > 1 then repeats the
single greedy response); seeded sampling otherwise, on a forked RNG so that an in-training evaluation
leaves the trainer's RNG untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from data_pipelines.collate import EncodedPrompt, encode_prompt
from vlrft.rollout import SamplingParams
from vlrft.rollout.base import Rollout, Trajectory
from vlrft.rollout.trajectories import TrajectoryRunner


@dataclass
class Generation:
    text: str  # the response (a trajectory's last assistant turn)
    num_tokens: (
        int  # generated tokens, EOS included when the model stopped by itself (a trajectory: all after the prompt)
    )
    finish_reason: str  # "stop" (EOS) or "length" (max_new_tokens reached); trajectories also "budget", "max_turns"
    trajectory: Trajectory | None = None  # multi-turn rollouts with tools: the turns, calls and returned images


def sample_rollouts(
    engine: Any,
    processor: Any,
    records: list[Any],
    sampling: SamplingParams,
    *,
    system_prompt: str | None,
    prompt_template: str | None,
    image_kwargs: dict[str, Any] | None = None,
    trajectories: TrajectoryRunner | None = None,
) -> tuple[list[EncodedPrompt], list[Rollout]]:
    """The records encoded once each (their tools listed when ``trajectories`` runs them) and ``sampling.n`` rollouts
    per record from ``engine``, or trajectories through the runner (on that engine): how the trainer and the
    evaluation both sample."""
    prompts = [
        encode_prompt(
            processor,
            r,
            system_prompt=system_prompt,
            prompt_template=prompt_template,
            image_kwargs=image_kwargs,
            tools=trajectories.schemas if trajectories is not None else None,
        )
        for r in records
    ]
    if trajectories is not None:
        return prompts, trajectories.run(list(records), prompts, sampling)
    return prompts, engine.generate(prompts, sampling)


def generate_with_engine(
    engine: Any,
    processor: Any,
    records: list[Any],
    *,
    system_prompt: str | None,
    prompt_template: str | None,
    n: int = 1,
    temperature: float = 0.0,
    top_p: float = 1.0,
    max_new_tokens: int = 512,
    seed: int = 0,
    image_kwargs: dict[str, Any] | None = None,
    trajectories: TrajectoryRunner | None = None,
) -> list[list[Generation]]:
    """``n`` responses per record (prompt-major) from ``engine``; in training it is the trainer's own
    engine (sharded models, vLLM). ``image_kwargs`` size images that are not loaded yet (default: the
    processor's own bounds). ``trajectories``: multi-turn rollouts with tools through that runner (on its engine)."""

    sample = temperature > 0
    sampling = SamplingParams(n=n if sample else 1, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens)
    # the engine's sampler draws from the global CPU or current-GPU generator: fork both
    with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
        torch.manual_seed(seed)
        _, rollouts = sample_rollouts(
            engine,
            processor,
            records,
            sampling,
            system_prompt=system_prompt,
            prompt_template=prompt_template,
            image_kwargs=image_kwargs,
            trajectories=trajectories,
        )
    results: list[list[Generation]] = [[] for _ in records]
    for r in rollouts:
        results[r.prompt_index].append(Generation(r.text, int(r.response_ids.numel()), r.finish_reason, r.trajectory))
    return results if sample else [g * n for g in results]
