"""Judge verdicts as plain text functions: reading them, turning them into preferences, position bias, win rates.

The judgment format (what judges are trained to write; ``reward_models.generative`` documents the pointwise
side): free reasoning, if any, then the verdict in the LAST ``<answer>...</answer>`` tag.

- pointwise: ``yes``/``no`` (``true``/``correct``, ``false``/``incorrect`` read the same), or a number.
- pairwise (shown two responses, "Response A" and "Response B": ``PAIRWISE_JUDGE_TEMPLATE`` and
  ``PAIRWISE_JUDGE_SYSTEM_PROMPT`` of ``data_pipelines.formatting``): ``A``, ``B`` or ``tie`` (``equal``
  and ``same`` read as tie), case and surrounding spaces ignored.

Parsing is tolerant and time-limited: text longer than :data:`MAX_JUDGMENT_CHARS` is not read (no verdict),
and otherwise only two linear regular expressions run over it; model text is never evaluated as code.
With ``tolerant=True`` (the judge-RL verifiers), a response without a tag gives the first word that is a
verdict word (so a judge that answers a bare ``B`` is read; ``format_ok`` tells the two apart).

A pairwise verdict becomes the *preference for the first response*: ``A`` -> 1, ``B`` -> 0, ``tie`` -> 0.5
(and unparsable -> 0.5, counted). Every reward model kind is evaluated through such a preference: an SRM
or pointwise GRM gives ``1/0/0.5`` from the sign of ``score(first) - score(second)``.
"""

from __future__ import annotations

import re
from typing import Sequence

MAX_JUDGMENT_CHARS = 20_000
ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL | re.IGNORECASE)
WORD_RE = re.compile(r"[A-Za-z]+")
YES = ("yes", "true", "correct")
NO = ("no", "false", "incorrect")
TIE = ("tie", "equal", "same")
MODES = ("pointwise", "pairwise")


def extract_answer(judgment: str) -> str | None:
    """Content of the last ``<answer>...</answer>`` tag, stripped; ``None`` without one (or if too long)."""
    if len(judgment) > MAX_JUDGMENT_CHARS:
        return None
    found = ANSWER_RE.findall(judgment)
    return found[-1].strip() if found else None


def _verdict_word(word: str, mode: str) -> str | None:
    w = word.strip().lower()
    if mode == "pairwise":
        return "A" if w == "a" else "B" if w == "b" else "tie" if w in TIE else None
    return "yes" if w in YES else "no" if w in NO else None


def read_verdict(judgment: str, mode: str = "pairwise", tolerant: bool = False) -> tuple[str | None, bool]:
    """``(verdict, tagged)``: ``A``/``B``/``tie`` (pairwise) or ``yes``/``no`` (pointwise) from the last
    ``<answer>`` tag (``tagged`` True); with ``tolerant``, else the first verdict word of the text."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    answer = extract_answer(judgment)
    if answer is not None:
        return _verdict_word(answer, mode), True
    if tolerant and len(judgment) <= MAX_JUDGMENT_CHARS:
        for word in WORD_RE.findall(judgment):
            verdict = _verdict_word(word, mode)
            if verdict is not None:
                return verdict, False
    return None, False


def preference(verdict: str | None) -> float:
    """Preference for the first response (A) of a pairwise verdict: A 1, B 0, tie or none 0.5."""
    return 1.0 if verdict == "A" else 0.0 if verdict == "B" else 0.5


def score_preference(first: float, second: float) -> float:
    """Preference for the first of two scored responses (SRM rewards, pointwise GRM scores): 1, 0 or 0.5."""
    return 1.0 if first > second else 0.0 if first < second else 0.5


def swap_debiased(pref_ab: Sequence[float], pref_ba: Sequence[float]) -> list[float]:
    """``debias: swap``: the mean of the preference for the first response asked in order (A = first) and
    asked swapped (A = second, so its preference for the first is ``1 - pref_ba``)."""
    return [(p + 1.0 - q) / 2 for p, q in zip(pref_ab, pref_ba)]


def position_bias(pref_ab: Sequence[float], pref_ba: Sequence[float], first_better: Sequence[bool]) -> dict[str, float]:
    """Position-bias figures of a pairwise judge that saw every pair in both orders.

    ``pref_ab[i]``: preference for response 1 shown as A; ``pref_ba[i]``: preference for A when response 2
    was shown as A. ``first_better[i]``: response 1 is the better one. Returns
    ``consistency`` (share of pairs whose decided verdicts agree across orders: A then B, or B then A),
    ``accuracy_order_ab``/``accuracy_order_ba`` (right verdicts in each order; tie/none counts wrong),
    ``accuracy_swap`` (the swap-debiased preference on the right side of 1/2), and ``first_position_rate``
    (share of decided verdicts, over both orders, that chose A: 0.5 for a judge without position bias).
    """
    n = len(pref_ab)
    if not n or len(pref_ba) != n or len(first_better) != n:
        raise ValueError(f"need equal, non-empty lists, got {len(pref_ab)}, {len(pref_ba)}, {len(first_better)}")
    consistent = sum(1 for p, q in zip(pref_ab, pref_ba) if (p, q) in ((1.0, 0.0), (0.0, 1.0)))
    right_ab = sum(1 for p, f in zip(pref_ab, first_better) if p == (1.0 if f else 0.0))
    right_ba = sum(1 for q, f in zip(pref_ba, first_better) if q == (0.0 if f else 1.0))
    swap = swap_debiased(pref_ab, pref_ba)
    right_swap = sum(1 for s, f in zip(swap, first_better) if (s > 0.5 if f else s < 0.5))
    decided = [p for p in list(pref_ab) + list(pref_ba) if p != 0.5]
    return {
        "consistency": consistent / n,
        "accuracy_order_ab": right_ab / n,
        "accuracy_order_ba": right_ba / n,
        "accuracy_swap": right_swap / n,
        "first_position_rate": sum(1 for p in decided if p == 1.0) / len(decided) if decided else float("nan"),
    }


def win_rates(n: int, comparisons: dict[tuple[int, int], float]) -> list[float]:
    """Per-sample scores of a group of ``n`` from pairwise comparisons: ``comparisons[(i, j)]`` is the
    preference for ``i`` over ``j`` (1 win, 0 loss, 0.5 tie). Sample ``i`` scores the mean of its
    preferences over the pairs it is in (a pair given in both orders counts both: the swap-debiased
    mean); a sample in no pair scores 0.5."""
    wins = [0.0] * n
    counts = [0] * n
    for (i, j), p in comparisons.items():
        wins[i] += p
        wins[j] += 1.0 - p
        counts[i] += 1
        counts[j] += 1
    return [w / c if c else 0.5 for w, c in zip(wins, counts)]
