"""The rollout seam: what an engine is given (encoded prompts, :class:`SamplingParams`) and returns
(:class:`Rollout` per sample), and the :class:`RolloutEngine` interface the trainer, eval and judges use."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Protocol

import torch

from data_pipelines.collate import EncodedPrompt

# Vision placeholder tokens: a sampled one would make the next forward expect image features for it, so
# every engine gives them probability 0 (TRL does the same), and the trainer computes the log-probs of that
# same distribution (vlrft.trainer.experience.response_logprobs, ``suppress``): the policy that is trained
# is the policy that samples.
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")


def vision_token_ids(tokenizer) -> list[int]:
    """The ids of :data:`VISION_TOKENS` in ``tokenizer``'s vocabulary (none for a plain text vocabulary)."""
    vocab = tokenizer.get_vocab()
    return [vocab[t] for t in VISION_TOKENS if t in vocab]


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
    # [R] float32: the engine's own log-probs of ``response_ids`` under the sampling distribution, where
    # the engine reports them (vLLM); None where the trainer recomputes them anyway (``hf``)
    logprobs: torch.Tensor | None = None


def stack_rollout_logprobs(rollouts: list[Rollout], width: int) -> torch.Tensor | None:
    """``[N, width]`` engine log-probs of the rollouts' responses (0 past each response), or None when the
    engine reported none (``hf``): what rollout correction compares with the trainer's."""
    if not rollouts or any(x.logprobs is None for x in rollouts):
        return None
    out = torch.zeros((len(rollouts), width), dtype=torch.float32)
    for i, x in enumerate(rollouts):
        out[i, : x.logprobs.numel()] = x.logprobs
    return out


class RolloutEngine(Protocol):
    # False: the engine can keep parameters that do not train (a frozen vision tower) from its last load,
    # so update_weights gets the trainable ones only (Strategy.full_params(trainable_only=True))
    needs_all_params: bool

    def generate(self, prompts: list[EncodedPrompt], sampling: SamplingParams) -> list[Rollout]:
        """``sampling.n`` rollouts per prompt, prompt-major (rollouts of prompt 0 first)."""

    def update_weights(self, named_params: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the policy's current weights from ``Strategy.full_params()``'s stream (called on every
        rank after each update). An engine that generates with the training module itself ignores the
        stream without reading it, so nothing is gathered."""

    def sleep(self) -> None:
        """Free the engine's memory (weights, KV cache) while the trainer updates the policy."""

    def wake(self) -> None:
        """Bring the engine back after :meth:`sleep`, before :meth:`update_weights`."""
