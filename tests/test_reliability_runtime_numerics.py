"""The non-finite guard (issue 11, item 1): a step with a NaN/inf loss, gradient norm, reward, advantage or
AdamW update is skipped with parameters and optimizer state bitwise unchanged, counted, and after
``train.max_nonfinite_steps`` in a row the run stops naming the step and the quantity; no checkpoint or
export ever holds a non-finite weight."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForImageTextToText

from reward_models.config import RewardModelTrainConfig
from vlrft.config import load_config
from vlrft.errors import KnownError, NonFiniteError, RunFolderError
from vlrft.nonfinite import NonFiniteGuard
from vlrft.strategies import OptimConfig, StrategyConfig, make_strategy
from vlrft.trainer.config import PolicyTrainConfig
from vlrft.trainer.reward_model_run import train_reward_model
from vlrft.trainer.run import train_policy

sys.path.insert(0, str(Path(__file__).resolve().parent / "dist"))
import skip_step  # noqa: E402  (the same check runs under torchrun for fsdp2 and deepspeed)


def test_nonfinite_loss_step_leaves_params_and_adamw_state_bitwise_unchanged(tiny_model):
    report = skip_step.check(str(tiny_model("qwen2_5_vl")), "single")
    assert report["skipped"] and report["quantity"] == "loss"
    assert report["bitwise_unchanged"] and report["optim_tensors"] > 0  # moments and step counts compared
    assert report["lr_unchanged"] and report["next_step_applies"]


def _strategy(model_dir: Path, **optim):
    strategy = make_strategy(StrategyConfig(grad_clip=1.0), OptimConfig(lr=1e-3, **optim))
    torch.manual_seed(0)
    strategy.prepare(AutoModelForImageTextToText.from_pretrained(model_dir), total_steps=4)
    return strategy


def _loss(strategy, scale: float = 1.0):
    ids = torch.tensor([[5, 6, 7, 8]])
    return strategy.train_module(input_ids=ids, labels=ids).loss * scale


def test_infinite_gradient_with_finite_loss_is_skipped_as_grad_norm(tiny_model):
    s = _strategy(tiny_model("qwen2_5_vl"))
    before = {k: v.clone() for k, v in s.model.state_dict().items()}
    s.backward(_loss(s))
    next(p for p in s.model.parameters() if p.grad is not None).grad[0] = float("inf")
    norm = s.step()
    assert norm == float("inf") and s.last_step_skipped and s.nonfinite_quantity == "grad_norm"
    assert all(torch.equal(before[k], v) for k, v in s.model.state_dict().items())
    assert s.optimizer.state == {} and all(p.grad is None for p in s.model.parameters())
    s.backward(_loss(s))
    s.step()
    assert not s.last_step_skipped and s.nonfinite_quantity is None


def test_adamw_with_eps_zero_and_a_zero_gradient_writes_nan_so_the_step_is_skipped(tiny_model):
    # the reference: torch's AdamW divides 0 by sqrt(0) + 0 for an element with zero gradient
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0], dtype=torch.float64))
    opt = torch.optim.AdamW([p], lr=0.1, eps=0.0)
    p.grad = torch.tensor([0.5, 0.0], dtype=torch.float64)
    opt.step()
    assert torch.isfinite(p[0]) and torch.isnan(p[1])

    s = _strategy(tiny_model("qwen2_5_vl"), eps=0.0)
    before = {k: v.clone() for k, v in s.model.state_dict().items()}
    s.backward(_loss(s))  # unused embedding rows and the vision tower get zero gradients
    s.step()
    assert s.last_step_skipped and "optim.eps=0" in s.nonfinite_quantity
    assert all(torch.equal(before[k], v) for k, v in s.model.state_dict().items())


def test_guard_counts_skips_resets_on_a_good_step_and_stops_after_n_in_a_row():
    class Verdict:  # what a strategy reports after step(); the guard reads only these two fields
        last_step_skipped, nonfinite_quantity = True, "grad_norm"

        def all_reduce(self, t, op):
            return t

    guard = NonFiniteGuard(max_consecutive=3)
    assert not guard.values_finite(Verdict(), rewards=torch.tensor([0.0, float("nan")]), advantages=None)
    assert guard.end_step(1) == {"train/nonfinite_skipped": 1.0}
    assert guard.values_finite(Verdict(), rewards=torch.zeros(2), advantages=torch.zeros(2))
    assert guard.end_step(2) == {"train/nonfinite_skipped": 1.0} and guard.consecutive == 0
    guard.observe(Verdict())
    guard.end_step(3)
    guard.observe(Verdict())
    guard.end_step(4)
    guard.observe(Verdict())
    with pytest.raises(NonFiniteError, match=r"step 5: grad_norm was NaN or infinite for 3 consecutive steps"):
        guard.end_step(5)
    assert guard.skipped == 4


def test_any_nonfinite_finds_nan_and_infinities_and_only_them():
    """``any_nonfinite`` (the weights' check after each step and before each write): a NaN, +inf or -inf element in
    any tensor of a list is found, in float32 and bf16 and in a tensor of one element; tensors whose absolute sum
    overflows (3e38 + 3e38 in float32) while every element is finite are not flagged; empty tensors are skipped."""
    from vlrft.strategies.numerics import any_nonfinite

    g = torch.Generator().manual_seed(0)
    finite = [torch.randn(5, 7, generator=g), torch.randn(3, generator=g).bfloat16(), torch.zeros(0), torch.ones(1)]
    assert not any_nonfinite(finite) and not any_nonfinite([])
    assert not any_nonfinite([torch.full((2,), 3e38), torch.tensor([-3e38, -3e38]), *finite])  # sums overflow
    for bad in (float("nan"), float("inf"), float("-inf")):
        for i in (0, 1, 3):
            tensors = [t.clone() for t in finite]
            tensors[i].view(-1)[-1] = bad
            assert any_nonfinite(tensors), (bad, i)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_checkpoint_and_export_refuse_nonfinite_weights_and_write_nothing(tiny_model, tmp_path, bad):
    s = _strategy(tiny_model("qwen2_5_vl"))
    s.require_finite_weights("before")  # finite weights pass
    with torch.no_grad():  # one element of the last parameter
        last = list(s.model.parameters())[-1]
        last.view(-1)[-1] = bad
    with pytest.raises(NonFiniteError, match="when saving checkpoint .*step-000001") as err:
        s.save_checkpoint(tmp_path / "checkpoints" / "step-000001", {"step": 1})
    assert isinstance(err.value, KnownError)
    with pytest.raises(NonFiniteError, match="when exporting to .*final"):
        s.save_pretrained(tmp_path / "final")
    assert list(tmp_path.iterdir()) == []


def _cfg(model_dir: Path, out: Path, *extra: str) -> PolicyTrainConfig:
    return load_config(
        PolicyTrainConfig,
        None,
        [
            f"model.path={model_dir}",
            f"train.output_dir={out}",
            "data.eval_source=''",
            "data.synthetic_train_size=8",
            "rollout.rollout_batch_size=2",
            "rollout.n_samples_per_prompt=2",
            "rollout.max_new_tokens=3",
            "train.micro_train_batch_size=4",
            "train.save_every=1",
            "train.keep_last=5",
            "train.max_nonfinite_steps=2",
            "logging.tensorboard=false",
            "logging.wandb=disabled",
            "logging.progress_bar=false",
            *extra,
        ],
    )


def _written_weights_finite(out: Path) -> int:
    """Every checkpoint and export under ``out`` holds finite weights; returns how many were checked."""
    n = 0
    for state in out.glob("checkpoints/*/state.pt"):
        model = torch.load(state, weights_only=False)["model"]
        assert all(torch.isfinite(v).all() for v in model.values() if v.is_floating_point()), state
        n += 1
    for st in out.rglob("*.safetensors"):
        if "initial-model" not in st.parts:
            assert all(torch.isfinite(v).all() for v in load_file(st).values()), st
            n += 1
    return n


def test_eps_zero_with_equal_rewards_stops_without_writing_nan(tiny_model, tmp_path):
    out = tmp_path / "run"
    # the random tiny model answers no prompt right: every group's rewards are equal (zero advantages)
    cfg = _cfg(tiny_model("qwen2_5_vl"), out, "optim.eps=0", "train.max_steps=4")
    with pytest.raises(NonFiniteError) as err:
        train_policy(cfg)
    msg = str(err.value)
    assert msg.startswith("step 2: optimizer_update (optim.eps=0") and "train.max_nonfinite_steps=2" in msg
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/nonfinite_skipped"] for r in rows] == [1.0]  # step 1 skipped and counted; step 2 stopped
    assert not (out / "final").exists()
    assert _written_weights_finite(out) == 1  # the checkpoint of step 1: the untouched initial weights


def test_absurd_learning_rate_stops_and_keeps_written_weights_finite(tiny_model, tmp_path):
    out = tmp_path / "run"
    with pytest.raises(NonFiniteError) as err:
        # the entropy bonus gives a gradient even when every reward is equal
        cfg = _cfg(tiny_model("qwen2_5_vl"), out, "optim.lr=1e36", "algorithm.entropy_coef=0.01", "train.max_steps=6")
        train_policy(cfg)
    assert str(err.value).startswith("step 2: the policy's next-token probabilities are NaN or infinite")
    assert not (out / "final").exists()
    assert _written_weights_finite(out) >= 1
    assert not any(p.name.endswith(".tmp") for p in (out / "checkpoints").iterdir())


def test_reward_model_trainer_skips_counts_and_stops_on_nonfinite_steps(tiny_model, tmp_path):
    out = tmp_path / "rm"
    cfg = load_config(
        RewardModelTrainConfig,
        None,
        [
            f"model.path={tiny_model('qwen2_5_vl')}",
            f"train.output_dir={out}",
            "train.max_steps=6",
            "train.batch_size=2",
            "data.synthetic_train_size=8",
            "data.synthetic_eval_size=2",
            "train.eval_every=0",
            "train.log_every=1",
            "train.save_every=1",
            "train.max_nonfinite_steps=2",
            "optim.lr=1e36",
            "logging.tensorboard=false",
            "logging.wandb=disabled",
            "logging.progress_bar=false",
        ],
    )
    with pytest.raises(NonFiniteError, match=r"step \d: (loss|grad_norm) was NaN or infinite for 2 consecutive"):
        train_reward_model(cfg)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    skipped = [r["train/nonfinite_skipped"] for r in rows if "train/loss" in r]
    assert skipped[0] == 0.0 and skipped[-1] == 1.0  # step 1 applied; the step before the stop skipped
    assert not (out / "model").exists()
    assert _written_weights_finite(out) >= 1
    with pytest.raises(RunFolderError, match="holds another run's outputs"):  # the same entry point
        train_reward_model(replace(cfg, train=replace(cfg.train, resume="never")))
