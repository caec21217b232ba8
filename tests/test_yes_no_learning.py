"""Learning proofs on a yes/no visual question (issue #25), where answering one word to every image scores 0.5:

- GRPO from the random tiny model with the default strict reward (configs/policy/yes_no.yaml) reaches >= 0.9
  held-out and stays there, on its pinned seed: from scratch, which answer word is rewarded first decides the run
  (one seed in three measured stays at 0.5; docs/train-policy.md counts it), so this run pins a trajectory that
  learns, and no recipe tried holds on every seed;
- the same task through ``train-sft`` (configs/sft/yes_no.yaml) then ``train-policy`` from the SFT model, with
  4-token responses, ends >= 0.95 without collapse: the proof that holds across seeds and arithmetic (three SFT
  models, four GRPO seeds, both arithmetic settings, measured; docs/train-policy.md);
- the issue's junk collapse, reproduced with the lenient verifiers of earlier versions (8 tokens, format credit
  for naming any answer): the reward rises to about 0.7 on junk, held-out accuracy stays at chance,
  ``frac_reward_zero_std`` stays near 0 (it cannot see the collapse), and the answer-collapse alarm fires.

All three are marked slow (about 2, 2.5 and 3 minutes on a 2-core CPU).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from reward_models.verifiers import get_verifier
from vlrft.cli import main

REPO = Path(__file__).resolve().parents[1]
RL = REPO / "configs" / "policy" / "yes_no.yaml"
SFT = REPO / "configs" / "sft" / "yes_no.yaml"
QUIET = ["logging.wandb=disabled", "logging.progress_bar=false", "logging.tensorboard=false"]

pytestmark = pytest.mark.slow


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _evals(run: Path) -> dict[int, float]:
    return {r["step"]: r["eval/accuracy"] for r in _rows(run) if "eval/accuracy" in r}


def _alarms(run: Path) -> list[int]:
    return [r["step"] for r in _rows(run) if r.get("alarm/answer_collapse") == 1.0]


def test_grpo_from_scratch_learns_the_yes_no_question_with_the_strict_reward(tmp_path):
    out = tmp_path / "rl"
    assert main(["train-policy", str(RL), f"train.output_dir={out}", *QUIET]) == 0
    evals = _evals(out)
    assert evals[0] <= 0.1, evals  # the random policy says neither word alone
    # learned with margin: >= 0.9 at each of the last three evaluations (measured: 1.0 from step 200 on, and at
    # steps 100-125 before a dip to 0.75)
    assert min(evals[250], evals[275], evals[300]) >= 0.9, evals
    # the policy first says one word to every image for a while (held-out 0.5 at steps 25-75, 1.0 from 100; with
    # train.seed=1 one word at steps 48-108, 1.0 from 150), then reads the image; its groups stay mixed, so the alarm
    # that needs a collapse it cannot leave (issue 64) is quiet here (measured: never; the old answer-only alarm
    # fired at step 54), and the last third of the run is quiet whatever the seed
    assert not [s for s in _alarms(out) if s >= 200], _alarms(out)
    strict = get_verifier("vocab_answer")
    last = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()][-32:]
    assert all(strict(s["response"], s["answer"], vocabulary=["yes", "no"]).format_ok for s in last[-8:]), last[-8:]


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
