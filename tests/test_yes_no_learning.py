"""Learning proofs on a yes/no visual question (issue #25), where answering one word to every image scores 0.5:

- GRPO after a format-only warm start (``train-sft configs/sft/yes_no_format.yaml``: the task's records with each
  answer a coin flip, so the model learns the answer words and nothing of which is right; held-out 0.5), with a KL
  to that warm start and the default strict reward, reaches >= 0.9 held-out: what it learns, RL learned. It held
  on the three seeds and the second arithmetic setting measured (docs/train-policy.md). From the random model
  itself (configs/policy/yes_no.yaml as it stands), which answer word is rewarded first decides the run and one
  seed in three stays at 0.5 (the same doc counts it), so no test pins that trajectory any more;
- the same task through ``train-sft`` (configs/sft/yes_no.yaml) then ``train-policy`` from the SFT model, with
  4-token responses, ends >= 0.95 without collapse: RL keeps what SFT taught (three SFT models, four GRPO seeds,
  both arithmetic settings, measured; docs/train-policy.md);
- the issue's junk collapse, reproduced with the lenient verifiers of earlier versions (8 tokens, format credit
  for naming any answer): the reward rises to about 0.7 on junk, held-out accuracy stays at chance,
  ``frac_reward_zero_std`` stays near 0 (it cannot see the collapse), and the answer-collapse alarm fires.

All three are marked slow (about 5, 2.5 and 3 minutes on a 2-core CPU).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch import QUIET

from reward_models.verifiers import get_verifier
from vlrft.cli import main

REPO = Path(__file__).resolve().parents[1]
RL = REPO / "configs" / "policy" / "yes_no.yaml"
SFT = REPO / "configs" / "sft" / "yes_no.yaml"
FORMAT = REPO / "configs" / "sft" / "yes_no_format.yaml"
AFTER_FORMAT = [  # GRPO after the format-only warm start (configs/sft/yes_no_format.yaml)
    "rollout.max_new_tokens=4",  # the warm start ends its turn after the word
    "algorithm.kl_coef=0.1",  # to the warm start: both words stay sampled in every cell while RL separates them
    "algorithm.entropy_coef=0",
    "optim.lr=2e-3",  # at 3e-3 seed 0's cells stayed together for 300 steps, as SFT's do at 3e-3
    "train.max_steps=600",  # the step at which RL first separates the cells varies: 125 to 500 measured
]

pytestmark = pytest.mark.slow


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _evals(run: Path) -> dict[int, float]:
    return {r["step"]: r["eval/accuracy"] for r in _rows(run) if "eval/accuracy" in r}


def _alarms(run: Path) -> list[int]:
    return [r["step"] for r in _rows(run) if r.get("alarm/answer_collapse") == 1.0]


@pytest.mark.timeout(1800)  # 5 min alone, 8 beside another test here; pytest's default of 900 s leaves too little
def test_grpo_after_a_format_only_warm_start_learns_the_yes_no_question(tmp_path):
    fmt = tmp_path / "format"
    assert main(["train-sft", str(FORMAT), f"train.output_dir={fmt}", *QUIET]) == 0
    rl = tmp_path / "rl"
    assert (
        main(["train-policy", str(RL), f"model.path={fmt / 'final'}", *AFTER_FORMAT, f"train.output_dir={rl}", *QUIET])
        == 0
    )
    evals = _evals(rl)
    # the warm start learned its answers from coin flips: it answers in the format, at chance (measured 0.5)
    assert evals[0] <= 0.6, evals
    # learned by RL alone, at the last three evaluations (measured on seeds 0, 1, 2 and seed 0 under
    # MKL_CBWR=COMPATIBLE: 1.0 from step 275, 275, 325 and 500 to 600; docs/train-policy.md)
    assert min(evals[550], evals[575], evals[600]) >= 0.9, evals
    # while the greedy answers one word and the accuracy is flat (to step 325 measured) the held-out alarm is right
    # to say so; once RL has separated the cells it is quiet
    assert not [s for s in _alarms(rl) if s >= 400], _alarms(rl)
    strict = get_verifier("vocab_answer")
    last = [json.loads(line) for line in (rl / "samples.jsonl").read_text().splitlines()][-8:]
    assert all(strict(s["response"], s["answer"], vocabulary=["yes", "no"]).format_ok for s in last), last


def test_sft_then_grpo_ends_above_0_95_without_collapse(tmp_path):
    sft = tmp_path / "sft"
    assert main(["train-sft", str(SFT), f"train.output_dir={sft}", *QUIET]) == 0
    sft_evals = _evals(sft)
    assert sft_evals[0] <= 0.1 and min(sft_evals[700], sft_evals[800]) >= 0.9, sft_evals  # AVX2: 1.0 from 300
    rl = tmp_path / "rl"
    args = [
        "train-policy",
        str(RL),
        f"model.path={sft / 'final'}",
        "rollout.max_new_tokens=4",  # the SFT model ends its turn: no need to cut responses at one token
        # 3e-4, not 1e-3: on a certain SFT model, AdamW turns the rare mixed group's small gradient into a step of
        # the learning rate in every coordinate, and at 1e-3 that cost one cell for good (docs/train-policy.md)
        "optim.lr=3e-4",
        "algorithm.entropy_coef=0",
        "train.max_steps=100",
        f"train.output_dir={rl}",
        *QUIET,
    ]
    assert main(args) == 0
    evals = _evals(rl)
    assert min(evals.values()) >= 0.95 and evals[100] >= 0.95, evals
    assert _alarms(rl) == []


def test_the_lenient_junk_collapse_raises_the_alarm_that_frac_reward_zero_std_misses(tmp_path):
    out = tmp_path / "junk"
    lenient = "verifier_options: {lenient: true}"
    args = [
        "train-policy",
        str(RL),
        "data.synthetic_options={noise: 24}",  # 4 colours, 56 px, unpaired: the setting
        "data.group_size=1",
        "rollout.rollout_batch_size=8",
        "rollout.n_samples_per_prompt=32",
        "rollout.max_new_tokens=8",
        "algorithm.entropy_coef=0.01",
        "optim.lr=2e-3",
        "train.max_steps=150",
        "reward.sources=["
        f"{{name: accuracy, kind: verifier, verifier: vocab_answer, {lenient}}}, "
        f"{{name: format, kind: verifier, verifier: vocab_format, weight: 0.2, {lenient}}}]",
        f"train.output_dir={out}",
        *QUIET,
    ]
    assert main(args) == 0
    rows = [r for r in _rows(out) if "reward/combined" in r]
    late = rows[-20:]
    # the lenient reward pays: measured 0.69 at step 50, 0.80 at step 150 (1.2 is the most a step can pay)
    assert sum(r["reward/combined"] for r in late) / len(late) >= 0.5
    assert max(_evals(out).values()) <= 0.6, _evals(out)  # held-out accuracy never leaves chance (0.5)
    assert sum(r["frac_reward_zero_std"] for r in late) / len(late) <= 0.2  # the old collapse reading sees nothing
    alarms = _alarms(out)
    # the held-out signature (issue 64): the greedy answers one word at the evaluations of steps 25-100 (4 in a row,
    # train.collapse_evals) while held-out stays 0.5; measured: the alarm from step 101 to the end, 50 steps of 150
    assert len(alarms) >= 10 and alarms[0] <= 101, alarms
    # what it learned is junk: the strict reading credits almost none of the late samples
    strict = get_verifier("vocab_answer")
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    late_samples = [s for s in samples if s["step"] > 120]
    paid = sum(strict(s["response"], s["answer"], vocabulary=["yes", "no"]).score for s in late_samples)
    assert paid <= 0.1 * len(late_samples), [s["response"] for s in late_samples[:5]]
