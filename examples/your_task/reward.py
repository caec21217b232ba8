"""This example's reward, written as a user would: no import from vlrft.

``score`` is what the config uses (``signature: sample``, the default): it gets one
``reward_models.samples.Sample`` (``sample.response``, ``sample.answer``, ``sample.metadata``, ...) and returns a
number, or a dict with ``score`` and other numbers that are logged as metrics. ``trl_score`` and
``compute_score`` are the same reward written for TRL (``reward_funcs``) and verl (``compute_score``); with
``signature: trl`` / ``signature: verl`` they give identical rewards (tests/test_your_task.py checks it).
"""

from __future__ import annotations

import re


def answer_word(response: str, vocabulary: list[str]) -> str | None:
    """The answer, when the whole response is one of the possible answers (case and surrounding punctuation
    ignored), else None. Strict on purpose: a reward that took the first answer word found anywhere would pay
    junk that names every answer (``"red blue green yellow"``), and RL learns exactly that."""
    words = re.findall(r"[a-z]+", response.lower())
    bare = re.sub(r"[^a-z]", "", response.lower())
    return words[0] if len(words) == 1 and bare == words[0] and words[0] in vocabulary else None


def score(sample) -> dict:
    """1 when the response is the right answer; ``named``: whether it is one of the possible answers."""
    said = answer_word(sample.response, sample.metadata["vocabulary"])
    return {"score": float(said == sample.answer), "named": float(said is not None)}


def trl_score(prompts, completions, answer, vocabulary, **kwargs) -> list[float]:
    """``score`` as a TRL reward function: columns of the dataset arrive as keyword lists."""
    return [float(answer_word(c, v) == a) for c, a, v in zip(completions, answer, vocabulary)]


def compute_score(data_source, solution_str, ground_truth, extra_info=None) -> float:
    """``score`` as a verl reward function."""
    return float(answer_word(solution_str, extra_info["vocabulary"]) == ground_truth)
