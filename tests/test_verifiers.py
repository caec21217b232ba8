"""Rule verifiers: tables of right, wrong and missing answers per verifier; hostile inputs within limits."""

from __future__ import annotations

import json
import threading
import time

import pytest

from reward_models import math_worker
from reward_models.verifiers import VERIFIERS, VerifierResult, get_verifier

# (response, answer, correct, extracted) ---------------------------------------------------------------
GSM8K = [
    ("so she makes 18 dollars.\n#### 18", "18", True, "18"),
    ("#### 1,000", "1000", True, "1,000"),
    ("#### 1000", "#### 1,000", True, "1000"),
    ("#### $18", "18", True, "18"),
    ("#### \\$18", "18", True, "18"),
    ("#### 18.00", "18", True, "18.00"),
    ("#### -3", "-3", True, "-3"),
    ("#### 3", "-3", False, "3"),
    ("#### 0.5", ".5", True, "0.5"),
    ("####18", "18", True, "18"),
    ("#### 17", "18", False, "17"),
    ("#### 5\n#### 18", "18", True, "18"),
    ("#### 18\n#### 5", "18", False, "5"),
    ("the answer is \\boxed{18}", "18", True, "18"),
    ("\\boxed{\\$1,234}", "1234", True, "\\$1,234"),
    ("\\boxed{18 \\text{ dollars}}", "18", False, "18 \\text{ dollars}"),
    ("\\boxed{50\\%}", "50", True, "50\\%"),
    ("\\boxed{17}", "18", False, "17"),
    ("\\boxed{18} then #### 17", "18", False, "17"),
    ("#### 18 then \\boxed{17}", "18", True, "18"),
    ("The answer is 18.", "18", False, None),  # strict mode: no marker, no answer
    ("no number here", "18", False, None),
    ("", "18", False, None),
    ("#### eighteen", "18", False, None),
    ("#### 2,125", "2125", True, "2,125"),
    ("#### 70000", "#### 70000", True, "70000"),
    ("#### 70,000", "70000", True, "70,000"),
    ("#### 7.", "7", True, "7"),
    ("#### 1e5", "100000", False, "1"),
    ("#### " + "9" * 100, "9", False, "9" * 100),
    ("#### 3/4", "0.75", False, "3"),
    ("#### 12 apples", "12", True, "12"),
    ("#### 0", "0", True, "0"),
    ("#### 00", "0", True, "00"),
    ("\\boxed{}", "0", False, ""),
    ("\\boxed{18", "18", False, None),
    ("\\boxed 18", "18", True, "18"),
    ("\\fbox{18}", "18", True, "18"),
    ("<think>2+2=4</think> #### 4", "4", True, "4"),
    ("#### 1,234,567", "1234567", True, "1,234,567"),
]
GSM8K_FLEXIBLE = [  # flexible mode: same as strict where a marker exists, else the last number
    ("The answer is 18.", "18", True, "18"),
    ("She has 3 apples and 18 pears", "18", True, "18"),
    ("She has 18 apples and 3 pears", "18", False, "3"),
    ("costs $1,000 in total", "1000", True, "1,000"),
    ("no number here", "18", False, None),
    ("#### 18 and then 17", "18", True, "18"),
] + [row for row in GSM8K if row[3] is not None]

MATH = [  # (response, gold, correct, extracted)
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", True, "\\frac{1}{2}"),
    ("\\boxed{0.5}", "\\frac{1}{2}", True, "0.5"),
    ("\\boxed{\\dfrac{1}{2}}", "0.5", True, "\\dfrac{1}{2}"),
    ("\\boxed{1/2}", "\\frac12", True, "1/2"),
    ("\\boxed{50\\%}", "0.5", True, "50\\%"),
    ("\\boxed{\\sqrt{2}}", "\\sqrt{2}", True, "\\sqrt{2}"),
    ("\\boxed{2^{1/2}}", "\\sqrt{2}", True, "2^{1/2}"),
    ("\\boxed{\\sqrt{3}}", "\\sqrt{2}", False, "\\sqrt{3}"),
    ("\\boxed{2\\pi}", "2\\pi", True, "2\\pi"),
    ("\\boxed{2 \\pi}", "2\\pi", True, "2 \\pi"),
    ("\\boxed{\\pi}", "2\\pi", False, "\\pi"),
    ("\\boxed{5\\sqrt{3}}", "5 \\sqrt { 3 }", True, "5\\sqrt{3}"),
    ("\\boxed{5\\sqrt{2}}", "5 \\sqrt { 3 }", False, "5\\sqrt{2}"),
    ("\\boxed{\\frac{2\\sqrt{2}}{5}}", "\\frac { 2 \\sqrt { 2 } } { 5 }", True, "\\frac{2\\sqrt{2}}{5}"),
    ("\\boxed{\\frac{\\sqrt{2}}{5}}", "\\frac { 2 \\sqrt { 2 } } { 5 }", False, "\\frac{\\sqrt{2}}{5}"),
    ("\\boxed{13.5}", "13.5", True, "13.5"),
    ("\\boxed{27/2}", "13.5", True, "27/2"),
    ("\\boxed{120}", "120", True, "120"),
    ("\\boxed{120^\\circ}", "120", True, "120^\\circ"),
    ("\\boxed{60}", "120", False, "60"),
    ("\\boxed{x = 3}", "3", True, "x = 3"),
    ("\\boxed{3}", "x=3", True, "3"),
    ("\\boxed{1,000}", "1000", True, "1,000"),
    ("\\boxed{-2}", "-2", True, "-2"),
    ("\\boxed{2}", "-2", False, "2"),
    ("\\boxed{\\frac{a+b}{2}}", "\\frac{b+a}{2}", True, "\\frac{a+b}{2}"),
    ("\\boxed{(1, 2)}", "(1,2)", True, "(1, 2)"),
    ("\\boxed{(2, 1)}", "(1,2)", False, "(2, 1)"),
    ("\\boxed{\\{1,2\\}}", "\\{2,1\\}", True, "\\{1,2\\}"),
    ("\\boxed{x^2+2x+1}", "(x+1)^2", True, "x^2+2x+1"),
    ("\\boxed{x^2+1}", "(x+1)^2", False, "x^2+1"),
    ("\\boxed{\\text{red}}", "red", True, "\\text{red}"),
    ("first \\boxed{1} then \\boxed{\\frac{1}{2}}", "0.5", True, "\\frac{1}{2}"),
    ("first \\boxed{\\frac{1}{2}} then \\boxed{1}", "0.5", False, "1"),
    ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{\\sqrt{2}}{2}", True, "\\frac{1}{\\sqrt{2}}"),
    ("<think>...</think> The answer is $\\boxed{7}$.", "7", True, "7"),
    ("The answer is 7.", "7", False, None),
    ("no answer", "7", False, None),
    ("", "7", False, None),
    ("\\boxed{7", "7", False, None),
    ("\\boxed{}", "7", False, ""),
    ("\\boxed{\\infty}", "\\infty", True, "\\infty"),
    ("\\boxed{8}", "\\boxed{8}", True, "8"),
]

LETTERS = [  # (response, gold, correct, extracted, metadata)
    ("\\boxed{C}", "C", True, "C", {}),
    ("\\boxed{(C)}", "C", True, "C", {}),
    ("\\boxed{C.}", "C", True, "C", {}),
    ("\\boxed{\\text{C}}", "C", True, "C", {}),
    ("\\boxed{c}", "C", True, "C", {}),
    ("\\boxed{B}", "C", False, "B", {}),
    ("\\boxed{E}", "C", False, None, {}),
    ("\\boxed{E}", "E", True, "E", {"choices": ["1", "2", "3", "4", "5"]}),
    ("The answer is (C).", "C", True, "C", {}),
    ("The answer is C", "C", True, "C", {}),
    ("Answer: C", "C", True, "C", {}),
    ("answer: (D)", "D", True, "D", {}),
    ("The answer is D.", "C", False, "D", {}),
    ("I think (A) is wrong, (C) is right", "C", False, None, {}),  # strict: two letters named, no answer
    ("(C) ... (A)", "C", False, None, {}),
    ("(A) (B) (C) (D)", "C", False, None, {}),  # every option: no answer
    ("C", "C", True, "C", {}),  # the whole response is a letter
    ("<answer>C</answer>", "C", True, "C", {}),
    ("<answer>(B)</answer> \\boxed{C}", "C", False, "B", {}),  # the <answer> span is read first
    ("no letter here", "C", False, None, {}),
    ("", "C", False, None, {}),
    ("the answer is a number", "A", False, None, {}),
    ("\\boxed{5\\sqrt{3}}", "C", True, "C", {"choices": ["5", "5 \\sqrt { 2 }", "5 \\sqrt { 3 }", "10"]}),
    ("\\boxed{5\\sqrt{2}}", "C", False, "B", {"choices": ["5", "5 \\sqrt { 2 }", "5 \\sqrt { 3 }", "10"]}),
    ("\\boxed{7}", "C", False, None, {"choices": ["5", "6", "8", "10"]}),
    ("\\boxed{C}", "8", True, "C", {"choices": ["5", "6", "8", "10"]}),
    ("\\boxed{D}", "13.5", True, "D", {"choices": ["8", "10", "12", "13.5"]}),
    ("\\boxed{13.5}", "13.5", True, "D", {"choices": ["8", "10", "12", "13.5"]}),
    ("\\boxed{C}", "13.5", False, "C", {"choices": ["8", "10", "12", "13.5"]}),
    ("\\boxed{A} then \\boxed{C}", "C", True, "C", {}),
    ("\\boxed{C} then \\boxed{A}", "C", False, "A", {}),
    ("\\boxed{AB}", "A", False, None, {}),
    ("<think>B or C</think> \\boxed{C}", "C", True, "C", {}),
    ("(c)", "C", True, "C", {}),  # the whole response, any case
    ("see (c) below", "C", False, None, {}),  # unboxed letters in prose must be upper case
    ("\\boxed{D}", "d", True, "D", {}),
    ("\\boxed{A}", "(A)", True, "A", {}),
    ("\\boxed{ B }", "B", True, "B", {}),
]
LETTERS += [(f"\\boxed{{{x}}}", y, x == y, x, {}) for x in "ABCD" for y in "ABD"]  # 12 more

FORMAT = [  # (response, ok)
    ("<think>reasoning</think> \\boxed{3}", True),
    ("<think>r</think>\\boxed{3}", True),
    ("  <think>\nlong\nreasoning\n</think>\nSo \\boxed{\\frac{1}{2}}.", True),
    ("<think>r</think> the answer is 3", False),
    ("<think></think> \\boxed{3}", False),
    ("<think>   </think> \\boxed{3}", False),
    ("\\boxed{3}", False),
    ("reasoning</think> \\boxed{3}", False),
    ("<think>reasoning \\boxed{3}", False),
    ("\\boxed{3} <think>r</think>", False),
    ("<think>r \\boxed{3}</think>", False),
    ("text <think>r</think> \\boxed{3}", False),
    ("<think>a</think><think>b</think> \\boxed{3}", False),
    ("<think>r</think> \\boxed{3", False),
    ("", False),
    ("<think>r</think> \\boxed{}", True),
    ("<think>r</think> \\fbox{3}", True),
    ("</think><think>r \\boxed{3}", False),
]
FORMAT += [(f"<think>step {i}</think> \\boxed{{{i}}}", True) for i in range(12)]
FORMAT += [(f"<think>step {i}</think> answer {i}", False) for i in range(12)]

LENGTH = (
    [  # (length, score) with max_length=100, cache_length=20
        (0, 0.0),
        (50, 0.0),
        (79, 0.0),
        (80, 0.0),
        (81, -0.05),
        (90, -0.5),
        (99, -0.95),
        (100, -1.0),
        (101, -1.0),
        (1000, -1.0),
    ]
    + [(80 + i, -i / 20) for i in range(0, 21)]
    + [(100 + i, -1.0) for i in range(1, 11)]
)

EXACT = [  # (response, gold, correct)
    ("red", "red", True),
    ("Red", "red", True),
    ("RED.", "red", True),
    ("  red  ", "red", True),
    ("red!", "red", True),
    ("\\boxed{red}", "red", True),
    ("\\boxed{\\text{Red}}", "red", True),
    ("<think>it is blue or red</think> red", "red", True),
    ("<think>red</think> blue", "red", False),
    ("blue", "red", False),
    ("reddish", "red", False),
    ("red blue", "red", False),
    ("", "red", False),
    ("dark red", "dark red", True),
    ("dark  red", "dark red", True),
    ("Dark-red", "dark red", True),
    ("darkred", "dark red", False),
    ("\\boxed{blue} red", "red", False),
    ("\\boxed{red} blue", "red", True),
    ("3", "3", True),
    ("3.", "3", True),
    ("three", "3", False),
    ("yes", "Yes", True),
    ("no", "yes", False),
    ("'red'", "red", True),
    ('"red"', "red", True),
    ("(red)", "red", True),
    ("red\n", "red", True),
    ("a circle", "circle", False),
    ("circle", "a circle", False),
    ("CIRCLE", "circle", True),
    ("square", "circle", False),
    ("<think></think>green", "green", True),
    ("green</think>", "green", False),
    ("\\boxed{}", "red", False),
    ("!!!", "red", False),
    ("r e d", "red", False),
    ("red,", "red", True),
    ("\\boxed{ red }", "red", True),
    ("\\boxed{purple}", "Purple", True),
]


def test_registry_names_and_result_fields():
    assert {
        "gsm8k",
        "gsm8k_flexible",
        "math_boxed",
        "multiple_choice",
        "format",
        "length_penalty",
        "exact_match",
    } <= set(VERIFIERS)
    for name, v in VERIFIERS.items():
        assert v.name == name and get_verifier(name) is v
    with pytest.raises(KeyError, match="unknown verifier 'nope'"):
        get_verifier("nope")
    r = get_verifier("gsm8k")("#### 3", "3")
    assert isinstance(r, VerifierResult) and (r.score, r.extracted, r.correct, r.format_ok, r.error) == (
        1.0,
        "3",
        True,
        True,
        None,
    )


def _check(name, table, **opts):
    v = get_verifier(name, **opts) if opts else get_verifier(name)
    assert len(table) >= 40, f"{name}: only {len(table)} cases"
    bad = []
    for response, gold, correct, extracted, *meta in table:
        r = v(response, gold, **(meta[0] if meta else {}))
        if r.correct != correct or r.score != float(correct) or r.extracted != extracted:
            bad.append((response, gold, correct, extracted, r))
    assert not bad, "\n".join(map(repr, bad))


def test_gsm8k_table():
    _check("gsm8k", GSM8K)
    v = get_verifier("gsm8k")
    assert v("#### 17", "1").format_ok and v("\\boxed{17}", "1").format_ok and not v("It is 18.", "1").format_ok


def test_gsm8k_flexible_table():
    _check("gsm8k_flexible", GSM8K_FLEXIBLE)
    r = get_verifier("gsm8k_flexible")("The answer is 18.", "18")
    assert r.correct and not r.format_ok  # found by the fallback, not by the answer format


def test_gsm8k_golds_from_the_real_test_set(shared_data):
    rows = [json.loads(line) for line in (shared_data / "gsm8k" / "test.jsonl").read_text().splitlines()[:50]]
    v = get_verifier("gsm8k")
    table = []
    for i, row in enumerate(rows):
        gold = row["answer"].split("####")[-1].strip()
        table.append((f"reasoning...\n#### {gold}", row["answer"], True, gold))  # full solution as reference
        table.append((f"\\boxed{{{gold}}}", gold, True, gold))
        other = rows[(i + 1) % len(rows)]["answer"].split("####")[-1].strip()
        if other.replace(",", "") != gold.replace(",", ""):
            table.append((f"#### {other}", row["answer"], False, other))
    _check("gsm8k", table)
    assert v("#### 18", rows[0]["answer"]).correct  # Janet's ducks


def test_gsm8k_bad_reference_is_an_error_not_a_zero():
    with pytest.raises(ValueError, match="not a number"):
        get_verifier("gsm8k")("#### 3", "three")
    with pytest.raises(ValueError, match="needs a reference answer"):
        get_verifier("gsm8k")("#### 3", None)
    for name in ("math_boxed", "exact_match", "multiple_choice"):
        with pytest.raises(ValueError, match="needs a reference answer"):
            get_verifier(name)("\\boxed{}", "  ")


def test_math_boxed_table():
    math_worker.prestart()
    _check("math_boxed", MATH)


LENIENT_LETTERS = {  # lenient=True reads the last letter named, where strict reads none
    "I think (A) is wrong, (C) is right": ("C", True),
    "(C) ... (A)": ("A", False),
    "(A) (B) (C) (D)": ("D", False),
}


def test_multiple_choice_table():
    _check("multiple_choice", LETTERS)
    lenient = [
        (r, g, *LENIENT_LETTERS[r][::-1], *m) if r in LENIENT_LETTERS else (r, g, c, e, *m)
        for r, g, c, e, *m in LETTERS
    ]
    _check("multiple_choice", lenient, lenient=True)
    with pytest.raises(ValueError, match="not one of the letters"):
        get_verifier("multiple_choice")("\\boxed{A}", "Z")
    with pytest.raises(ValueError, match="not one of the letters"):
        get_verifier("multiple_choice")("\\boxed{A}", "14", choices=["8", "10", "12", "13.5"])


def test_format_table():
    v = get_verifier("format")
    assert len(FORMAT) >= 40
    bad = [(resp, ok) for resp, ok in FORMAT if (v(resp, None).score, v(resp, None).format_ok) != (float(ok), ok)]
    assert not bad, bad


def test_length_penalty_table_follows_dapo_eq13():
    v = get_verifier("length_penalty", max_length=100, cache_length=20)
    assert len(LENGTH) >= 40
    for length, want in LENGTH:
        by_meta = v("x", None, response_length=length).score
        by_chars = v("x" * length, None).score
        assert by_meta == pytest.approx(want, abs=1e-12) and by_chars == pytest.approx(want, abs=1e-12), length
    with pytest.raises(ValueError, match="cache_length"):
        get_verifier("length_penalty", max_length=10, cache_length=20)


def test_exact_match_table():
    v = get_verifier("exact_match")
    assert len(EXACT) >= 40
    bad = [(r, g, c) for r, g, c in EXACT if v(r, g).correct != c or v(r, g).score != float(c)]
    assert not bad, bad


MARKER = "VLRFT_PWNED"


def _hostile(marker):
    code = f"__import__('os').system('touch {marker}')"
    return [
        code,
        f"#### {code}",
        f"\\boxed{{{code}}}",
        f"<think>{code}</think> \\boxed{{{code}}}",
        f"\\boxed{{exec(\"open('{marker}','w')\")}}",
        f'\\boxed{{eval(\'__import__("os").system("touch {marker}")\')}}',
        "\\boxed{10^{10^{10}}}",
        "\\boxed{9^{9^{9^{9^{9}}}}}",
        "\\boxed{2^{2^{2^{2^{2^{2^{2}}}}}}}",
        "\\boxed{10^{10}!}",
        "\\boxed{" + "{" * 450 + "1" + "}" * 450 + "}",
        "\\boxed{" + "\\frac{" * 100 + "1" + "}{2}" * 100 + "}",
        "\\boxed{" + "(" * 400 + "1" + ")" * 400 + "}",
        "\\boxed{" + "{" * 200_000 + "}" * 200_000 + "}",
        "{" * 1_000_000,
        "1" * 1_000_000,
        "#### " + "9" * 1_000_000,
        "\\boxed{" * 100_000,
        "answer " + " " * 1_000_000 + "C",
        "<think>" * 200_000,
        "x" * 1_000_000,
        "\\boxed{" + "1" * 900 + "}",
        "\\boxed{" + "x" * 999_000 + "}",
        # just under the response cap, so the scans run on them
        "{" * 390_000,
        "1" * 390_000,
        "#### " + "9" * 390_000,
        "\\boxed{" * 50_000,
        "(C" * 190_000,
        "answer " + " " * 390_000 + "C",
        "<think>" + "\\boxed{" * 50_000 + "</think>",
        "\\boxed{" + "x" * 390_000 + "}",
    ]


def _run_all(marker, timeout_s, results):
    for name in VERIFIERS:
        v = get_verifier(name, timeout_s=timeout_s)
        gold = {"multiple_choice": "C", "exact_match": "red", "judge_verdict": "B", "judge_format": "B"}.get(
            name, "424242"
        )
        for text in _hostile(marker):
            math_worker.prestart()  # a replacement worker is ready (its start is not hostile-input time)
            t0 = time.monotonic()
            r = v(text, gold)
            results.append((name, text[:40], time.monotonic() - t0, r))


@pytest.mark.parametrize("in_thread", [False, True], ids=["main-thread", "worker-thread"])
def test_hostile_inputs_return_within_the_limit_without_side_effects(tmp_path, in_thread):
    marker = tmp_path / MARKER
    timeout_s, results = 1.0, []
    if in_thread:
        t = threading.Thread(target=_run_all, args=(marker, timeout_s, results))
        t.start()
        t.join(600)
        assert not t.is_alive()
    else:
        _run_all(marker, timeout_s, results)
    assert len(results) == len(VERIFIERS) * len(_hostile(marker))
    slow = [(n, s, round(dt, 2)) for n, s, dt, _ in results if dt > timeout_s + 0.5]
    assert not slow, slow
    assert not marker.exists()
    # format-type verifiers credit the answer's shape, not its value; the rest must fail hostile text
    wrong = [(n, s, r) for n, s, _, r in results if n != "length_penalty" and not n.endswith("format") and r.correct]
    assert not wrong, wrong
    timeouts = [s for n, s, _, r in results if r.error == "timeout"]
    assert any("10^{10^{10}}" in s for s in timeouts)  # the tower was cut by the limit, not parsed


def test_docs_rule_verifiers_example_runs(tmp_path):
    import re
    import runpy
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "reward-models.md").read_text()
    section = text[text.index("## Rule verifiers") :]
    script = tmp_path / "verifiers_example.py"
    script.write_text(re.search(r"```python\n(.*?)```", section, re.S).group(1))
    ns = runpy.run_path(str(script))
    assert (ns["r"].score, ns["r"].extracted, ns["r"].correct, ns["r"].format_ok, ns["r"].error) == (
        1.0,
        "0.5",
        True,
        True,
        None,
    )
    assert "response_length=448).score  # -0.5" in section  # the values the example states in comments:
    assert (
        get_verifier("length_penalty", max_length=512, cache_length=128)("x", None, response_length=448).score == -0.5
    )
    assert get_verifier("gsm8k")("... #### 1,000", "1000").correct


def test_math_boxed_from_concurrent_threads_does_not_serialise_on_hostile_inputs():
    v = get_verifier("math_boxed", timeout_s=1.0)
    math_worker.prestart(4)
    jobs = [
        ("\\boxed{10^{10^{10}}}", "1", False),
        ("\\boxed{\\frac{1}{2}}", "0.5", True),
        ("\\boxed{9^{9^{9^{9}}}}", "1", False),
        ("\\boxed{2\\pi}", "2 \\pi", True),
    ]
    out = {}

    def work(i, response, gold):
        t0 = time.monotonic()
        out[i] = (v(response, gold).correct, time.monotonic() - t0)

    threads = [threading.Thread(target=work, args=(i, r, g)) for i, (r, g, _) in enumerate(jobs)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert [out[i][0] for i in range(4)] == [want for *_, want in jobs]
    assert time.monotonic() - t0 < 2.5  # four at once, not one after another behind the 1 s timeouts


JUDGE = [  # (response, gold, judge_mode, strict verdict, lenient verdict)
    ("<answer>A</answer>", "A", "pairwise", "A", "A"),
    ("I compared them. <answer>B</answer>", "A", "pairwise", "B", "B"),
    ("B", "B", "pairwise", "B", "B"),
    ("  tie \n", "tie", "pairwise", "tie", "tie"),
    ("A B tie", "A", "pairwise", None, "A"),  # every verdict named: strict reads none
    ("a is better than b", "A", "pairwise", None, "A"),
    ("<answer>A or B</answer>", "A", "pairwise", None, None),
    (" yes", "yes", "pointwise", "yes", "yes"),
    ("yes no", "yes", "pointwise", None, "yes"),
    ("", "yes", "pointwise", None, None),
]


@pytest.mark.parametrize("response, gold, mode, strict, lenient", JUDGE)
def test_judge_verdict_strict_and_lenient(response, gold, mode, strict, lenient):
    for options, want in (({}, strict), ({"lenient": True}, lenient)):
        r = get_verifier("judge_verdict", **options)(response, gold, judge_mode=mode)
        assert (r.extracted, r.score) == (want, float(want == gold)), options
        assert get_verifier("judge_format", **options)(response, None, judge_mode=mode).score == float(want is not None)


def test_docs_strict_and_lenient_examples_hold():
    """Every example row of docs/reward-models.md's strict/lenient table scores as the table says."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "reward-models.md").read_text()
    table = text[text.index("| verifier | response | reference | strict | lenient |") :].split("\n\n")[0]
    checked = 0
    for line in table.splitlines()[2:]:
        name, responses, refs, strict, lenient = [c.strip() for c in line.strip("|").split(" | ")]
        name = name.strip("`")
        responses = [r.replace("\\|", "|") for r in re.findall(r"`([^`]*)`", responses)]
        refs = [r.strip() for r in refs.split(" / ")]
        stricts, lenients = strict.split(" / "), lenient.split(" / ")
        for i, response in enumerate(responses):
            ref = refs[min(i, len(refs) - 1)]
            meta = {"vocabulary": ["red", "green", "blue", "yellow"]}
            if name.startswith("judge"):
                meta = {"judge_mode": "pairwise" if ref in ("A", "B", "tie") else "pointwise"}
            want = float(stricts[min(i, len(stricts) - 1)])
            assert get_verifier(name)(response, ref, **meta).score == want, (name, response)
            lenient_want = re.match(r"(?:`gsm8k_flexible`: )?([01])", lenients[min(i, len(lenients) - 1)])
            if lenient_want and "no lenient" not in line:
                other = get_verifier("gsm8k_flexible") if name == "gsm8k" else get_verifier(name, lenient=True)
                assert other(response, ref, **meta).score == float(lenient_want.group(1)), (name, response, "lenient")
            checked += 1
    assert checked >= 25, checked
