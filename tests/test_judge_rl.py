"""Judge RL: train-policy trains a pointwise judge on judgment records whose verdict is verifiable
(data.record_kind=judgment, verifiers judge_verdict + judge_format, configs/policy/judge_rl.yaml)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch import QUIET

from data_pipelines.errors import DataError
from data_pipelines.formatting import judgment_as_prompt
from data_pipelines.synthetic import make_judgment_records
from data_pipelines.writers import write_records
from reward_models.verifiers import get_verifier
from vlrft.cli import main
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
            *QUIET,
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


FORMAT = Path(__file__).resolve().parents[1] / "configs" / "reward_model" / "grm_judge_format.yaml"
AFTER_FORMAT = [  # judge RL after the format-only warm start (configs/reward_model/grm_judge_format.yaml)
    "rollout.max_new_tokens=12",  # <answer>yes</answer> and its end token
    "algorithm.kl_coef=0.1",  # to the warm start: both verdicts stay sampled in every cell while RL separates them
    "algorithm.entropy_coef=0",
    # a sum over the response's tokens, not their mean (the verdict is one token of ten): with the mean, seed 3 stayed
    # at 0.5 for 300 steps; and 1e-3, not 2e-3, where seed 1 never told the cells apart (docs/reward-models.md)
    "algorithm.loss_agg_mode=seq-mean-token-sum",
    "optim.lr=1e-3",
    "train.max_steps=300",
    "train.eval_every=25",
]


@pytest.mark.slow
def test_judge_rl_after_a_format_only_warm_start_learns_verifiable_judgments(tmp_path):
    """Learning proof: held-out pointwise judgment accuracy (64 judgments of images never trained on) from chance
    to >= 0.9 by RL alone, at the last three evaluations (not only the last). The warm start is a GRM trained on
    judge RL's own judgments with coin-flip answers (``random_answers``), so it writes a tagged verdict and knows
    nothing of which is right. Measured (Intel Xeon, the tests' AVX2 pins; docs/reward-models.md, Judge RL): 1.0 from
    step 75, 100, 125, 200 and 125 to 300 on seeds 0-4, from 100 on seeds 0 and 1 under MKL_CBWR=COMPATIBLE."""
    fmt = tmp_path / "format"
    assert main(["train-reward-model", str(FORMAT), f"train.output_dir={fmt}", *QUIET]) == 0
    rl = tmp_path / "rl"
    args = ["train-policy", str(RECIPE), f"model.path={fmt / 'final'}", *AFTER_FORMAT, f"train.output_dir={rl}"]
    assert main([*args, *QUIET]) == 0
    rows = [json.loads(x) for x in (rl / "metrics.jsonl").read_text().splitlines()]
    curve = {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}
    print(f"judge RL: held-out judgment accuracy by step {curve}")
    assert curve[0] <= 0.6, curve  # the warm start's verdicts are coin flips (measured 0.25)
    assert min(curve[250], curve[275], curve[300]) >= 0.9, curve
    assert not [r["step"] for r in rows if r.get("alarm/answer_collapse") == 1.0 and r["step"] >= 200]
    fmt_ok = get_verifier("judge_format")
    last = [json.loads(x) for x in (rl / "samples.jsonl").read_text().splitlines()][-8:]
    assert all(fmt_ok(s["response"], s["answer"], judge_mode="pointwise").format_ok for s in last), last
