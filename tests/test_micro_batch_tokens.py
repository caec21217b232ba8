"""Token-budget micro-batches (``train.micro_batch_tokens``): how they are formed, and that they give the
same update as fixed micro-batches (gradients and the parameters after one AdamW step), for the policy
(group-shared and plain forward), PPO's critic, SFT and DPO."""

from __future__ import annotations

import pytest
import torch
from tolerance import assert_within

import vlrft.models  # noqa: F401
from data_pipelines.chat import chat_from_prompt
from data_pipelines.collate import encode_prompt
from data_pipelines.synthetic import make_preference_pairs, make_prompt_records
from reward_models.pool import RewardPool
from reward_models.scalar import ScalarRewardModel
from vlrft.config import load_config
from vlrft.micro_batching import PAD, budget_micro_batches, even_out, plan_micro_batches
from vlrft.models.loading import load_model
from vlrft.rollout import Rollout
from vlrft.strategies import make_strategy
from vlrft.supervised import train_step
from vlrft.trainer.config import PolicyTrainConfig
from vlrft.trainer.experience import group_rollouts, score_rollouts
from vlrft.trainer.policy_trainer import PolicyTrainer
from vlrft.trainer.supervised_config import DPOTrainConfig, SFTTrainConfig
from vlrft.trainer.supervised_run import DPOTask, SFTTask

# The bound of every comparison below (the 1e-6), in float32 rounding steps. Both updates sum the same
# float32 per-token terms (loss / the step's global token count) in another grouping: micro-batch by micro-batch,
# and inside a micro-batch through matmuls whose reductions run over its rows. Re-associating such a sum moves it
# by a few rounding steps (ulps) of its largest partial sums, which are of the gradient's own size: at most 2.1
# here (the critic's embedding; the policy's gradients stay below 0.4), where one ulp is 2.4e-7, so 1e-6 allows
# four. AdamW's first step moves a parameter by lr * g / (|g| + eps), whose slope in g is at most lr / eps = 1
# here (lr = eps = 1e-4), and the new value rounds to a float32 neighbour: parameters (|theta| <= 1.0001, ulp
# 1.2e-7) agree within 1e-6 too. Measured: one ulp at most (1.19e-7, a weight near 1 or a critic gradient
# near 2), often 0.
BOUND = 1e-6


def test_a_budget_fills_micro_batches_and_counts_a_packed_prompt_once():
    tokens = [5, 5, 5, 9, 2, 30]
    assert budget_micro_batches(tokens, 12) == [[0, 1], [2], [3, 4], [5]]  # 30 > 12 alone
    # packed: keys 0 0 1 1 0 (one prompt of 10 shared tokens each); a key's samples are kept together
    shared, keys = [10] * 5, [0, 0, 1, 1, 0]
    got = budget_micro_batches([3, 4, 3, 4, 2], 20, shared=shared, keys=keys)
    assert got == [[0, 1, 4], [2, 3]]  # 10 + 3 + 4 + 2 = 19; the second prompt 10 + 3 + 4 = 17


def test_even_out_splits_the_largest_then_pads():
    cost = lambda b: sum(b) + len(b)  # noqa: E731
    assert even_out([[1, 2, 3, 4]], 2, cost) == [[1, 2], [3, 4]]  # costs 5 and 9 of 14
    assert even_out([[7], [1, 2]], 4, cost) == [[7], [1], [2], PAD]
    single = make_strategy(load_config(PolicyTrainConfig, None, []).strategy)
    assert plan_micro_batches(single, [4, 4, 4], 8) == [[0, 1], [2]]  # one process: no evening out


def _rollouts(records, tok, samples: int) -> list[Rollout]:
    """Fixed responses of varied lengths (2 to 9 tokens): half name the answer."""
    out, g = [], torch.Generator().manual_seed(1)
    for gi, rec in enumerate(records):
        for j in range(samples):
            word = rec.answer if j % 2 == 0 else next(v for v in rec.metadata["vocabulary"] if v != rec.answer)
            tail = torch.randint(0, 900, (j + 2 * (gi % 3),), generator=g)
            ids = torch.cat([torch.tensor(tok(word)["input_ids"]), tail, torch.tensor([tok.eos_token_id])])
            out.append(Rollout(gi, ids, tok.decode(ids, skip_special_tokens=True), "stop"))
    return out


def _capture(strategy, model, grads: dict) -> None:
    """Keep the gradients the strategy is about to apply (``step`` clears them)."""
    step = strategy.step

    def keep_then_step():
        grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        return step()

    strategy.step = keep_then_step


def _policy_update(path, tmp_path, extra: list[str], critic: bool) -> tuple[dict, dict, int]:
    """One on-policy update on fixed samples: (gradients, parameters after it, micro-batches run)."""
    overrides = [
        "rollout.rollout_batch_size=4",
        "rollout.n_samples_per_prompt=4",
        "train.micro_train_batch_size=3",
        "optim.lr=1e-4",
        "optim.eps=1e-4",
        "strategy.grad_clip=0",
        "algorithm.loss_agg_mode=token-mean",
        f"train.output_dir={tmp_path}",
        *extra,
    ]
    if critic:
        overrides += ["algorithm.advantage_estimator=gae", "algorithm.std_normalization=none", "critic.lr=1e-4"]
    cfg = load_config(PolicyTrainConfig, None, overrides)
    strategy = make_strategy(cfg.strategy, cfg.optim)
    torch.manual_seed(0)
    model, proc = load_model(str(path))
    value_model = None
    if critic:
        value_model = (ScalarRewardModel.from_backbone(path, seed=3), make_strategy(cfg.strategy, cfg.optim))
    records = make_prompt_records("color", 4, seed=5)
    trainer = PolicyTrainer(
        cfg,
        strategy,
        model,
        proc,
        records,
        RewardPool(cfg.reward),
        accuracy=("accuracy", "vocab_answer"),
        critic=value_model,
    )
    rollouts = _rollouts(records, proc.tokenizer, 4)
    prompts = [encode_prompt(proc, r) for r in records]
    combined, per_source, _ = score_rollouts(trainer.reward_pool, records, rollouts, trainer.cfg.tools)
    exp = trainer.experience_from(group_rollouts(records, prompts, rollouts, combined, per_source), {})
    grads: dict = {}
    _capture(strategy, model, grads)
    if critic:
        _capture(value_model[1], value_model[0], critic_grads := {})
    calls = []
    forward = trainer._micro_loss
    trainer._micro_loss = lambda *a: calls.append(1) or forward(*a)  # counts the micro-batches
    metrics: dict = {}
    trainer.train_on(exp, metrics)
    assert all(v == v for v in metrics.values())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    if critic:
        grads.update({f"critic.{k}": v for k, v in critic_grads.items()})
        params.update({f"critic.{n}": p.detach().clone() for n, p in value_model[0].named_parameters()})
    return grads, params, len(calls)


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.mark.parametrize(
    "forward, critic",
    [("shared", False), ("plain", False), ("shared", True)],
    ids=["policy-shared-forward", "policy-plain-forward", "policy-and-critic"],
)
def test_a_token_budget_gives_the_policy_update_of_fixed_micro_batches(tiny_model, tmp_path, forward, critic):
    path = tiny_model("qwen2_5_vl")
    shared = [f"train.shared_prompt_forward={str(forward == 'shared').lower()}"]
    grads, params, fixed_calls = _policy_update(path, tmp_path / "fixed", shared, critic)
    # prompts of 43 tokens, responses of 2 to 9: packed, a prompt and 1 to 3 of its responses per micro-batch;
    # plain, 2 rows of 45 to 52 tokens
    budget = "train.micro_batch_tokens=55" if forward == "shared" else "train.micro_batch_tokens=120"
    grads_b, params_b, budget_calls = _policy_update(path, tmp_path / "budget", [*shared, budget], critic)
    assert fixed_calls == 6 and budget_calls not in (0, 6), budget_calls  # the cut differs from 16 / 3
    assert max(g.abs().max().item() for g in grads.values()) > 1e-4  # a real gradient
    assert_within(_max_diff(grads, grads_b), BOUND, f"{forward} critic={critic}: max |gradient difference|")
    assert_within(_max_diff(params, params_b), BOUND, f"{forward} critic={critic}: max |param difference|")


def _supervised_update(path, kind: str, extra: list[str]) -> tuple[dict, dict]:
    config = {"sft": SFTTrainConfig, "dpo": DPOTrainConfig}[kind]
    cfg = load_config(config, None, ["optim.lr=1e-4", "optim.eps=1e-4", "strategy.grad_clip=0", *extra])
    strategy = make_strategy(cfg.strategy, cfg.optim)
    torch.manual_seed(0)
    model, proc = load_model(str(path))
    strategy.prepare(model, total_steps=1)
    if kind == "sft":
        task = SFTTask(proc, cfg, strategy.device)
        prompts = make_prompt_records("color", 6, seed=2)
        records = [chat_from_prompt(r, " ".join([r.answer] * (1 + 3 * (i % 3)))) for i, r in enumerate(prompts)]
    else:
        ref, _, _ = strategy.prepare(load_model(str(path))[0], trainable=False)
        task = DPOTask(proc, cfg, strategy, ref)
        records = make_preference_pairs("color", 6, 2)
    grads: dict = {}
    _capture(strategy, model, grads)
    t = cfg.train
    metrics = train_step(strategy, task, records, t.micro_batch_size, micro_batch_tokens=t.micro_batch_tokens)
    assert metrics["loss"] == metrics["loss"]
    return grads, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind, budget", [("sft", 70), ("dpo", 120)])
def test_a_token_budget_gives_the_supervised_update_of_fixed_micro_batches(tiny_model, kind, budget):
    path = tiny_model("qwen2_5_vl")
    grads, params = _supervised_update(path, kind, ["train.micro_batch_size=2"])
    grads_b, params_b = _supervised_update(path, kind, [f"train.micro_batch_tokens={budget}"])
    assert max(g.abs().max().item() for g in grads.values()) > 1e-4
    assert_within(_max_diff(grads, grads_b), BOUND, f"{kind}: max |gradient difference|")
    assert_within(_max_diff(params, params_b), BOUND, f"{kind}: max |param difference|")
