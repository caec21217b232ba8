"""The rollout section (``rollout.*``): which engine samples, with its own options, and how it samples.

Each engine's options are a section named as the engine (``rollout.hf``, ``rollout.vllm``), imported from the
engine's module, which registers the engine (``vlrft.rollout.registry``); ``rollout.engine`` takes its choices and
its help from the registry. Callers that generate outside train-policy (evaluation, judges, the supervised trainers'
held-out accuracy) build this config too, with :meth:`RolloutConfig.on_model`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from vlrft.config import option
from vlrft.rollout.async_config import AsyncRolloutConfig
from vlrft.rollout.base import SamplingParams
from vlrft.rollout.hf import HFEngineConfig
from vlrft.rollout.registry import DEFAULT_ENGINE, ENGINES
from vlrft.rollout.vllm_engine import VLLMConfig


@dataclass
class RolloutConfig:
    """Sampling of responses."""

    engine: str = option(
        DEFAULT_ENGINE,
        f"rollout engine ({'; '.join(f'{name}: {entry.help}' for name, entry in sorted(ENGINES.items()))})",
        choices=ENGINES,
    )
    mode: str = option(
        "colocated",
        "colocated: every rank samples, scores and trains in turn; async: rollout.asynchronous.rollout_ranks of the "
        "torchrun world sample and score while the others train (docs/async.md)",
        choices=("colocated", "async"),
    )
    asynchronous: AsyncRolloutConfig = option(
        AsyncRolloutConfig(), "rollout.mode=async: the rollout ranks and the staleness bound"
    )
    vllm: VLLMConfig = option(VLLMConfig(), "the vLLM engine (rollout.engine=vllm)")
    hf: HFEngineConfig = option(HFEngineConfig(), "the hf engine (rollout.engine=hf)")
    rollout_batch_size: int = option(16, "prompts per RL step (global, over all ranks)", ge=1)
    n_samples_per_prompt: int = option(8, "responses sampled per prompt (the group size)", ge=1)
    micro_rollout_batch_size: int = option(16, "prompts per generate call per rank", ge=1)
    temperature: float = option(
        1.0, "sampling temperature (> 0: greedy groups are identical and give no gradient)", gt=0, why="for training"
    )
    first_token_temperature: Optional[float] = option(
        None,
        "FIRE sampling (arXiv:2410.21236): the first response token's temperature, the rest at rollout.temperature; "
        "top_p / top_k filter it too (the paper pairs a hot first token with top-k); of a multi-turn trajectory, the "
        "first turn's first token only; training rollouts only (held-out evaluation samples at "
        "train.eval_temperature); the engine reports each token's log-prob at the temperature it was drawn at, for "
        "rollout correction (docs/train-policy.md); null: off",
        gt=0,
    )
    keyed_sampling: Optional[bool] = option(
        None,
        "sample with a counter-based RNG keyed by train.seed, the step and the prompt id, so that the tokens do not "
        "depend on which rank or which generate call samples a prompt (rollout.mode=async needs it; null: on under "
        "rollout.mode=async, off otherwise: today's global RNG)",
    )
    routing_replay: bool = option(
        False,
        "rollout routing replay for mixture-of-experts policies (R3, arXiv 2510.11370): the hf engine records, per "
        "token and MoE layer, the experts its routers chose, and the trainer's forwards (old, current and reference "
        "log-probs) route those tokens to the same experts, gated by the current router so that it still learns; "
        "hf engine only (vLLM does not return its experts), single-turn; a dense model is a config error "
        "(docs/train-policy.md)",
    )
    top_p: float = option(1.0, "nucleus sampling threshold", gt=0, le=1)
    top_k: int = option(0, "top-k filtering (0: off)", ge=0)
    max_new_tokens: int = option(16, "response length limit", ge=1)
    stop: list = option([], "stop strings (kept in the response)")

    @classmethod
    def on_model(cls, engine: str = DEFAULT_ENGINE, micro_batch_size: int = 16) -> RolloutConfig:
        """The engine ``engine`` on the model a caller loaded to generate with, as it is (``micro_batch_size`` prompts
        per generate call): the hf engine without an inference copy or a static cache, which train-policy's ``auto``
        would give a policy on CUDA."""
        plain = HFEngineConfig(inference_copy="off", compile="off")
        return cls(engine=engine, micro_rollout_batch_size=micro_batch_size, hf=plain)

    def sampling(self) -> SamplingParams:
        """How the policy samples its groups: ``n_samples_per_prompt`` responses per prompt (FIRE's hot first token
        where ``first_token_temperature`` is set)."""
        return SamplingParams(
            n=self.n_samples_per_prompt,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            max_new_tokens=self.max_new_tokens,
            stop=list(self.stop),
            first_token_temperature=self.first_token_temperature,  # the engines then report the log-probs as drawn
        )
