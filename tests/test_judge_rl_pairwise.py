"""Pairwise judge RL from a short warm start (configs/policy/judge_rl_pairwise.yaml, docs/reward-models.md,
Judge RL): a judge SFT'd for 100 steps (configs/reward_model/grm_pairwise_color.yaml stopped early), then
train-policy on pairwise judgment records; held-out accuracy and position consistency by the project's
own evaluator (eval.reward_benchmarks.evaluate_benchmark: every pair judged in both orders)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch import QUIET

from data_pipelines.synthetic import make_preference_pairs
from data_pipelines.writers import write_records
from eval.reward_benchmarks import evaluate_benchmark
from vlrft.cli import main
from vlrft.config import load_config
from vlrft.trainer.config import PolicyTrainConfig
from vlrft.trainer.run import train_policy

REPO = Path(__file__).resolve().parents[1]
WARM = REPO / "configs" / "reward_model" / "grm_pairwise_color.yaml"
RECIPE = REPO / "configs" / "policy" / "judge_rl_pairwise.yaml"
# the recipe's warm start: one colour judged right in both orders, the other by position; its trajectory gave the
# same figures with the patch product's and the convolution's rounding (docs/reward-models.md)
WARM_STEPS, WARM_SEED = 100, 4
JUDGE_TOKENS = 24  # the rationale, the tagged verdict, the end token


def _judge(model: Path, pairs: Path) -> dict:
    m = evaluate_benchmark(model, str(pairs), layout="records", judge_mode="pairwise", max_new_tokens=JUDGE_TOKENS)
    return {k: m[k] for k in ("judgments", "unparsable") if k in m} | {
        k.split("/")[1]: m[k] for k in m if k.startswith("position_bias/")
    }


@pytest.mark.slow
def test_pairwise_judge_rl_improves_a_short_warm_start(tiny_model, tmp_path):
    """Learning proof: held-out accuracy (in each order) and position consistency >= 0.9 after RL, from a
    warm start below that; the RL run's own held-out judgment accuracy stays >= 0.9 at every evaluation from step
    20 on, not only at the last. Measured 2026-11-29 (AMD EPYC, one thread; the tests pin the CPU arithmetic to
    AVX2, tests/conftest.py): the 100-step warm start (seed 4, the judge's rationale) judges 0.75 of the RL held-out
    judgments and, on 64 pairs in both orders, order AB 1.0, order BA 0.5, consistency 0.5 (A in 0.75 of its
    verdicts: a position bias); RL held-out accuracy 0.75 (step 0), 1.0 (10, 20, 30); after RL AB 1.0, BA 1.0,
    consistency 1.0, A in 0.5 of verdicts, 0 unparsable. The same figures with the convolution's rounding; RL from
    other 0.75 warm starts is less sure (3 of 6 finished within 100 steps: docs/reward-models.md)."""
    warm = tmp_path / "warm"
    over = [f"model.path={tiny_model('qwen2_5_vl')}", f"train.output_dir={warm}"]
    over += [f"train.max_steps={WARM_STEPS}", f"train.seed={WARM_SEED}"]
    assert main(["train-reward-model", str(WARM), *over, *QUIET]) == 0
    pairs = write_records(make_preference_pairs("color", 64, seed=7, num_colors=2), tmp_path / "pairs.jsonl")
    before = _judge(warm / "final", pairs)
    rl = tmp_path / "rl"
    cfg = load_config(
        PolicyTrainConfig,
        [RECIPE],
        [f"model.path={warm / 'final'}", f"train.output_dir={rl}", *QUIET],
    )
    summary = train_policy(cfg)
    after = _judge(rl / "final", pairs)
    rows = [json.loads(x) for x in (rl / "metrics.jsonl").read_text().splitlines()]
    curve = {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}
    print(f"pairwise judge: warm start {before}\n  RL held-out accuracy by step {curve}\n  after RL {after}")
    assert summary["eval_before"]["accuracy"] < 0.9 and min(before["accuracy_order_ab"], before["consistency"]) < 0.9
    assert all(acc >= 0.9 for step, acc in curve.items() if step >= 20) and max(curve) >= 20
    assert after["accuracy_order_ab"] >= 0.9 and after["accuracy_order_ba"] >= 0.9
    assert after["consistency"] >= 0.9 and after["unparsable"] <= 6
