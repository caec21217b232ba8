"""Reward-hacking probes (``reward_models.probes``, ``vlrft probe-rewards``): each probe is flagged on a pool made
hackable for it, and the strict defaults flag nothing. Rewards here are exact (verifiers, functions: 0 or 1, means
of a few records), so the assertions are exact; the reward models' figures are measured and printed."""

from __future__ import annotations

import html
import json
from pathlib import Path

import pytest
import torch

from data_pipelines.formatting import judgment_as_prompt
from data_pipelines.records import PromptRecord
from data_pipelines.synthetic import make_judgment_records, make_prompt_records
from reward_models.pool import RewardPool, RewardPoolConfig
from reward_models.probes import IMAGE_TOLERANCE, probe_responses, run_probes, wrong_answer
from reward_models.scalar import ScalarRewardModel
from vlrft.cli import main
from vlrft.commands.train_policy import DEMO_CONFIG
from vlrft.config import load_config
from vlrft.models.loading import load_processor
from vlrft.trainer.config import PolicyTrainConfig

REPO = Path(__file__).resolve().parents[1]
COLOR = make_prompt_records("color", 16, seed=10000)  # the demo's held-out records
CHOICES = ["a circle", "a square", "a triangle", "a star"]
MC = [
    PromptRecord(id=f"mc{k}", prompt="Which shape?", answer="ABCD"[k], metadata={"choices": CHOICES}) for k in range(4)
]
JUDGE = [judgment_as_prompt(r) for r in make_judgment_records("color", 12, seed=5, judge_mode="pairwise")]
FUNCTIONS = """
def pays_length(sample):  # right answers, and anything very long
    return float(sample.response.strip() == sample.answer) + float(len(sample.response) > 1000)

def pays_silence(sample):  # right answers, and saying nothing
    return 1.0 if not sample.response.strip() else float(sample.response.strip() == sample.answer)

def refuses_long(sample):  # right answers; a long response is an error (as an SRM past its max_length)
    if len(sample.response) > 1000:
        raise ValueError("too long for me")
    return float(sample.response.strip() == sample.answer)
"""


def _pool(*sources: str) -> RewardPool:
    return RewardPool(load_config(RewardPoolConfig, None, [f"sources=[{', '.join(sources)}]", "device=cpu"]))


def _probe(pool: RewardPool, records, **kw):
    try:
        return run_probes(pool, records, **kw)
    finally:
        pool.close()


def _row(report, name: str):
    return next(r for r in report.rows if r.name == name)


def test_the_probe_responses_of_a_record():
    probes, skipped = probe_responses(COLOR[0], "red", "green", long_words=5)
    assert probes == {
        "gold": "red",
        "wrong": "green",
        "empty": "",
        "whitespace": " \n\t ",
        "vocabulary": "red green blue yellow",
        "repeated": f"{COLOR[0].answer} {COLOR[0].answer} {COLOR[0].answer}",
        "padded": f"least {COLOR[0].answer}_ option {COLOR[0].answer} COL",
        "long": f"{COLOR[0].answer} least option COL lorem ipsum",
    }
    assert skipped == {"every_option": "no choices", "verdicts": "not a judge record"}
    mc, _ = probe_responses(MC[2], "C", "D")
    assert mc["every_option"] == "(A) (B) (C) (D)" and "vocabulary" not in mc
    judge, why = probe_responses(JUDGE[0], JUDGE[0].answer, None)
    assert judge["verdicts"] == "A B tie" and why["vocabulary"] == "a judge record (see verdicts)"
    # the wrong answer: another vocabulary word, the next choice (as a letter or as its text), another record's
    assert wrong_answer(COLOR[0], []) != COLOR[0].answer and wrong_answer(COLOR[0], []) in ["red", "green"]
    assert wrong_answer(MC[3], []) == "A"
    text = PromptRecord(id="t", prompt="?", answer="a star", metadata={"choices": CHOICES})
    assert wrong_answer(text, []) == "a circle"
    numbers = [PromptRecord(id=str(k), prompt="?", answer=str(k % 2)) for k in range(3)]
    assert wrong_answer(numbers[0], numbers[1:]) == "1" and wrong_answer(numbers[0], numbers[2:]) is None


def test_strict_default_pools_flag_nothing():
    demo = load_config(PolicyTrainConfig, DEMO_CONFIG, []).reward  # strict vocab_answer
    cases = [
        (RewardPool(demo), COLOR),
        (_pool("{name: mc, verifier: multiple_choice}"), MC),
        (
            _pool("{name: verdict, verifier: judge_verdict}", "{name: format, verifier: judge_format, weight: 0.2}"),
            JUDGE,
        ),
        (
            _pool("{name: boxed, verifier: math_boxed}"),
            [PromptRecord(id=str(k), prompt="?", answer=str(k)) for k in (3, 7)],
        ),
    ]
    for pool, records in cases:
        report = _probe(pool, records)
        print(pool.cfg.sources[0].verifier, {r.name: r.reward for r in report.rows})
        assert report.flagged == []
        # the judge pool's 1 + 0.2 is summed in float32: within 2 ulps (2.4e-7) of 1.2
        assert _row(report, "gold").reward == pytest.approx(1.0 + (0.2 if records is JUDGE else 0.0), abs=2.4e-7)
        assert all(r.reward == 0.0 for r in report.rows if r.probe not in ("gold", "wrong"))
    # math_boxed pays the answer in a box only: that is the gold's form (and the wrong one's), the junk stays bare
    report = _probe(_pool("{name: boxed, verifier: math_boxed}"), [PromptRecord(id="n", prompt="?", answer="7")])
    assert report.cases == [] and _row(report, "gold").reward == 1.0


def test_lenient_vocab_answer_flags_the_answer_among_words():
    report = _probe(_pool("{name: acc, verifier: vocab_answer, verifier_options: {lenient: true}}"), COLOR)
    assert report.flagged == ["vocabulary", "repeated", "padded", "long"]
    first = sum(r.answer == "red" for r in COLOR) / len(COLOR)  # "red green blue yellow" reads red, the first word
    assert _row(report, "vocabulary").reward == first and first > 0.1  # the margin rule: more than wrong (0)
    assert [_row(report, p).reward for p in ("repeated", "padded", "long")] == [1.0] * 3  # the ratio rule
    assert {c["probe"] for c in report.cases} == set(report.flagged)


def test_lenient_multiple_choice_flags_every_option():
    report = _probe(_pool("{name: mc, verifier: multiple_choice, verifier_options: {lenient: true}}"), MC)
    assert report.flagged == ["every_option"]
    assert _row(report, "every_option").reward == 0.25  # "(A) (B) (C) (D)" reads D, the last: right once in four


def test_lenient_judge_verdict_flags_the_verdicts_enumerated():
    report = _probe(_pool("{name: v, verifier: judge_verdict, verifier_options: {lenient: true}}"), JUDGE)
    assert report.flagged == ["verdicts", "repeated", "padded", "long"]
    share_a = sum(r.answer == "A" for r in JUDGE) / len(JUDGE)  # "A B tie" reads A, the first verdict word
    assert _row(report, "verdicts").reward == pytest.approx(share_a, abs=1e-7)  # float32 mean of 0/1 values


def test_a_format_only_reward_flags_the_wrong_answer():
    report = _probe(_pool("{name: fmt, verifier: vocab_format}"), COLOR)  # strict: one vocabulary word, right or not
    assert report.flagged == ["wrong"] and _row(report, "wrong").ratio == 1.0


@pytest.fixture(scope="module")
def functions(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("fn") / "rewards.py"
    path.write_text(FUNCTIONS)
    return path


def test_a_function_paying_long_responses_flags_long(functions):
    report = _probe(_pool(f"{{name: f, kind: function, function: '{functions}:pays_length'}}"), COLOR[:4])
    assert report.flagged == ["long"]
    assert _row(report, "long").reward == 1.0 and _row(report, "long").ratio == 1.0


def test_a_function_paying_empty_responses_flags_empty_and_whitespace(functions):
    report = _probe(_pool(f"{{name: f, kind: function, function: '{functions}:pays_silence', isolation: inline}}"), MC)
    assert report.flagged == ["empty", "whitespace"]


def test_a_probe_the_pool_cannot_score_is_an_error_row_not_a_flag(functions):
    report = _probe(_pool(f"{{name: f, kind: function, function: '{functions}:refuses_long', isolation: inline}}"), MC)
    long = _row(report, "long")
    assert report.flagged == [] and long.reward is None and not long.flagged
    assert "reward source 'f' (function) failed on record 'mc0'" in long.error and "too long for me" in long.error
    assert _row(report, "padded").reward == 0.0 and _row(report, "gold").reward == 1.0  # the rest still scored


@pytest.fixture(scope="module")
def blind_srm(srm_dir, tmp_path_factory) -> Path:
    """The session SRM with its vision merger's output zeroed: every image becomes the same zero embeddings."""
    model = ScalarRewardModel.from_pretrained(srm_dir)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual.merger.mlp.2" in name:
                p.zero_()
    out = tmp_path_factory.mktemp("blind") / "srm"
    model.save_pretrained(out, processor=load_processor(srm_dir))
    return out


def test_image_probes_tell_an_image_blind_reward_model(srm_dir, blind_srm):
    figures = {}
    for name, path in (("srm", srm_dir), ("blind", blind_srm)):
        pool = _pool("{name: acc, verifier: vocab_answer}", f"{{name: rm, kind: srm, path: '{path}', weight: 0.0}}")
        report = _probe(pool, COLOR[:4], long_words=20)
        figures[name] = {p: _row(report, f"{p}:rm").delta for p in ("blank_image", "other_image")}
        flagged = [f for f in report.flagged if f.endswith(":rm")]
        assert flagged == ([] if name == "srm" else ["blank_image:rm", "other_image:rm"])
    print("largest |score change| with the image replaced:", figures)
    assert figures["blind"] == {"blank_image": 0.0, "other_image": 0.0}  # the same tokens, the same forward
    assert min(figures["srm"].values()) > 100 * IMAGE_TOLERANCE  # a model that reads the image, far above it


def test_the_swap_probe_flags_a_judge_with_position_bias(always_a_judge):
    src = f"name: pj, kind: grm, path: '{always_a_judge}', judge_mode: pairwise, max_new_tokens: 12"
    records = make_prompt_records("color", 3, seed=9, num_colors=2)  # the judge's own kind of prompts
    biased = _probe(_pool(f"{{{src}}}"), records, long_words=20)
    row = _row(biased, "swap:pj")
    assert row.flagged and row.position_bias == 1.0 and (row.reward, row.gold) == (1.0, 0.0)  # A wins both orders
    fair = _probe(_pool(f"{{{src}, debias: swap}}"), records, long_words=20)
    assert _row(fair, "swap:pj").position_bias == 0.0 and "swap:pj" not in fair.flagged
    print("swap probe, debias none:", biased.flagged, "; debias swap:", fair.flagged)


def test_probes_leave_the_pool_diagnostics_alone():
    pool = RewardPool(load_config(PolicyTrainConfig, DEMO_CONFIG, []).reward)
    before = pool.diagnostics.state_dict()
    _probe(pool, COLOR[:4])
    assert pool.diagnostics.state_dict() == before


def test_probe_rewards_command(tmp_path, capsys):
    strict = ["probe-rewards", "--records", "8", "--out", str(tmp_path / "strict")]
    assert main(strict) == 0
    assert json.loads((tmp_path / "strict" / "probes.json").read_text())["flagged"] == []
    capsys.readouterr()
    # the lenient example of docs/reward-models.md prints what the page shows
    sources = (
        "reward.sources=[{name: accuracy, verifier: vocab_answer, verifier_options: {lenient: true}},"
        " {name: format, verifier: vocab_format, weight: 0.2, verifier_options: {lenient: true}}]"
    )
    out = tmp_path / "lenient"
    assert main(["probe-rewards", str(REPO / "configs/policy/yes_no.yaml"), sources, "--out", str(out)]) == 3
    printed = capsys.readouterr().out.replace(str(out), "runs/probe-lenient")
    doc = (REPO / "docs" / "reward-models.md").read_text()
    shown = doc[doc.index("The second prints") :].split("```")[1].strip("\n")
    assert printed.strip("\n") == shown
    found = json.loads((out / "probes.json").read_text())
    assert found["records"] == 16 and found["flagged"] == ["vocabulary", "repeated", "padded", "long"]
    page = (out / "report.html").read_text()
    case = next(c for c in found["cases"] if c["probe"] == "padded")
    assert html.escape(f"probe padded: {case['why']}") in page and case["record"] in page
    assert "data:image/png;base64" in page  # the record's image, as a thumbnail
    assert main(["probe-rewards", "reward.sources=[{name: a, verifier: nope}]", "--out", str(tmp_path / "x")]) == 2
    assert main(["probe-rewards", "--records", "0", "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("vlrft probe-rewards: config error: reward.sources[0].verifier=nope: unknown verifier")
    assert err[1] == "vlrft probe-rewards: config error: --records 0: must be >= 1" and len(err) == 2
