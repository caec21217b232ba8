"""Records to rollouts: how the policy trainer, its held-out evaluation and ``vlrft eval`` all sample."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from data_pipelines.collate import EncodedPrompt, encode_prompt
from vlrft.rollout.base import Rollout, SamplingParams
from vlrft.rollout.trajectories import TrajectoryRunner


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
    keys: list[int] | None = None,
) -> tuple[list[EncodedPrompt], list[Rollout]]:
    """The records encoded once each (their tools listed when ``trajectories`` runs them) and ``sampling.n`` rollouts
    per record from ``engine``, or trajectories through the runner (on that engine): how the trainer and the
    evaluation both sample. ``keys``: keyed sampling, one key per record (``SamplingParams.keys``,
    ``vlrft.rollout.base.sampling_key``); None: as ``sampling`` says."""
    if keys is not None:
        sampling = replace(sampling, keys=list(keys))
        sampling.check_keys(len(records))
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
