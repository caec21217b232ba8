"""Every ready recipe config runs train-policy end to end; a text-only Qwen2 on GSM8K-format records
goes through the same code path."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from vlrft.config import load_config
from vlrft.trainer.config import PolicyTrainConfig
from vlrft.trainer.run import train_policy

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "policy"
SMALL = [
    "data.synthetic_train_size=8",
    "data.synthetic_eval_size=4",
    "rollout.rollout_batch_size=2",
    "rollout.max_new_tokens=4",
    "train.max_steps=2",
    "train.eval_every=0",
    "logging.tensorboard=false",
    "logging.wandb=disabled",
    "logging.progress_bar=false",
    "optim.lr=1e-3",
]


def _check_run(out: Path, steps: int = 2) -> list[dict]:
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "reward/combined" in r]
    assert [r["step"] for r in train_rows] == list(range(1, steps + 1))
    for r in train_rows:
        for key in (
            "reward/combined",
            "entropy",
            "train/grad_norm",
            "train/loss",
            "policy/clip_fraction",
            "frac_reward_zero_std",
            "response_length/mean",
            "time/rollout",
            "time/update",
            "train/lr",
        ):
            assert key in r and math.isfinite(r[key]), key
    assert (out / "final" / "model.safetensors").is_file() and (out / "curves.png").is_file()
    assert (out / "config.yaml").is_file() and (out / "samples.jsonl").is_file()
    return train_rows


@pytest.mark.parametrize("recipe", sorted(p.stem for p in CONFIGS.glob("*.yaml")))
def test_recipe_runs(recipe, tiny_model, tmp_path):
    if recipe == "async":  # an overlay for torchrun: tests/test_async_rl.py runs it on the demo with 3 processes
        pytest.skip("configs/policy/async.yaml runs under torchrun (tests/test_async_rl.py)")
    extra = ["train.train_batch_size=8"] if recipe == "gspo" else []  # several updates per rollout batch
    if recipe.startswith("opd"):  # distillation from a teacher of the policy's tokenizer (here: a smaller tiny model)
        extra = [f"teacher.path={tiny_model('qwen2_5_vl', hidden=32)}"]
    cfg = load_config(
        PolicyTrainConfig,
        CONFIGS / f"{recipe}.yaml",
        [f"model.path={tiny_model('qwen2_5_vl')}", f"train.output_dir={tmp_path}", *SMALL, *extra],
    )
    summary = train_policy(cfg)
    rows = _check_run(tmp_path)
    assert summary["steps"] == 2
    if cfg.algorithm.kl_coef > 0:
        assert all("kl" in r for r in rows)  # the reference model exists only when a KL term is on
    if cfg.algorithm.estimator.critic:  # PPO with GAE: the critic trains and is checkpointed
        assert all(math.isfinite(r["critic/loss"]) and "critic/grad_norm" in r for r in rows)
        assert (tmp_path / "critic_checkpoints" / "step-000002" / "COMPLETE").is_file()
    if cfg.algorithm.dynamic_sampling:
        assert all(r["dynamic_sampling/tries"] >= 1 for r in rows)
    if cfg.teacher.enabled:  # the teacher scored every step's tokens; the policy is not its own teacher here
        assert all(abs(r["distill/reverse_kl"]) > 1e-4 and r["time/teacher"] > 0 for r in rows)
    if cfg.teacher.per_token == "vocabulary":  # the exact reverse KL is the update's term; no sampled advantage
        assert all(r["distill/vocabulary_reverse_kl"] > 1e-4 and r["advantages/abs_mean"] == 0 for r in rows)


def test_text_only_qwen2_on_gsm8k_records(tiny_model, tmp_path, shared_data):
    from data_pipelines.converters import convert_gsm8k
    from data_pipelines.writers import write_records

    records, _ = convert_gsm8k(shared_data / "gsm8k" / "test.jsonl", split="test")
    records = records[:8]
    data = write_records(records, tmp_path / "gsm8k.jsonl")
    cfg = load_config(
        PolicyTrainConfig,
        None,
        [
            f"model.path={tiny_model('qwen2')}",
            f"train.output_dir={tmp_path / 'run'}",
            f"data.train_source={data}",
            f"data.eval_source={data}",
            "data.prompt_template=gsm8k",
            "reward.sources=[{name: accuracy, verifier: gsm8k}]",
            *SMALL,
            "logging.tensorboard=true",
            "logging.wandb=offline",
        ],
    )
    hooks = sys.exit, sys.excepthook
    summary = train_policy(cfg)
    assert (sys.exit, sys.excepthook) == hooks  # wandb replaces both; the run puts them back for what runs next
    _check_run(tmp_path / "run")
    assert list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert summary["eval_before"]["num_prompts"] == 8 and summary["eval_after"]["accuracy"] == 0.0
