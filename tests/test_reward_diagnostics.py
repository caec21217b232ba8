"""Reward-pool diagnostics: Kendall tau-b within groups, correlation with the verifier, the hacking alarm
(hand-computed values), and the keys in metrics.jsonl of a train-policy run with two neural sources and a
verifier."""

from __future__ import annotations

import json
import math

import pytest
import torch

from reward_models.diagnostics import (
    PoolDiagnostics,
    group_ids,
    hacking_alarm,
    kendall_tau_b,
    mean_group_tau,
    pearson,
    window_rise,
)
from reward_models.scalar import ScalarRewardModel
from vlrft.commands.train_policy import DEMO_CONFIG
from vlrft.config import load_config
from vlrft.models.loading import load_processor
from vlrft.trainer.config import PolicyTrainConfig
from vlrft.trainer.run import train_policy


def test_kendall_tau_b_hand_values():
    # one discordant pair of six: (5 - 1) / 6
    assert kendall_tau_b([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(4 / 6)
    # a tie in x: C = 2, D = 0, n0 = 3, n1 = 1, n2 = 0 -> 2 / sqrt(2 * 3)
    assert kendall_tau_b([1, 1, 2], [1, 2, 3]) == pytest.approx(2 / math.sqrt(6))
    assert kendall_tau_b([3, 2, 1], [1, 2, 3]) == pytest.approx(-1.0)
    assert math.isnan(kendall_tau_b([1, 1, 1], [1, 2, 3]))  # all ties: undefined
    assert math.isnan(kendall_tau_b([1], [2]))


def test_group_tau_averages_defined_groups():
    a = torch.tensor([1.0, 2.0, 3.0, 5.0, 5.0, 5.0, 1.0, 2.0])
    b = torch.tensor([1.0, 3.0, 2.0, 1.0, 2.0, 3.0, 2.0, float("nan")])
    groups = group_ids(["p", "p", "p", "q", "q", "q", "r", "r"])
    assert groups == [0, 0, 0, 1, 1, 1, 2, 2]
    # group p: C=2, D=1 -> 1/3; group q: a all tied (skipped); group r: one scored sample (skipped)
    assert mean_group_tau(a, b, groups) == pytest.approx(1 / 3)


def test_pearson_and_window_rise_hand_values():
    a, b = torch.tensor([0.0, 1.0, 2.0, 3.0]), torch.tensor([0.0, 0.0, 1.0, 1.0])
    assert pearson(a, b) == pytest.approx(2 / math.sqrt(5))  # sum xy = 2, sum x^2 = 5, sum y^2 = 1
    assert math.isnan(pearson(a, torch.ones(4)))
    assert window_rise([1, 2, 3, 4, 5]) == pytest.approx(3.0)  # (4 + 5) / 2 - (1 + 2) / 2
    assert hacking_alarm([0.1, 0.2, 0.5, 0.6], [0.8, 0.7, 0.4, 0.3], delta=0.05)
    assert not hacking_alarm([0.1, 0.2, 0.5, 0.6], [0.3, 0.4, 0.7, 0.8], delta=0.05)  # accuracy rose too
    assert not hacking_alarm([0.1, 0.1, 0.12, 0.12], [0.8, 0.7, 0.4, 0.3], delta=0.05)  # neural flat


def test_pool_diagnostics_alarm_fires_when_rm_rises_and_accuracy_falls():
    diag = PoolDiagnostics(["rm"], "acc", window=4, alarm_delta=0.05)
    keys = ["p", "p", "q", "q"]
    rows = []
    for rm, acc in [(0.1, 0.8), (0.2, 0.7), (0.5, 0.4), (0.6, 0.3)]:
        per_source = {
            "rm": torch.tensor([rm - 0.05, rm + 0.05, rm - 0.05, rm + 0.05]),
            "acc": torch.tensor([acc, acc, acc, acc]),
        }
        rows.append(diag.step(per_source, keys))
    assert [r["reward/diag/alarm/rm"] for r in rows] == [0.0, 0.0, 0.0, 1.0]  # only once the window is full
    assert rows[-1]["reward/diag/rise/rm"] == pytest.approx(0.4)
    assert rows[-1]["reward/diag/rise/accuracy"] == pytest.approx(-0.4)
    assert "reward/diag/kendall_tau/acc~rm" not in rows[-1]  # accuracy tied in every group: undefined, not logged
    assert "reward/diag/corr_accuracy/rm" not in rows[-1]  # constant accuracy: undefined


def test_diagnostics_in_metrics_jsonl_with_two_neural_sources_and_a_verifier(tiny_model, tmp_path):
    base = tiny_model("qwen2_5_vl")
    for seed in (1, 2):  # two untrained SRMs (different heads): two neural sources that disagree
        srm = ScalarRewardModel.from_backbone(base, seed=seed)
        srm.save_pretrained(tmp_path / f"srm{seed}", processor=load_processor(base))
    sources = (
        "[{name: accuracy, kind: verifier, verifier: vocab_answer},"
        f" {{name: rm1, kind: srm, path: {tmp_path / 'srm1'}, weight: 0.5}},"
        f" {{name: rm2, kind: srm, path: {tmp_path / 'srm2'}, weight: 0.5}}]"
    )
    cfg = load_config(
        PolicyTrainConfig,
        [DEMO_CONFIG],
        [
            f"model.path={base}",
            f"train.output_dir={tmp_path / 'run'}",
            f"reward.sources={sources}",
            "reward.diagnostics_window=2",
            "rollout.rollout_batch_size=2",
            "rollout.n_samples_per_prompt=4",
            "data.eval_source=''",
            "train.max_steps=2",
            "logging.tensorboard=false",
            "logging.wandb=disabled",
            "logging.progress_bar=false",
        ],
    )
    train_policy(cfg)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward_pool/reward/combined/mean" in r]
    assert len(steps) == 2
    for row in steps:
        tau = row["reward_pool/reward/diag/kendall_tau/rm1~rm2"]
        assert -1.0 <= tau <= 1.0
        assert row["reward_pool/reward/diag/alarm/rm1"] in (0.0, 1.0)
        assert row["reward_pool/reward/diag/alarm/rm2"] in (0.0, 1.0)
    assert "reward_pool/reward/diag/rise/rm1" in steps[-1]  # the window holds two steps at the second
    print({k: v for k, v in steps[-1].items() if "/diag/" in k})
