"""One update on fixed data, kept for comparison: the gradients a strategy applies and the parameters after them.
Tests that prove two ways of computing an update equal (token-budget micro-batches, compiled blocks) share these."""

from __future__ import annotations

import torch

from data_pipelines.collate import encode_prompt
from data_pipelines.synthetic import make_prompt_records
from reward_models.pool import RewardPool
from reward_models.scalar import ScalarRewardModel
from vlrft.config import load_config
from vlrft.models.loading import load_model
from vlrft.rollout import Rollout
from vlrft.strategies import make_strategy
from vlrft.trainer.config import PolicyTrainConfig
from vlrft.trainer.experience import group_rollouts, response_logprobs, score_rollouts
from vlrft.trainer.policy_trainer import PolicyTrainer


def fixed_rollouts(records, tok, samples: int) -> list[Rollout]:
    """Fixed responses of varied lengths (2 to 9 tokens): half name the answer."""
    out, g = [], torch.Generator().manual_seed(1)
    for gi, rec in enumerate(records):
        for j in range(samples):
            word = rec.answer if j % 2 == 0 else next(v for v in rec.metadata["vocabulary"] if v != rec.answer)
            tail = torch.randint(0, 900, (j + 2 * (gi % 3),), generator=g)
            ids = torch.cat([torch.tensor(tok(word)["input_ids"]), tail, torch.tensor([tok.eos_token_id])])
            out.append(Rollout(gi, ids, tok.decode(ids, skip_special_tokens=True), "stop"))
    return out


def capture_gradients(strategy, model, grads: dict) -> None:
    """Keep the gradients the strategy is about to apply (``step`` clears them)."""
    step = strategy.step

    def keep_then_step():
        grads.update({n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None})
        return step()

    strategy.step = keep_then_step


def policy_update(path, tmp_path, extra: list[str], critic: bool) -> tuple[dict, dict, int]:
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
    rollouts = fixed_rollouts(records, proc.tokenizer, 4)
    prompts = [encode_prompt(proc, r) for r in records]
    combined, per_source, _ = score_rollouts(trainer.reward_pool, records, rollouts, trainer.cfg.tools)
    exp = trainer.experience_from(group_rollouts(records, prompts, rollouts, combined, per_source), {})
    grads: dict = {}
    capture_gradients(strategy, model, grads)
    if critic:
        capture_gradients(value_model[1], value_model[0], critic_grads := {})
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


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def loss_gradients(model, batch, ids, mask, advantages, *, shared: bool, entropy_coef: float = 0.0) -> dict:
    """Every parameter's gradient of a policy-gradient loss over ``batch`` (token mean of ``-log p * advantage``,
    minus ``entropy_coef`` times the mean entropy) with the group-shared forward (``shared``) or the plain rows."""
    model.zero_grad()
    logp, ent = response_logprobs(model, batch, ids, with_entropy=entropy_coef > 0, shared=shared)
    loss = -(logp * advantages * mask).sum() / mask.sum()
    if entropy_coef > 0:
        loss = loss - entropy_coef * (ent * mask).sum() / mask.sum()
    loss.backward()
    return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
