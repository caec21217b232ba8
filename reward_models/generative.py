"""Generative reward model (GRM): a Qwen(-VL) judge that writes a judgment, and the parser that reads it.

Judgment format (what the judge is trained to write, and what :func:`parse_judgment` reads): free
reasoning, if any, then the verdict in the LAST ``<answer>...</answer>`` tag:

- pointwise: ``<answer>yes</answer>`` (reward 1.0) or ``<answer>no</answer>`` (reward 0.0), or a number
  ``<answer>7</answer>`` (reward = number / ``score_max``, e.g. ``score_max: 10`` for a 0-10 scale);
  ``true``/``correct`` read as yes, ``false``/``incorrect`` as no (case and surrounding spaces ignored).
- pairwise: ``<answer>A</answer>``, ``<answer>B</answer>`` or ``<answer>tie</answer>`` (which response is
  better; reward_models/judgments.py reads it, measures position bias and turns verdicts into win rates).

Anything else (no tag, an empty tag, another word, a number that is not finite) is unparsable: the
:class:`JudgmentParser` returns its configured ``default`` and counts it. Model text is only matched
with regular expressions and ``float()``; it is never evaluated.

The judge prompt used when the GRM scores a (prompt, response) in the reward pool is the system turn
``JUDGE_SYSTEM_PROMPT`` and the user turn ``POINTWISE_JUDGE_TEMPLATE`` (both configurable), with the
record's images in the user turn: the judge format of ``data_pipelines.formatting``, whose
``pointwise_judgment_record`` builds training records in it (``data_pipelines.synthetic.make_judgment_records``
from the synthetic tasks).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from data_pipelines.collate import encode_prompt
from data_pipelines.formatting import JUDGE_SYSTEM_PROMPT, POINTWISE_JUDGE_TEMPLATE, judgment_prompt
from data_pipelines.records import PromptRecord, split_media
from reward_models.judgments import MODES, extract_answer, read_verdict
from vlrft.models.loading import load_model
from vlrft.rollout import DEFAULT_ENGINE, RolloutConfig, SamplingParams, make_engine

NUMBER_RE = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")


def parse_judgment(judgment: str, mode: str = "pointwise", score_max: float = 1.0) -> float | str | None:
    """Verdict of a judgment: a reward in ``[0, 1]``-ish (pointwise), ``"A"``/``"B"``/``"tie"`` (pairwise,
    :func:`~reward_models.judgments.read_verdict`), or ``None``."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "pairwise":
        return read_verdict(judgment, "pairwise")[0]
    answer = extract_answer(judgment)
    if not answer:
        return None
    verdict = read_verdict(judgment, "pointwise")[0]
    if verdict is not None:
        return 1.0 if verdict == "yes" else 0.0
    if NUMBER_RE.fullmatch(answer):
        value = float(answer)
        return value / score_max if math.isfinite(value) else None
    return None


@dataclass
class JudgmentParser:
    """Judgment text -> reward, with a configured default for unparsable judgments (counted)."""

    mode: str = "pointwise"
    default: float = 0.0
    score_max: float = 1.0
    n_total: int = 0
    n_unparsable: int = 0
    examples: list[str] = field(default_factory=list)  # a few unparsable judgments, for the logs

    def reward(self, judgment: str) -> float:
        if self.mode != "pointwise":
            raise ValueError("rewards come from pointwise judgments; use parse_judgment for pairwise verdicts")
        self.n_total += 1
        value = parse_judgment(judgment, "pointwise", self.score_max)
        if value is None:
            self.n_unparsable += 1
            if len(self.examples) < 3:
                self.examples.append(judgment[:200])
            return float(self.default)
        return float(value)


class GenerativeRewardModel:
    """A judge (causal LM + processor) that scores responses by generating and parsing judgments."""

    def __init__(
        self,
        model: Any,
        processor: Any,
        template: str = POINTWISE_JUDGE_TEMPLATE,
        system: str = JUDGE_SYSTEM_PROMPT,
        max_new_tokens: int = 32,
        default: float = 0.0,
        score_max: float = 1.0,
        engine: str = DEFAULT_ENGINE,
    ):
        self.model = model
        self.processor = processor
        self.engine_name = engine  # on the model itself (hf): one per call; with weights of its own (vllm): built once
        self._engine = None
        self.template = template
        self.system = system or None
        self.max_new_tokens = max_new_tokens
        self.parser = JudgmentParser("pointwise", default, score_max)

    @classmethod
    def from_pretrained(
        cls, path: str | Path, dtype: torch.dtype | None = None, **kwargs: Any
    ) -> GenerativeRewardModel:
        model, processor = load_model(path, dtype or torch.float32)
        return cls(model, processor, **kwargs)

    @torch.no_grad()
    def judge(
        self, items: list[tuple[str, list[Any], str | None]], micro_batch_size: int = 8, synced_gpus: bool = False
    ) -> list[str]:
        """Greedy judgments for ``(user_text, images, system)`` items (an ``hf`` engine on the model's device,
        or the judge's vLLM engine: ``engine="vllm"``)."""
        engine = self._engine or make_engine(
            RolloutConfig.on_model(self.engine_name, micro_batch_size), self.model, self.processor, synced=synced_gpus
        )
        if engine.owns_weights:  # loaded once (vLLM's copy), kept for every later call
            self._engine = engine
        return generate_judgments(engine, self.processor, items, self.max_new_tokens)

    def score(
        self, items: list[tuple[str, list[Any], str, str | None]], micro_batch_size: int = 8
    ) -> tuple[torch.Tensor, list[str]]:
        """Rewards ``[N]`` and judgments for ``(prompt, images, response, system)`` items."""
        judge_items = [(judgment_prompt(p, r, self.template), ims, self.system) for p, ims, r, _ in items]
        texts = self.judge(judge_items, micro_batch_size)
        return torch.tensor([self.parser.reward(t) for t in texts], dtype=torch.float32), texts


@torch.no_grad()
def generate_judgments(
    engine: Any, processor: Any, items: list[tuple[str, list[Any], str | None]], max_new_tokens: int = 16
) -> list[str]:
    """Greedy judgments for ``(user_text, images, system)`` items, through a rollout engine
    (``vlrft.rollout.make_engine``: the policy's generation path, sharded judges in lockstep)."""

    prompts = [
        encode_prompt(processor, PromptRecord(id=str(i), prompt=text, images=pics, system=system, videos=videos))
        for i, (text, ims, system) in enumerate(items)
        for pics, videos in [split_media(list(ims))]
    ]
    sampling = SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens)
    return [r.text for r in engine.generate(prompts, sampling)]
