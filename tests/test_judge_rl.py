"""Judge RL: train-policy trains a pointwise judge on judgment records whose verdict is verifiable
(data.record_kind=judgment, verifiers judge_verdict + judge_format, configs/policy/judge_rl.yaml)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from data_pipelines.errors import DataError
from data_pipelines.formatting import judgment_as_prompt
from data_pipelines.synthetic import make_judgment_records
from data_pipelines.writers import write_records
from reward_models.verifiers import get_verifier
from vlrft.config import load_config
from vlrft.trainer.config import PolicyTrainConfig
from vlrft.trainer.preflight import preflight_policy
from vlrft.trainer.run import train_policy

RECIPE = Path(__file__).resolve().parents[1] / "configs" / "policy" / "judge_rl.yaml"


def _config(tmp_path, model, *overrides):
    return load_config(
        PolicyTrainConfig,
        [RECIPE],
        [
            f"model.path={model}",
            f"train.output_dir={tmp_path}",
            "logging.tensorboard=false",
            "logging.wandb=disabled",
            "logging.progress_bar=false",
            *overrides,
        ],
    )


def test_judgment_records_become_verifiable_prompts():
    recs = [judgment_as_prompt(r) for r in make_judgment_records("color", 4, 0, judge_mode="pairwise", paired=True)]
    assert [r.answer for r in recs] == ["A", "B", "A", "B"]  # each pair in both orders, side by side
    assert recs[0].images is recs[1].images or recs[0].images == recs[1].images
    assert recs[0].metadata["vocabulary"] == ["A", "B", "tie"] and recs[0].metadata["judge_mode"] == "pairwise"
    verdict, fmt = get_verifier("judge_verdict"), get_verifier("judge_format")
    meta = {"judge_mode": "pairwise"}
    assert verdict("<answer>A</answer>", "A", **meta).score == 1.0
    assert verdict("B", "A", **meta).score == 0.0 and fmt("B", "A", **meta).score == 1.0
    assert fmt("B", "A", **meta).format_ok is False and fmt("<answer>B</answer>", "A", **meta).format_ok
    assert fmt("nothing here", "A", **meta).score == 0.0


def test_preflight_checks_judgment_files_as_the_prompts_they_become(tiny_model, tmp_path):
    """A judgment file passes preflight as judgment records (not prompt records: those have no target),
    and a judgment whose target has no verdict is named with its file and line."""
    data = write_records(
        make_judgment_records("color", 8, 0, judge_mode="pairwise", paired=True, num_colors=2),
        tmp_path / "judgments.jsonl",
        image_dir=tmp_path / "images",
    )
    over = [f"data.train_source={data}", f"data.eval_source={data}", "rollout.rollout_batch_size=2"]
    cfg = _config(tmp_path / "run", tiny_model("qwen2_5_vl"), *over)
    reports = preflight_policy(cfg, world=1)
    assert (reports["data.train_source"].read, reports["data.train_source"].kept) == (8, 8)
    lines = data.read_text().splitlines()
    bad = json.loads(lines[2])
    bad["target"] = "no verdict here"
    data.write_text("\n".join([*lines[:2], json.dumps(bad), *lines[3:]]) + "\n")
    with pytest.raises(DataError, match=r"judgments.jsonl:3 .*has no <answer> verdict"):
        preflight_policy(cfg, world=1)


def test_train_policy_runs_on_judgment_records(tiny_model, tmp_path):
    cfg = _config(
        tmp_path,
        tiny_model("qwen2_5_vl"),
        "rollout.rollout_batch_size=2",
        "rollout.n_samples_per_prompt=4",
        "data.synthetic_train_size=8",
        "data.synthetic_eval_size=4",
        "train.max_steps=2",
        "train.eval_every=0",
    )
    summary = train_policy(cfg)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if "reward/verdict" in r)
    assert 0.0 <= step["reward/verdict"] <= step["reward/format"] <= 1.0  # a right verdict is a readable one
    assert summary["eval_before"]["num_prompts"] == 4


@pytest.mark.slow
def test_judge_rl_learns_verifiable_judgments(tiny_model, tmp_path):
    """Learning proof: held-out pointwise judgment accuracy (images never trained on) from chance or below
    (the random judge writes no verdict: 0) to >= 0.9 by RL alone, at every evaluation from step 400 on (not only
    the last). Whether a run leaves the plateaus at 0.5 and 0.75 depends on its trajectory (seed, and float
    rounding: docs/reward-models.md, Judge RL, lists runs that stay); the tests pin the CPU arithmetic to AVX2
    (tests/conftest.py) so that every machine follows the measured one. Measured 2026-11-26 (AMD EPYC, AVX2), this
    recipe (600 steps) at train.seed 0: 0 -> 0.75 (100, 200, 300) -> 1.0 (400, 500, 600), 545 s beside the default
    suite. (On an AVX-512 EPYC, unpinned, the same seed had gone 0 -> 1.0 from step 100.)"""
    cfg = _config(tmp_path, tiny_model("qwen2_5_vl"), "train.eval_every=100")
    summary = train_policy(cfg)
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    curve = {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}
    print(f"judge RL: held-out judgment accuracy by step {curve}")
    assert summary["eval_before"]["accuracy"] <= 0.6
    late = [acc for step, acc in curve.items() if step >= 400]
    assert len(late) >= 3 and min(late) >= 0.9
