"""Collapse detectors (issue 25, item 3) on hand-made batches: group outcomes, the spread of answers over
distinct prompts, the alarm; and the monitor of train-policy, fed real responses through the real
``vocab_answer`` verifier in its lenient reading (the one that paid the junk: the strict default gives it
no answer and no reward), raising its alarm on the junk collapse the issue describes and not on a healthy
batch (nor on an untrained policy that names nothing)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from data_pipelines.records import PromptRecord
from reward_models.diagnostics import answer_collapse, answer_spread, group_outcomes
from reward_models.verifiers import get_verifier
from vlrft.strategies import StrategyConfig, make_strategy
from vlrft.trainer.collapse import CollapseMonitor, answer_of


def test_group_outcomes_tell_all_wrong_from_all_right():
    correct = [0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0]
    groups = [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]  # group 0 and 3 all wrong, 1 all right, 2 mixed
    assert group_outcomes(correct, groups) == {"groups/all_wrong": 0.5, "groups/all_right": 0.25}


def test_answer_spread_hand_values():
    # four prompts, two samples each; prompt c's samples name nothing; b's tie between blue and red (-> blue)
    prompts = ["a", "a", "b", "b", "c", "c", "d", "d"]
    answers = ["red", "red", "red", "blue", None, None, "red", "green"]
    golds = ["red", "red", "blue", "blue", "green", "green", "yellow", "yellow"]
    figures, top = answer_spread(prompts, answers, golds)
    # modal answers: a red, b blue (tie broken by name), c none, d green (tie green/red -> green)
    assert top == "blue"  # blue, green, red once each: the smallest name
    assert figures["answers/distinct_prompts"] == 4
    assert figures["answers/top_share"] == 1 / 4
    assert figures["answers/entropy"] == pytest.approx(math.log(3))  # three answers, once each
    assert figures["answers/gold_top_share"] == 1 / 4
    assert figures["answers/gold_entropy"] == pytest.approx(math.log(4))
    # a collapse: every prompt answered 'yes', the references balanced
    prompts = [f"p{i}" for i in range(10) for _ in range(2)]
    figures, top = answer_spread(prompts, ["yes"] * 20, [("yes", "no")[i % 2] for i in range(10) for _ in range(2)])
    assert top == "yes" and figures["answers/top_share"] == 1.0 and figures["answers/entropy"] == 0.0
    assert figures["answers/gold_top_share"] == 0.5 and figures["answers/gold_entropy"] == pytest.approx(math.log(2))
    assert answer_collapse(figures, share=0.8)
    assert not answer_collapse(figures, share=0.8, min_prompts=11)  # too few prompts to tell


def test_the_alarm_needs_varied_references():
    """A task whose references are all the same answer is not collapsed when the policy gives it."""
    prompts = [f"p{i}" for i in range(10)]
    figures, _ = answer_spread(prompts, ["4"] * 10, ["4"] * 10)
    assert figures["answers/top_share"] == 1.0 and figures["answers/gold_top_share"] == 1.0
    assert not answer_collapse(figures, share=0.8)


@dataclass
class _Rollout:
    text: str


@dataclass
class _Group:
    record: PromptRecord
    rollouts: list[_Rollout]


COLORS = ["red", "green", "blue", "yellow"]


def _groups(responses_for) -> list[_Group]:
    """Eight prompts of the colour task (references balanced), four responses each from ``responses_for``."""
    out = []
    for i in range(8):
        gold = COLORS[i % 4]
        record = PromptRecord(id=f"r{i}", prompt="?", answer=gold, metadata={"vocabulary": COLORS})
        out.append(_Group(record, [_Rollout(t) for t in responses_for(gold, i)]))
    return out


def _correct(groups, verifier):
    scores = [verifier(r.text, g.record.answer, **g.record.metadata).score for g in groups for r in g.rollouts]
    return torch.tensor(scores) > 0.5, torch.tensor([i for i, g in enumerate(groups) for _ in g.rollouts])


def test_the_monitor_raises_the_alarm_on_the_junk_collapse_once_and_never_on_healthy_batches():
    verifier = get_verifier("vocab_answer", lenient=True)
    strategy = make_strategy(StrategyConfig())
    said: list[str] = []
    monitor = CollapseMonitor(verifier, share=0.8, steps=3, strategy=strategy, log=said.append)
    # the junk of the issue: varied text, always 'red' as the first colour word, whatever the image
    junk = _groups(lambda gold, i: [f"least red_ option red {w} COL" for w in ("a", "b", "c", "d")])
    correct, ids = _correct(junk, verifier)
    alarms = [monitor.step(s, junk, correct, ids)["alarm/answer_collapse"] for s in range(1, 6)]
    assert alarms == [0.0, 0.0, 1.0, 1.0, 1.0]  # after 3 steps in a row
    assert len(said) == 1 and said[0].startswith("step 3: alarm: answer collapse: 'red' is the answer to 100% of")
    out = monitor.step(6, junk, correct, ids)
    assert out["answers/top_share"] == 1.0 and out["groups/all_wrong"] == 0.75 and out["groups/all_right"] == 0.25
    # a healthy batch (mostly right answers) resets it; an untrained policy naming nothing never raises it
    for healthy in (
        _groups(lambda gold, i: [gold, gold, gold, COLORS[(i + 1) % 4]]),
        _groups(lambda gold, i: ["zz qq", "xx", "", "the the"]),
    ):
        correct, ids = _correct(healthy, verifier)
        for s in range(10):
            assert monitor.step(7 + s, healthy, correct, ids)["alarm/answer_collapse"] == 0.0
    assert len(said) == 1
    # the state goes into the checkpoint
    monitor.run = 4
    again = CollapseMonitor(verifier, 0.8, 3, strategy, said.append)
    again.load_state_dict(monitor.state_dict())
    assert again.run == 4


def test_answer_of_reads_what_the_verifier_extracts_or_the_response_itself():
    record = PromptRecord(id="r", prompt="?", answer="red", metadata={"vocabulary": COLORS})
    assert answer_of(get_verifier("vocab_answer", lenient=True), "It is  RED, clearly", record) == "red"
    assert answer_of(get_verifier("vocab_answer"), "It is  RED, clearly", record) is None  # strict: no answer
    assert answer_of(get_verifier("vocab_answer"), " Red.", record) == "red"
    assert answer_of(get_verifier("vocab_answer"), "no colour here", record) is None

    class Scorer:  # a verifier that only scores (a reward function's)
        extracts = False

    assert answer_of(Scorer(), "  Maybe   Red ", record) == "maybe red"


def test_the_held_out_signature_fires_on_collapsed_evaluations_that_do_not_rise_and_not_on_a_passing_phase():
    """The other signature (issue 64, item 6): the held-out greedy answers collapsed at ``evals`` evaluations in a
    row while the held-out accuracy did not rise (the junk collapse: groups mixed by the junk, held-out at chance).
    A one-answer phase that learns within two evaluations (the showcase: 0.25, 0.25, 0.75) stays quiet."""
    strategy = make_strategy(StrategyConfig())
    said: list[str] = []
    monitor = CollapseMonitor(get_verifier("vocab_answer"), 0.8, 5, strategy, said.append, evals=3)
    one = {"answers/distinct_prompts": 64.0, "answers/top_share": 1.0, "answers/gold_top_share": 0.5}
    varied = {**one, "answers/top_share": 0.5}
    for step, figures in [(0, varied), (25, one), (50, one)]:
        monitor.heldout(step, {**figures, "accuracy": 0.5})
        assert monitor.start(step + 1) is None
    monitor.heldout(75, {**one, "accuracy": 0.5})  # the third in a row, accuracy flat: fires, once
    assert monitor.start(76) == 25 and len(said) == 1
    assert said[0].startswith("step 75: alarm: answer collapse: the held-out answers were one answer for more than")
    assert "(steps 25, 50, 75) while the held-out accuracy did not rise (0.5 -> 0.5)" in said[0]
    monitor.heldout(100, {**one, "accuracy": 0.5})
    assert monitor.start(101) == 50 and len(said) == 1  # still on, said once
    again = CollapseMonitor(get_verifier("vocab_answer"), 0.8, 5, strategy, said.append, evals=3)
    again.load_state_dict(monitor.state_dict())  # part of the checkpoint
    assert again.start(101) == 50
    monitor.heldout(125, {**varied, "accuracy": 0.75})  # learned: off
    assert monitor.start(126) is None
    passing = CollapseMonitor(get_verifier("vocab_answer"), 0.8, 5, strategy, said.append, evals=3)
    for step, acc in [(25, 0.25), (50, 0.25), (75, 0.25)]:  # collapsed but rising at the third: quiet
        passing.heldout(step, {**(one if step < 75 else varied), "accuracy": acc if step < 75 else 0.75})
    assert passing.start(76) is None and len(said) == 1
