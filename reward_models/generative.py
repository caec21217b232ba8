"""Generative reward model (GRM): a Qwen(-VL) judge that writes a judgment, and the parser that reads it.

Judgment format (what the judge is trained to write, and what :func:`parse_judgment` reads): free
reasoning, if any, then the verdict in the LAST ``<answer>...</answer>`` tag:

- pointwise: ``<answer>yes</answer>`` (reward 1.0) or ``<answer>no</answer>`` (reward 0.0), or a number
  ``<answer>7</answer>`` (reward = number / ``score_max``, e.g. ``score_max: 10`` for a 0-10 scale);
  ``true``/``correct`` read as yes, ``false``/``incorrect`` as no (case and surrounding spaces ignored).
- pairwise: ``<answer>A</answer>`` or ``<answer>B</answer>`` (which response is better).

Anything else (no tag, an empty tag, another word, a number that is not finite) is unparsable: the
:class:`JudgmentParser` returns its configured ``default`` and counts it. Model text is only matched
with regular expressions and ``float()``; it is never evaluated.

The judge prompt used when the GRM scores a (prompt, response) in the reward pool is the system turn
:data:`JUDGE_SYSTEM_PROMPT` and the user turn :data:`POINTWISE_JUDGE_TEMPLATE` (both configurable),
with the record's images in the user turn; :func:`pointwise_judgment_record` builds training records
in that format.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from data_pipelines.collate import encode_prompt
from data_pipelines.records import JudgmentRecord, PromptRecord
from data_pipelines.synthetic import make_prompt_records
from vlrft.models.loading import load_model
from vlrft.rollout import SamplingParams, make_engine

ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
YES = ("yes", "true", "correct")
NO = ("no", "false", "incorrect")
NUMBER_RE = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
MODES = ("pointwise", "pairwise")

# The judge prompt the reward pool uses for a (prompt, response): the instruction is the system turn and
# the candidate answer ends the user turn, right before the judgment (a tiny judge learns this layout
# several times faster than one with the instruction after the candidate). Images go first (or at <image>).
JUDGE_SYSTEM_PROMPT = (
    "You are a judge. Reply <answer>yes</answer> if the candidate answer to the question is correct, "
    "otherwise <answer>no</answer>."
)
POINTWISE_JUDGE_TEMPLATE = "Question: {prompt}\nCandidate answer: {response}"


def extract_answer(judgment: str) -> str | None:
    """Content of the last ``<answer>...</answer>`` tag, stripped; ``None`` without one."""
    found = ANSWER_RE.findall(judgment)
    return found[-1].strip() if found else None


def parse_judgment(judgment: str, mode: str = "pointwise", score_max: float = 1.0) -> float | str | None:
    """Verdict of a judgment: a reward in ``[0, 1]``-ish (pointwise), ``"A"``/``"B"`` (pairwise), or ``None``."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    answer = extract_answer(judgment)
    if not answer:
        return None
    word = answer.lower()
    if mode == "pairwise":
        return answer.upper() if word in ("a", "b") else None
    if word in YES:
        return 1.0
    if word in NO:
        return 0.0
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


def judgment_prompt(prompt: str, response: str, template: str = POINTWISE_JUDGE_TEMPLATE) -> str:
    """The judge's user text for one response (``<image>`` placeholders of the prompt are kept)."""
    return template.replace("{prompt}", prompt).replace("{response}", response)


def pointwise_judgment_record(
    record: PromptRecord,
    response: str,
    correct: bool,
    rationale: str = "",
    template: str = POINTWISE_JUDGE_TEMPLATE,
    system: str = JUDGE_SYSTEM_PROMPT,
) -> JudgmentRecord:
    """A judge training record in the pool's judge format: target ``[rationale ]<answer>yes|no</answer>``."""
    verdict = "yes" if correct else "no"
    return JudgmentRecord(
        id=f"{record.id}/{response}",
        prompt=judgment_prompt(record.prompt, response, template),
        images=record.images,
        target=(f"{rationale} " if rationale else "") + f"<answer>{verdict}</answer>",
        task=record.task,
        system=system,
        metadata={**record.metadata, "candidate": response, "verdict": verdict},
    )


def make_synthetic_judgments(
    task: str, n: int, seed: int = 0, paired: bool = False, **options: Any
) -> list[JudgmentRecord]:
    """Judge records in the pool's judge format from ``data_pipelines.synthetic`` prompts of ``task``.

    ``paired``: ``n // 2`` prompts, each giving its right candidate (verdict yes) then a wrong one (no),
    side by side (train with ``data.group_size: 2``). Otherwise ``n`` prompts with the right and a wrong
    candidate alternating. Wrong candidates are drawn from the task's answer vocabulary.
    """

    rng = random.Random(f"vlrft-judge/{task}/{seed}")
    out: list[JudgmentRecord] = []
    for i, rec in enumerate(make_prompt_records(task, n // 2 if paired else n, seed, **options)):
        wrong = rng.choice([v for v in rec.metadata["vocabulary"] if v != rec.answer])
        if paired:
            out += [pointwise_judgment_record(rec, rec.answer, True), pointwise_judgment_record(rec, wrong, False)]
        else:
            out.append(pointwise_judgment_record(rec, rec.answer if i % 2 == 0 else wrong, i % 2 == 0))
    return out


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
    ):
        self.model = model
        self.processor = processor
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
        """Greedy judgments for ``(user_text, images, system)`` items (on the model's device)."""
        return generate_judgments(self.model, self.processor, items, self.max_new_tokens, micro_batch_size, synced_gpus)

    def score(
        self, items: list[tuple[str, list[Any], str, str | None]], micro_batch_size: int = 8
    ) -> tuple[torch.Tensor, list[str]]:
        """Rewards ``[N]`` and judgments for ``(prompt, images, response, system)`` items."""
        judge_items = [(judgment_prompt(p, r, self.template), ims, self.system) for p, ims, r, _ in items]
        texts = self.judge(judge_items, micro_batch_size)
        return torch.tensor([self.parser.reward(t) for t in texts], dtype=torch.float32), texts


@torch.no_grad()
def generate_judgments(
    model: Any,
    processor: Any,
    items: list[tuple[str, list[Any], str | None]],
    max_new_tokens: int = 16,
    micro_batch_size: int = 8,
    synced_gpus: bool = False,
) -> list[str]:
    """Greedy judgments for ``(user_text, images, system)`` items, through the ``hf`` rollout engine (the
    policy's generation path: sharded judges generate in lockstep with ``synced_gpus``)."""

    engine = make_engine("hf", model, processor, synced=synced_gpus, micro_batch_size=micro_batch_size)
    prompts = [
        encode_prompt(processor, PromptRecord(id=str(i), prompt=text, images=list(ims), system=system))
        for i, (text, ims, system) in enumerate(items)
    ]
    return [
        r.text for r in engine.generate(prompts, SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens))
    ]
