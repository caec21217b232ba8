"""Token-budget micro-batches (``train.micro_batch_tokens``): how they are formed, and that they give the
same update as fixed micro-batches (gradients and the parameters after one AdamW step), for the policy
(group-shared and plain forward), PPO's critic, SFT and DPO."""

from __future__ import annotations

import pytest
import torch
from tolerance import assert_within
from updates import capture_gradients, max_diff, policy_update

import vlrft.models  # noqa: F401
from data_pipelines.chat import chat_from_prompt
from data_pipelines.synthetic import make_preference_pairs, make_prompt_records
from vlrft.config import load_config
from vlrft.micro_batching import PAD, budget_micro_batches, even_out, plan_micro_batches
from vlrft.models.loading import load_model
from vlrft.strategies import make_strategy
from vlrft.supervised import train_step
from vlrft.trainer.config import PolicyTrainConfig
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


@pytest.mark.parametrize(
    "forward, critic",
    [("shared", False), ("plain", False), ("shared", True)],
    ids=["policy-shared-forward", "policy-plain-forward", "policy-and-critic"],
)
def test_a_token_budget_gives_the_policy_update_of_fixed_micro_batches(tiny_model, tmp_path, forward, critic):
    path = tiny_model("qwen2_5_vl")
    shared = [f"train.shared_prompt_forward={str(forward == 'shared').lower()}"]
    grads, params, fixed_calls = policy_update(path, tmp_path / "fixed", shared, critic)
    # prompts of 43 tokens, responses of 2 to 9: packed, a prompt and 1 to 3 of its responses per micro-batch;
    # plain, 2 rows of 45 to 52 tokens
    budget = "train.micro_batch_tokens=55" if forward == "shared" else "train.micro_batch_tokens=120"
    grads_b, params_b, budget_calls = policy_update(path, tmp_path / "budget", [*shared, budget], critic)
    assert fixed_calls == 6 and budget_calls not in (0, 6), budget_calls  # the cut differs from 16 / 3
    assert max(g.abs().max().item() for g in grads.values()) > 1e-4  # a real gradient
    assert_within(max_diff(grads, grads_b), BOUND, f"{forward} critic={critic}: max |gradient difference|")
    assert_within(max_diff(params, params_b), BOUND, f"{forward} critic={critic}: max |param difference|")


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
        records = make_preference_pairs("color", 6, 2)
        task = DPOTask(proc, cfg, strategy, ref, records)
    grads: dict = {}
    capture_gradients(strategy, model, grads)
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
    assert_within(max_diff(grads, grads_b), BOUND, f"{kind}: max |gradient difference|")
    assert_within(max_diff(params, params_b), BOUND, f"{kind}: max |param difference|")
