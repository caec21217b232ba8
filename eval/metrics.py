"""Evaluation metrics as pure functions: accuracy, unbiased pass@k, maj@k, bootstrap confidence intervals.

All take per-problem lists of per-sample values, so they work the same for n = 1 (greedy) and n > 1.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Sequence

import numpy as np

from reward_models.diagnostics import answer_spread
from vlrft.rollout.trajectories import tool_summary


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem with ``c`` correct among ``n`` samples.

    Chen et al. 2021, "Evaluating Large Language Models Trained on Code", arXiv 2107.03374, eq. 1:
    pass@k = E[1 - C(n - c, k) / C(n, k)], the probability that at least one of k samples drawn without
    replacement from the n is correct. Computed with exact integer binomials.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_correct(keys: Sequence[str | None], correct: Sequence[bool]) -> bool:
    """Whether the majority answer among ``keys`` is correct.

    Samples without an answer (key None) do not vote; with no votes at all the problem counts as wrong.
    Tie rule: among answers tied for the most votes, the one whose first vote came earliest wins (the
    order of ``collections.Counter.most_common``). All samples with one key share its correctness; the
    first of them decides.
    """
    votes = Counter(k for k in keys if k is not None)
    if not votes:
        return False
    winner = votes.most_common(1)[0][0]  # Counter keeps first-insertion order among equal counts
    return bool(correct[list(keys).index(winner)])


def maj_at_k(keys: Sequence[str | None], correct: Sequence[bool], k: int) -> bool:
    """maj@k of one problem: :func:`majority_correct` over its first ``k`` samples (in sample order)."""
    if not 1 <= k <= len(keys):
        raise ValueError(f"maj@k needs 1 <= k <= n={len(keys)}, got k={k}")
    return majority_correct(keys[:k], correct[:k])


def bootstrap_ci(
    values: Sequence[float], *, confidence: float = 0.95, num_resamples: int = 1000, seed: int = 0
) -> tuple[float, float]:
    """Percentile bootstrap confidence interval of the mean (Efron & Tibshirani 1993, ch. 13).

    Problems are resampled with replacement ``num_resamples`` times (seeded, so reproducible); the
    interval is the (1-confidence)/2 and (1+confidence)/2 quantiles of the resampled means.
    """
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return (float("nan"), float("nan"))
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(num_resamples, x.size))].mean(axis=1)
    alpha = (1.0 - confidence) / 2
    lo, hi = np.quantile(means, [alpha, 1.0 - alpha])
    return (float(lo), float(hi))


def summarize(problems: Sequence[dict[str, Any]], *, seed: int = 0) -> dict[str, Any]:
    """Benchmark metrics from scored problems (the rows of samples.jsonl).

    Each problem has ``responses``: dicts with ``correct``, ``format_ok``, ``vote_key``, ``num_chars``,
    optionally ``num_tokens`` and ``error``. Returns ``accuracy`` (mean over problems of the fraction of
    correct samples = mean pass@1) with its bootstrap ``accuracy_ci95``, ``pass@k`` and ``maj@k`` for
    every k up to the smallest n, ``format_rate``, ``mean_response_chars``/``mean_response_tokens``
    (over all responses), and ``verifier_errors`` (counts per reason).
    """
    if not problems:
        raise ValueError("no scored problems to summarize")
    ns = [len(p["responses"]) for p in problems]
    if min(ns) == 0:
        raise ValueError(f"problem {problems[ns.index(0)]['id']!r} has no responses")
    n_min = min(ns)
    per_problem = [sum(r["correct"] for r in p["responses"]) / len(p["responses"]) for p in problems]
    responses = [r for p in problems for r in p["responses"]]
    out: dict[str, Any] = {
        "num_problems": len(problems),
        "num_responses": len(responses),
        "n": n_min if n_min == max(ns) else [n_min, max(ns)],
        "accuracy": float(np.mean(per_problem)),
        "accuracy_ci95": list(bootstrap_ci(per_problem, seed=seed)),
    }
    for k in range(1, n_min + 1):
        out[f"pass@{k}"] = float(
            np.mean([pass_at_k(len(p["responses"]), sum(r["correct"] for r in p["responses"]), k) for p in problems])
        )
    for k in range(1, n_min + 1):
        out[f"maj@{k}"] = float(
            np.mean(
                [
                    maj_at_k([r["vote_key"] for r in p["responses"]], [r["correct"] for r in p["responses"]], k)
                    for p in problems
                ]
            )
        )
    out["format_rate"] = float(np.mean([bool(r["format_ok"]) for r in responses]))
    out["mean_response_chars"] = float(np.mean([r["num_chars"] for r in responses]))
    tokens = [r.get("num_tokens") for r in responses]
    out["mean_response_tokens"] = float(np.mean(tokens)) if all(t is not None for t in tokens) else None
    out["verifier_errors"] = dict(sorted(Counter(r["error"] for r in responses if r.get("error")).items()))
    if any("turns" in r for r in responses):  # multi-turn rollouts with tools
        out.update(tool_summary(responses))
    if all("extracted" in r for r in responses):  # the collapse detectors' figures of the answers given
        keys = [str(p["id"]) for p in problems for _ in p["responses"]]
        answers = [
            r["vote_key"] if r.get("vote_key") is not None else r["extracted"] for p in problems for r in p["responses"]
        ]
        golds = [p.get("answer") for p in problems for _ in p["responses"]]
        out.update(answer_spread(keys, answers, golds)[0])
    return out
