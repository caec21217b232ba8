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

The judge prompt used when the GRM scores a (prompt, response) in the reward pool is
:data:`POINTWISE_JUDGE_TEMPLATE` (configurable), with the record's images in the user turn.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
YES = ("yes", "true", "correct")
NO = ("no", "false", "incorrect")
NUMBER_RE = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
MODES = ("pointwise", "pairwise")

# The pointwise judge prompt of data_pipelines.synthetic (JUDGE_POINTWISE), so a judge trained on its
# judgment records scores pool samples with the prompt it learned on. Images go first (or at <image>).
POINTWISE_JUDGE_TEMPLATE = (
    "Question: {prompt}\nCandidate answer: {response}\n"
    "Is the candidate answer correct? Answer with <answer>yes</answer> or <answer>no</answer>."
)


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


class GenerativeRewardModel:
    """A judge (causal LM + processor) that scores responses by generating and parsing judgments."""

    def __init__(self, model: Any, processor: Any, template: str = POINTWISE_JUDGE_TEMPLATE,
                 max_new_tokens: int = 32, default: float = 0.0, score_max: float = 1.0):  # fmt: skip
        self.model = model
        self.processor = processor
        self.template = template
        self.max_new_tokens = max_new_tokens
        self.parser = JudgmentParser("pointwise", default, score_max)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype | None = None, **kwargs: Any) -> GenerativeRewardModel:
        model, processor = load_judge(path, dtype)
        return cls(model, processor, **kwargs)

    @torch.no_grad()
    def judge(self, items: list[tuple[str, list[Any], str | None]], micro_batch_size: int = 8,
              device: torch.device | str | None = None, synced_gpus: bool = False) -> list[str]:  # fmt: skip
        """Greedy judgments for ``(user_text, images, system)`` items."""
        return generate_judgments(self.model, self.processor, items, self.max_new_tokens, micro_batch_size,
                                  device, synced_gpus)  # fmt: skip

    def score(self, items: list[tuple[str, list[Any], str, str | None]], micro_batch_size: int = 8,
              device: torch.device | str | None = None) -> tuple[torch.Tensor, list[str]]:  # fmt: skip
        """Rewards ``[N]`` and judgments for ``(prompt, images, response, system)`` items."""
        judge_items = [(judgment_prompt(p, r, self.template), ims, s) for p, ims, r, s in items]
        texts = self.judge(judge_items, micro_batch_size, device)
        return torch.tensor([self.parser.reward(t) for t in texts], dtype=torch.float32), texts


def load_judge(path: str | Path, dtype: torch.dtype | None = None) -> tuple[Any, Any]:
    """A judge checkpoint: ``AutoModelForImageTextToText`` (VL) or ``AutoModelForCausalLM`` (text), + processor."""
    import vlrft.models  # noqa: F401  (image-only processors)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor

    config = AutoConfig.from_pretrained(str(path))
    is_vl = hasattr(config, "vision_config")
    auto = AutoModelForImageTextToText if is_vl else AutoModelForCausalLM
    model = auto.from_pretrained(str(path), dtype=dtype or torch.float32)
    if is_vl:
        processor = AutoProcessor.from_pretrained(str(path))
    else:
        from transformers import AutoTokenizer

        processor = AutoTokenizer.from_pretrained(str(path))
    return model, processor


@torch.no_grad()
def generate_judgments(model: Any, processor: Any, items: list[tuple[str, list[Any], str | None]],
                       max_new_tokens: int = 16, micro_batch_size: int = 8,
                       device: torch.device | str | None = None, synced_gpus: bool = False) -> list[str]:  # fmt: skip
    """Greedy generations (left-padded batches) for ``(user_text, images, system)`` items."""
    from reward_models.encoding import conversation, load_images, model_inputs, render, tokenize_texts, tokenizer_of

    tok = tokenizer_of(processor)
    device = device or next(model.parameters()).device
    was_training = model.training
    model.eval()
    out: list[str] = []
    for start in range(0, len(items), micro_batch_size):
        chunk = items[start : start + micro_batch_size]
        texts, images = [], []
        for text, ims, system in chunk:
            loaded = load_images(ims)
            texts.append(render(processor, conversation(text, loaded, None, system), add_generation_prompt=True))
            images.append(loaded)
        batch = model_inputs(tokenize_texts(processor, texts, images, padding_side="left"), device)
        gen = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), synced_gpus=synced_gpus)  # fmt: skip
        new = gen[:, batch["input_ids"].shape[1] :]
        out.extend(tok.batch_decode(new, skip_special_tokens=True))
    model.train(was_training)
    return out
