"""Evaluation metrics: pass@k against its closed form and brute force, maj@k ties, bootstrap, evaluate modules."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest

from eval.metrics import bootstrap_ci, maj_at_k, majority_correct, pass_at_k, summarize

HF_METRICS = Path(__file__).resolve().parents[1] / "eval" / "hf_metrics"


@pytest.mark.parametrize(
    "n,c,k,want",
    [
        (5, 2, 1, 0.4),
        (5, 2, 2, 1 - 3 / 10),
        (5, 2, 3, 1 - 1 / 10),
        (5, 2, 4, 1.0),
        (5, 0, 3, 0.0),
        (5, 5, 1, 1.0),
        (1, 1, 1, 1.0),
        (1, 0, 1, 0.0),
        (10, 3, 5, 1 - 21 / 252),
        (4, 1, 2, 0.5),
    ],
)
def test_pass_at_k_hand_computed(n, c, k, want):
    assert pass_at_k(n, c, k) == pytest.approx(want, abs=1e-15)


def test_pass_at_k_equals_chen_closed_form_and_brute_force():
    for n in range(1, 9):
        for c in range(0, n + 1):
            for k in range(1, n + 1):
                closed = (
                    1.0 if n - c < k else 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))
                )
                samples = [1] * c + [0] * (n - c)  # the definition: P(some of k drawn without replacement is right)
                subsets = list(itertools.combinations(range(n), k))
                brute = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
                got = pass_at_k(n, c, k)
                assert got == pytest.approx(closed, abs=1e-12) and got == pytest.approx(brute, abs=1e-12), (n, c, k)
    assert pass_at_k(200, 13, 100) == pytest.approx(1 - math.comb(187, 100) / math.comb(200, 100), rel=1e-12)
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


def test_majority_vote_tie_rule_first_voted_answer_wins():
    assert majority_correct(["3", "5", "5", "3"], [True, False, False, True]) is True  # 2-2 tie, "3" voted first
    assert majority_correct(["5", "3", "3", "5"], [False, True, True, False]) is False  # 2-2 tie, "5" voted first
    assert majority_correct(["5", "3", "3"], [False, True, True]) is True  # clear majority
    assert majority_correct([None, None, "5"], [False, False, True]) is True  # no-answer samples do not vote
    assert majority_correct([None, None], [False, False]) is False  # no votes: wrong
    assert majority_correct(["7", "8", "9"], [False, False, True]) is False  # 1-1-1 tie: the first
    keys, correct = ["3", "5", "5", "3", "3"], [True, False, False, True, True]
    assert [maj_at_k(keys, correct, k) for k in range(1, 6)] == [True, True, False, True, True]
    with pytest.raises(ValueError):
        maj_at_k(keys, correct, 6)


def _row(pid, flags, keys=None, fmt=None):
    keys = keys or [str(int(f)) for f in flags]
    fmt = fmt or [True] * len(flags)
    return {
        "id": pid,
        "responses": [
            {"correct": f, "format_ok": o, "vote_key": k, "num_chars": 10 * (i + 1), "num_tokens": i + 1}
            for i, (f, k, o) in enumerate(zip(flags, keys, fmt))
        ],
    }


def test_summarize_hand_computed():
    rows = [
        _row("a", [True, False, False, True], ["4", "5", "5", "4"]),  # c=2 of 4, tie 2-2 -> "4" (right)
        _row("b", [False, False, False, False], ["1", "2", "2", None], fmt=[True, False, True, False]),
        _row("c", [True, True, True, False], ["9", "9", "9", "8"]),
    ]
    m = summarize(rows)
    assert m["num_problems"] == 3 and m["n"] == 4 and m["num_responses"] == 12
    assert m["accuracy"] == pytest.approx((0.5 + 0 + 0.75) / 3)
    assert m["pass@1"] == pytest.approx(m["accuracy"])
    assert m["pass@2"] == pytest.approx((1 - 1 / 6 + 0 + 1) / 3)
    assert m["pass@4"] == pytest.approx(2 / 3)
    assert m["maj@1"] == pytest.approx(2 / 3) and m["maj@4"] == pytest.approx(2 / 3)
    assert m["maj@3"] == pytest.approx(1 / 3)  # a: 4,5,5 -> "5" wrong; c: 9,9,9 right
    assert m["format_rate"] == pytest.approx(10 / 12)
    assert m["mean_response_chars"] == 25.0 and m["mean_response_tokens"] == 2.5
    assert m["verifier_errors"] == {}
    lo, hi = m["accuracy_ci95"]
    assert lo <= m["accuracy"] <= hi


def test_bootstrap_ci_is_seeded_and_has_the_normal_width():
    x = np.r_[np.ones(200), np.zeros(200)]
    a, b = bootstrap_ci(x, seed=3), bootstrap_ci(x, seed=3)
    assert a == b
    width = a[1] - a[0]
    assert width == pytest.approx(2 * 1.96 * math.sqrt(0.25 / 400), abs=0.015)
    assert bootstrap_ci([0.7] * 10) == pytest.approx((0.7, 0.7))


def test_metrics_as_evaluate_modules_loaded_from_a_local_path():
    import evaluate

    pass_k = evaluate.load(str(HF_METRICS / "pass_at_k"))
    out = pass_k.compute(predictions=[[1, 0, 0, 1, 0], [0, 0, 0, 0, 0]])
    assert out["pass@1"] == pytest.approx(0.2) and out["pass@2"] == pytest.approx(0.35) and out["pass@5"] == 0.5
    assert pass_k.compute(predictions=[[1, 0], [1, 1]], k=2) == {"pass@2": 1.0}

    maj = evaluate.load(str(HF_METRICS / "maj_at_k"))
    out = maj.compute(predictions=[["Red", "blue", "red"], ["blue", "green", ""]], references=["red", "green"])
    assert out == {"maj@1": 0.5, "maj@2": 0.5, "maj@3": 0.5}  # 2nd: blue/green tie -> blue (first) wrong

    rv = evaluate.load(str(HF_METRICS / "rule_verifier"))
    out = rv.compute(
        predictions=[["#### 18", "#### 17"], ["#### 3", "#### 3"]], references=["18", "3"], verifier="gsm8k"
    )
    assert out["accuracy"] == 0.75 and out["pass@2"] == 1.0 and out["maj@2"] == 1.0 and out["format_rate"] == 1.0
