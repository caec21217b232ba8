"""The rollout seam: what an engine is given (encoded prompts, :class:`SamplingParams`) and returns
(:class:`Rollout` per sample), and the :class:`RolloutEngine` interface the trainer, eval and judges use."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Protocol

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


KEY_LIMIT = 1 << 63  # sampling keys are non-negative int64 values (they become an int64 tensor)


def _digest(*parts: object) -> int:
    """A stable 63-bit hash of ``parts`` (BLAKE2b of their text, NUL-separated, first 8 bytes), the same in every
    process and on every machine (Python's ``hash`` of a string is randomised per process)."""
    data = b"\x00".join(str(p).encode() for p in parts)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & (KEY_LIMIT - 1)


def sampling_key(seed: int, step: int, prompt_id: str) -> int:
    """The sampling key of a prompt at a step of a run seeded ``seed`` (``SamplingParams.keys``): a stable hash of
    the three, so every rank that samples the prompt at that step draws the same tokens."""
    return _digest("vlrft-sampling-key", int(seed), int(step), prompt_id)


def subkey(key: int, *parts: object) -> int:
    """A key derived from ``key`` for a later request of the same sample (``parts`` name it: a multi-turn
    trajectory's turn, the continuation of a FIRE draw), so that it does not reuse the noise of ``key``."""
    return _digest("vlrft-subkey", int(key), *parts)


@dataclass
class SamplingParams:
    """How to sample: ``temperature == 0`` means greedy.

    ``first_token_temperature`` (FIRE, "Flaming-hot Initiation with Regular Execution", Chen et al. 2024,
    arXiv:2410.21236, Sec. 2): the first response token is drawn from ``softmax(logits / first_token_temperature)``
    and every later one from ``softmax(logits / temperature)``; ``top_k`` and ``top_p`` apply to the first token too,
    after its temperature, as to every token (the paper filters the hot draw with top-k so that it stays among
    plausible tokens; LightRFT keeps them the same for both too). Of a multi-turn trajectory, only the first token of
    the first assistant turn (``vlrft.rollout.trajectories``). ``None``: off. ``logprobs``: the engine reports the
    log-prob of each drawn token under the distribution it was drawn from (``Rollout.logprobs``: the first token's at
    ``first_token_temperature``), which engines that always do (vllm) report anyway, and every engine does where FIRE
    samples (the hot token is drawn off the trained distribution: rollout correction needs its log-prob as drawn).

    ``keys``: keyed sampling, one non-negative 63-bit key per prompt of the ``generate`` call, in the prompts' order
    (:func:`sampling_key` of the run's seed, the step and the prompt's id): the tokens drawn for a prompt then depend
    only on its key, the model and the sampling settings, not on which rank samples it, which prompts share its call
    or how they are padded (``vlrft.rollout.keyed``: a counter-based hash of the key, the sample, the decode position
    and the token, then Gumbel-max, which draws exactly from the same distribution; the n samples of a prompt get
    distinct streams). ``None``: the engine's global RNG, as without this field. Ignored where ``temperature == 0``
    (greedy)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filtering
    max_new_tokens: int = 64
    stop: list[str] = field(default_factory=list)  # stop strings (kept in the response)
    first_token_temperature: float | None = None  # FIRE: the first response token's temperature (None: off)
    logprobs: bool = False  # report the drawn tokens' log-probs (Rollout.logprobs)
    keys: list[int] | None = None  # keyed sampling: one key per prompt of the call (None: the global RNG)

    def __post_init__(self):
        hot = self.first_token_temperature
        if hot is not None and not (hot > 0 and self.temperature > 0):
            raise ValueError(
                f"first_token_temperature={hot} with temperature={self.temperature}: FIRE samples, both must be > 0"
            )
        self.logprobs = self.logprobs or hot is not None
        if self.keys is not None:
            self.keys = [int(k) for k in self.keys]
            bad = next((k for k in self.keys if not 0 <= k < KEY_LIMIT), None)
            if bad is not None:
                raise ValueError(f"keys: {bad} is not a sampling key: each must be an integer in [0, 2**63)")

    def check_keys(self, prompts: int) -> None:
        """Raise unless ``keys`` is None or holds one key per prompt of a ``generate`` call of ``prompts``."""
        if self.keys is not None and len(self.keys) != prompts:
            raise ValueError(f"keys: {len(self.keys)} sampling keys for {prompts} prompts: give one per prompt")

    def first_token_only(self) -> SamplingParams:
        """This sampling for one token: at ``first_token_temperature`` where FIRE is on (FIRE's hot draw)."""
        hot = self.first_token_temperature
        return replace(self, max_new_tokens=1, first_token_temperature=None, temperature=hot or self.temperature)

    def after_first_token(self) -> SamplingParams:
        """This sampling from the second response token on (or for a later turn): FIRE off, the rest unchanged (its
        log-probs still reported where FIRE's were)."""
        return replace(self, first_token_temperature=None)


@dataclass
class Trajectory:
    """What a multi-turn response holds beyond its tokens (``vlrft.rollout.trajectories``): which tokens the policy
    sampled (the others are tool observations and template tokens), the images tools returned (their tokens are in
    the response) and each turn as it happened."""

    action_mask: torch.Tensor  # [R] int64, 1 on the tokens the policy sampled
    response: EncodedPrompt  # the whole response encoded: its ids, the returned images processed, their token marks
    turns: list[dict[str, Any]] = field(default_factory=list)  # per assistant turn: text, calls, observations
    messages: list[dict[str, Any]] = field(default_factory=list)  # the conversation after the prompt (for rewards)
    calls: dict[str, int] = field(default_factory=dict)  # tool name -> calls that ran
    errors: dict[str, int] = field(default_factory=dict)  # error kind -> failed calls

    @property
    def num_images(self) -> int:
        return self.response.num_images


@dataclass
class Rollout:
    """One sampled response; ``response_ids`` ends with EOS when the model stopped by itself."""

    prompt_index: int
    response_ids: torch.Tensor  # [R] int64
    text: str  # the response (of a trajectory: its last assistant turn, the answer)
    # "stop" (EOS or a stop string) or "length"; trajectories also "budget" (cut by tools.max_tokens) and
    # "max_turns" (a tool called in the last turn allowed)
    finish_reason: str
    # [R] float32: the engine's own log-probs of ``response_ids`` under the distribution each was drawn from, where
    # the engine reports them (vLLM; hf where FIRE samples or SamplingParams.logprobs asks; 0 on observation tokens);
    # None where the trainer recomputes them anyway (``hf`` otherwise)
    logprobs: torch.Tensor | None = None
    trajectory: Trajectory | None = None  # multi-turn rollouts with tools
    # [R] int64: the policy version that drew each token, where versions change while the engine generates (partial
    # rollouts, ``rollout.asynchronous.partial``: ``HFRolloutEngine.between_steps``); None: one version drew them all
    versions: torch.Tensor | None = None
    # [prompt length + R, L, k] int16: the experts each MoE layer routed the prompt's and the response's tokens to
    # (rollout routing replay, ``rollout.routing_replay``; the last response token, never fed back, holds -1); None:
    # not recorded
    routing: torch.Tensor | None = None


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
    # True: the engine holds weights of its own (an inference copy, vLLM's), loaded once and kept in step by
    # update_weights; False: it generates with the module it was given (building one costs nothing)
    owns_weights: bool
    # False: the engine can keep parameters that do not train (a frozen vision tower) from its last load,
    # so update_weights gets the trainable ones only (Strategy.full_params(trainable_only=True))
    needs_all_params: bool
    # the dtype update_weights casts the stream to (its weights'); None: no copy of its own, nothing is read
    weight_dtype: torch.dtype | None

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
