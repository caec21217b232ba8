"""The asynchronous placement's options (``rollout.asynchronous.*``, read where ``rollout.mode: async``;
docs/async.md). The section is spelled out because ``async`` is a Python keyword."""

from __future__ import annotations

from dataclasses import dataclass

from vlrft.config import option


@dataclass
class AsyncRolloutConfig:
    """Rollout ranks apart from trainer ranks (``rollout.mode: async``)."""

    rollout_ranks: int = option(
        1,
        "torchrun ranks that sample and score (the first rollout_ranks / nodes local ranks of every node); the "
        "others train",
        ge=1,
    )
    max_staleness: int = option(
        1,
        "a step trains on samples of the policy at most this many updates old (0: lockstep, the synchronous "
        "result; 1: sampling of step s+1 overlaps training of step s); rollout ranks wait rather than run ahead",
        ge=0,
    )
    partial: bool = option(
        False,
        "partial rollouts: a version the trainers publish while a rollout rank generates is loaded between two decode "
        "steps and the rest of the response is sampled by it (each token records its version; the KV cache of the "
        "tokens before stays, computed by the older weights); false: a version is loaded only between steps. hf "
        "engine, single-turn only; the run is then not reproducible (when a version lands depends on timing)",
    )
