"""PPO's critic: GAE advantages from its values, and its value loss falls as it fits the returns."""

from __future__ import annotations

import torch
from tolerance import assert_within

import vlrft.models  # noqa: F401
from data_pipelines.collate import encode_prompt
from data_pipelines.synthetic import make_prompt_records
from reward_models.pool import RewardPool
from reward_models.scalar import ScalarRewardModel
from vlrft.config import load_config
from vlrft.models.loading import load_model
from vlrft.rollout import Rollout
from vlrft.strategies import make_strategy
from vlrft.trainer.config import PolicyTrainConfig
from vlrft.trainer.experience import group_rollouts, score_rollouts
from vlrft.trainer.policy_trainer import PolicyTrainer


def test_critic_fits_returns_and_gae_uses_its_values(tiny_model, tmp_path):
    path = tiny_model("qwen2_5_vl")
    cfg = load_config(
        PolicyTrainConfig,
        None,
        [
            "algorithm.advantage_estimator=gae",
            "algorithm.lam=0.95",
            "algorithm.std_normalization=none",
            "rollout.rollout_batch_size=4",
            "rollout.n_samples_per_prompt=2",
            "optim.lr=1e-4",
            "critic.lr=1e-3",
            "algorithm.value_clip=0",
            f"train.output_dir={tmp_path}",
        ],
    )
    strategy = make_strategy(cfg.strategy, cfg.optim)
    model, proc = load_model(str(path))
    critic = (ScalarRewardModel.from_backbone(path), make_strategy(cfg.strategy, cfg.optim.__class__(lr=cfg.critic.lr)))
    records = make_prompt_records("color", 4, seed=3)
    trainer = PolicyTrainer(
        cfg,
        strategy,
        model,
        proc,
        records,
        RewardPool(cfg.reward),
        accuracy=("accuracy", "vocab_answer"),
        critic=critic,
    )
    tok = proc.tokenizer
    rollouts = []
    for i, rec in enumerate(records):
        for j in range(2):
            word = rec.answer if j == 0 else "nothing"
            ids = torch.tensor(tok(word)["input_ids"] + [7, 8][: i % 2 + 1] + [tok.eos_token_id])
            rollouts.append(Rollout(i, ids, tok.decode(ids, skip_special_tokens=True), "stop"))
    prompts = [encode_prompt(proc, r) for r in records]
    combined, per_source, _ = score_rollouts(trainer.reward_pool, records, rollouts, trainer.cfg.tools)
    assert combined.tolist() == [1.0, 0.0] * 4
    exp = trainer.experience_from(group_rollouts(records, prompts, rollouts, combined, per_source), {})
    m = exp.response_mask.bool()
    # GAE with gamma 1, lam 0.95 and terminal reward r: returns = A + V, advantages from the critic's values
    # identities of the float32 GAE recursion over <= 6 tokens of O(1) values: a few ulps (~1e-6) at worst
    assert_within((exp.returns[m] - (exp.advantages + exp.values)[m]).abs().max(), 1e-5, "GAE returns = A + V")
    last = m.sum(1) - 1
    rows = torch.arange(len(last))
    terminal = (exp.advantages[rows, last] - (combined - exp.values[rows, last])).abs().max()
    assert_within(terminal, 1e-5, "GAE terminal advantage = r - V")
    losses = []
    for _ in range(8):
        metrics: dict = {}
        trainer.train_on(exp, metrics)
        losses.append(metrics["critic/loss"])
    assert losses[-1] < 0.5 * losses[0], losses
