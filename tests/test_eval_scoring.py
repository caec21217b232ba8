"""Benchmark scoring on real data: GSM8K reference solutions and the ten Geometry3K examples."""

from __future__ import annotations

import pytest

from eval.benchmarks import BENCHMARKS, get_benchmark, user_benchmark
from eval.runner import score_records


@pytest.fixture(scope="module")
def gsm8k_test(shared_data):
    records = get_benchmark("gsm8k").load(shared_data / "gsm8k" / "test.jsonl")
    assert len(records) == 1319
    return records


def test_gsm8k_reference_solutions_score_100_percent(gsm8k_test):
    metrics, rows = score_records(gsm8k_test, [[r.metadata["solution"]] for r in gsm8k_test], "gsm8k")
    assert metrics["accuracy"] == 1.0 and metrics["format_rate"] == 1.0 and metrics["num_problems"] == 1319
    assert rows[0]["responses"][0]["extracted"] == "18"


def test_gsm8k_solutions_of_the_wrong_problem_score_under_1_percent(gsm8k_test):
    golds = [r.answer for r in gsm8k_test]
    # shifted by one: only the 15 neighbours that share their gold number are (rightly) accepted
    shifted = [[gsm8k_test[(i + 1) % 1319].metadata["solution"]] for i in range(1319)]
    metrics, rows = score_records(gsm8k_test, shifted, "gsm8k")
    same_gold = [golds[i] == golds[(i + 1) % 1319] for i in range(1319)]
    assert [row["num_correct"] == 1 for row in rows] == same_gold
    assert sum(same_gold) == 15 and metrics["accuracy"] == pytest.approx(15 / 1319)
    # shifted to the next problem with another gold: a wrong problem's solution is never accepted
    wrong = [
        next(gsm8k_test[(i + j) % 1319] for j in range(1, 1319) if golds[(i + j) % 1319] != golds[i])
        for i in range(1319)
    ]
    metrics, _ = score_records(gsm8k_test, [[w.metadata["solution"]] for w in wrong], "gsm8k")
    assert metrics["accuracy"] == 0.0 < 0.01


def test_gsm8k_flexible_accepts_unmarked_final_numbers(gsm8k_test):
    records = gsm8k_test[:20]
    responses = [[f"So the answer is {r.answer}."] for r in records]
    strict, _ = score_records(records, responses, "gsm8k")
    flexible, _ = score_records(records, responses, "gsm8k_flexible")
    assert strict["accuracy"] == 0.0 and flexible["accuracy"] == 1.0 and flexible["format_rate"] == 0.0


@pytest.fixture(scope="module")
def geo3k(shared_data):
    records = get_benchmark("geo3k").load(shared_data / "geo3k_examples", split="train")
    assert len(records) == 10 and all(len(r.images) == 1 for r in records)
    return records


def test_geo3k_right_choice_in_boxed_scores_100_and_wrong_choices_0(geo3k):
    right = [[f"<think>reasoning</think> The answer is \\boxed{{{r.answer}}}."] for r in geo3k]
    metrics, _ = score_records(geo3k, right, "geo3k")
    assert metrics["accuracy"] == 1.0 and metrics["format_rate"] == 1.0
    for wrong_index in range(3):  # each of the three wrong choices, in turn
        wrong = [
            [f"<think>r</think> \\boxed{{{[c for c in r.metadata['choices'] if c.strip() != r.answer][wrong_index]}}}"]
            for r in geo3k
        ]
        metrics, _ = score_records(geo3k, wrong, "geo3k")
        assert metrics["accuracy"] == 0.0, wrong_index


def test_geo3k_equivalent_forms_of_the_right_choice(geo3k):
    by_answer = {r.answer: r for r in geo3k}
    cases = [
        ("5 \\sqrt { 3 }", "5\\sqrt{3}"),
        ("\\frac { 2 \\sqrt { 2 } } { 5 }", "\\frac{2\\sqrt2}{5}"),
        ("13", "13.0"),
        ("120", "120^\\circ"),
    ]
    recs = [by_answer[a] for a, _ in cases]
    metrics, _ = score_records(recs, [[f"\\boxed{{{form}}}"] for _, form in cases], "geo3k")
    assert metrics["accuracy"] == 1.0


def test_geo3k_multiple_choice_mode(shared_data):
    records = get_benchmark("geo3k_mc").load(shared_data / "geo3k_examples", split="train")
    assert "Choices:\nA. 30\nB. 40\nC. 60\nD. 80" in records[0].prompt and records[0].answer == "D"
    metrics, _ = score_records(records, [[f"<think>r</think> \\boxed{{{r.answer}}}"] for r in records], "geo3k_mc")
    assert metrics["accuracy"] == 1.0
    wrong = [[f"\\boxed{{{'ABCD'[('ABCD'.index(r.answer) + 1) % 4]}}}"] for r in records]
    assert score_records(records, wrong, "geo3k_mc")[0]["accuracy"] == 0.0
    texts = [[f"\\boxed{{{r.metadata['free_form_answer']}}}"] for r in records]  # the choice's text also names it
    assert score_records(records, texts, "geo3k_mc")[0]["accuracy"] == 1.0


def test_benchmark_registry_and_user_benchmarks():
    assert {"gsm8k", "gsm8k_flexible", "geo3k", "geo3k_mc"} <= set(BENCHMARKS)
    for b in BENCHMARKS.values():
        assert b.source and b.verifier and b.description
    mine = get_benchmark("colors", verifier="exact_match")
    assert mine.verifier == "exact_match" and mine.prompt_template == "plain"
    with pytest.raises(ValueError, match="also name a verifier"):
        get_benchmark("colors")
    with pytest.raises(ValueError, match="unknown verifier"):
        user_benchmark("colors", "nope")
