"""A pairwise judge in the reward pool: per-sample win rates against the group, and what `debias: swap`
does to a judge with pure position bias (one SFT-trained to always answer A): hand-computed scores."""

from __future__ import annotations

from data_pipelines.synthetic import make_prompt_records
from reward_models.pool import RewardPool, RewardPoolConfig
from vlrft.config import load_config


def _pool(judge, **options) -> RewardPool:
    extra = ", ".join(f"{k}: {v}" for k, v in options.items())
    return RewardPool(
        load_config(
            RewardPoolConfig,
            None,
            [f"sources=[{{name: pj, kind: grm, path: '{judge}', judge_mode: pairwise, max_new_tokens: 12, {extra}}}]"],
        )
    )


def test_pairwise_judge_scores_a_group_and_swap_removes_position_bias(always_a_judge):
    prompt = make_prompt_records("color", 2, seed=9, num_colors=2)
    records = [prompt[0]] * 3 + [prompt[1]] * 2  # two groups: 3 and 2 samples
    responses = ["red", "green", "blue", "red", "green"]
    out = _pool(always_a_judge, debias="none").score(records, responses)
    # always A = the earlier sample wins: group 1 pairs (0,1), (0,2), (1,2) -> 0 wins twice, 1 once, 2 never
    assert out.per_source["pj"].tolist() == [1.0, 0.5, 0.0, 1.0, 0.0]
    assert out.metrics["reward/pj/unparsable"] == 0.0
    # with swap every pair is asked both ways: A in one order, A in the other -> a tie everywhere
    swapped = _pool(always_a_judge, debias="swap").score(records, responses)
    assert swapped.per_source["pj"].tolist() == [0.5] * 5
    # against the reference answer (the response shown as A): always preferred
    against = _pool(always_a_judge, pairwise_against="reference").score(records, responses)
    assert against.per_source["pj"].tolist() == [1.0] * 5
