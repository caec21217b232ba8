"""The reward pool: a rule verifier, an SRM and a GRM score one batch with documented values."""

from __future__ import annotations

import math

import pytest
import torch
from tolerance import assert_within

from data_pipelines.records import PromptRecord
from data_pipelines.synthetic import make_prompt_records
from reward_models.pool import PoolOutput, RewardPool, RewardPoolConfig, RewardSourceError, combine
from reward_models.scalar import ScalarRewardModel, score_responses
from vlrft.config import ConfigError, load_config
from vlrft.models.cpu_matmul import OneDNNLinear, onednn_available, use_onednn_linears
from vlrft.models.loading import load_processor


@pytest.fixture(scope="module")
def grm_dir(trained_judge):
    """A judge that answers yes for the candidate 'red', no otherwise (conftest)."""
    return trained_judge()


def _batch():
    """Six samples: four colour-task samples (two prompts x right/wrong answer) and two of another task."""
    colour = make_prompt_records("color", 2, seed=11, num_colors=2)
    other = PromptRecord(id="o", prompt="Name a colour.", answer="red", task="other")
    records = [colour[0], colour[0], colour[1], colour[1], other, other]
    wrong = {"red": "green", "green": "red"}
    responses = [colour[0].answer, wrong[colour[0].answer], colour[1].answer, wrong[colour[1].answer], "red", "blue"]
    return records, responses


def _pool_cfg(srm_dir, grm_dir, offload=True, **extra) -> RewardPoolConfig:
    return load_config(
        RewardPoolConfig,
        None,
        [
            "sources=[{name: exact, kind: verifier, verifier: exact_match, weight: 1.0},"
            f" {{name: srm, kind: srm, path: '{srm_dir}', weight: 0.5, micro_batch_size: 4}},"
            f" {{name: judge, kind: grm, path: '{grm_dir}', weight: 2.0, micro_batch_size: 3}}]",
            "recipes={color: {exact: 1.0, srm: 0.5, judge: 2.0}, default: {exact: 1.0}}",
            f"offload={str(offload).lower()}",
            "device=cpu",
        ]
        + [f"{k}={v}" for k, v in extra.items()],
    )


def test_three_sources_documented_values_and_offload(srm_dir, grm_dir):
    records, responses = _batch()
    pool = RewardPool(_pool_cfg(srm_dir, grm_dir, offload=True))
    out = pool.score(records, responses)
    assert isinstance(out, PoolOutput)
    nan = math.nan
    # exact_match: 1 for the right colour, 0 for the wrong one (the 'other' task too: its answer is red)
    assert out.per_source["exact"].tolist() == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    # the judge says yes exactly when the candidate is "red"; it does not apply to task 'other'
    judge = [1.0 if r == "red" else 0.0 for r in responses[:4]] + [nan, nan]
    assert out.per_source["judge"].tolist()[:4] == judge[:4] and math.isnan(out.per_source["judge"][4])
    # the SRM's values equal scoring the same conversations directly; NaN where the recipe leaves it out
    model, proc = ScalarRewardModel.from_pretrained(srm_dir), load_processor(srm_dir)
    direct = score_responses(
        model, proc, [(r.prompt, r.images, x, r.system) for r, x in zip(records[:4], responses[:4])]
    )
    # the pool's batches vs one call: float32 sums in another layout, ~1e-6 at worst (as tests/test_reward_models.py)
    assert_within((out.per_source["srm"][:4] - direct).abs().max(), 1e-5, "pool SRM values vs direct scoring")
    assert torch.isnan(out.per_source["srm"][4:]).all()
    # combined = 1.0 * exact + 0.5 * srm + 2.0 * judge on the colour task; exact alone on 'other'
    srm = direct.tolist()
    want = [out.per_source["exact"][i].item() + 0.5 * srm[i] + 2.0 * judge[i] for i in range(4)] + [1.0, 0.0]
    assert out.combined.tolist() == pytest.approx(want, abs=1e-5)
    assert out.metrics["reward/exact/mean"] == pytest.approx(0.5)
    assert out.metrics["reward/judge/n"] == 4 and out.metrics["reward/judge/unparsable"] == 0
    assert out.metrics["reward/combined/mean"] == pytest.approx(sum(want) / 6, abs=1e-5)
    # offload on: the neural models were moved to the device to score and back to CPU memory after
    for name in ("srm", "judge"):
        src = pool.sources[name]
        assert (src.n_loads, src.n_offloads, src.resident) == (1, 1, False)
        assert src.parameter_device.type == "cpu" and src.scored_on == ["cpu"]
    # offload off: same rewards, the models stay resident on the scoring device between calls
    resident = RewardPool(_pool_cfg(srm_dir, grm_dir, offload=False))
    for _ in range(2):
        again = resident.score(records, responses)
        for name in out.per_source:
            assert torch.equal(
                torch.nan_to_num(again.per_source[name], 7.0), torch.nan_to_num(out.per_source[name], 7.0)
            )
        assert torch.equal(again.combined, out.combined)
    for name in ("srm", "judge"):
        src = resident.sources[name]
        assert (src.n_loads, src.n_offloads, src.resident) == (1, 0, True)
    pool.close()
    resident.close()


def test_combine_matches_hand_values():
    per = {"a": torch.tensor([1.0, 0.0, 2.0]), "b": torch.tensor([0.5, math.nan, -1.0])}
    out = combine(per, [{"a": 1.0, "b": 2.0}, {"a": 3.0}, {"b": 0.25}])
    assert out.tolist() == [2.0, 0.0, -0.25]


def test_failing_source_raises_with_its_name_unless_a_fallback_is_set():
    records = [PromptRecord(id="x", prompt="2+2?", answer=None)] * 2  # gsm8k needs an answer: it fails
    cfg = load_config(RewardPoolConfig, None, ["sources=[{name: gsm, kind: verifier, verifier: gsm8k}]"])
    with pytest.raises(RewardSourceError, match="reward source 'gsm' \\(verifier\\) failed"):
        RewardPool(cfg).score(records, ["#### 4", "#### 5"])
    cfg = load_config(
        RewardPoolConfig,
        None,
        [
            "sources=[{name: gsm, kind: verifier, verifier: gsm8k, fallback: -1.0},"
            " {name: fmt, kind: verifier, verifier: format, weight: 0.5}]"
        ],
    )
    # with a fallback, failures on more than max_failure_share (0.5) of a step's samples still stop the run
    with pytest.raises(RewardSourceError, match="failed on record 'x'.* 2 of 2 samples failed this step"):
        RewardPool(cfg).score(records, ["#### 4", "#### 5"])
    cfg.sources[0].max_failure_share = 1.0
    out = RewardPool(cfg).score(records, ["#### 4", "<think>a</think> \\boxed{5}"])
    assert out.per_source["gsm"].tolist() == [-1.0, -1.0]
    assert out.metrics["reward/gsm/failures"] == 2
    fmt = out.per_source["fmt"].tolist()
    assert out.combined.tolist() == pytest.approx([-1.0 + 0.5 * fmt[0], -1.0 + 0.5 * fmt[1]])


def test_bad_pool_configs_are_refused():
    with pytest.raises(ConfigError, match="unknown sources"):
        load_config(RewardPoolConfig, None, ["sources=[{name: a, kind: verifier}]", "recipes={t: {b: 1.0}}"])
    with pytest.raises(ConfigError, match="reward.sources\\[0\\].path: empty; a srm source needs its model folder"):
        RewardPool(load_config(RewardPoolConfig, None, ["sources=[{name: a, kind: srm}]"]))
    with pytest.raises(ConfigError, match="unique"):
        load_config(RewardPoolConfig, None, ["sources=[{name: a, kind: verifier}, {name: a, kind: verifier}]"])
    with pytest.raises(ConfigError, match="not allowed"):
        load_config(RewardPoolConfig, None, ["sources=[{name: a, kind: prm}]"])


def test_verifier_options_and_per_sample_extra_reach_the_verifier():
    """length_penalty (DAPO eq. 13) with L_max 10, L_cache 4 and token lengths passed per sample."""
    cfg = load_config(
        RewardPoolConfig,
        None,
        [
            "sources=[{name: len, kind: verifier, verifier: length_penalty, weight: 0.5,"
            " verifier_options: {max_length: 10, cache_length: 4}}]"
        ],
    )
    records = [PromptRecord(id="x", prompt="q")] * 3
    pool = RewardPool(cfg)
    out = pool.score(records, ["a", "b", "c"], extra=[{"response_length": n} for n in (5, 8, 12)])
    assert out.per_source["len"].tolist() == [0.0, -0.5, -1.0]  # 0; (6 - 8) / 4; over L_max
    assert out.combined.tolist() == [0.0, -0.25, -0.5]
    with pytest.raises(ValueError, match="one each per sample"):
        pool.score(records, ["a", "b", "c"], extra=[{}])
    pool.close()


@pytest.mark.skipif(not onednn_available(), reason="this PyTorch has no oneDNN float32 linear kernel")
def test_the_pools_models_compute_by_onednn_when_the_policy_does(srm_dir):
    """``RewardPool(prepare_model=...)`` (the trainer passes ``strategy.compute_like_policy``): the scalar RM's linear
    layers compute by oneDNN on the CPU, and its scores are MKL's within 1e-5 (the same float32 model through
    reordered sums: a few ulps of scores of order 1; tests/test_cpu_matmul.py bounds the products)."""
    cfg = load_config(
        RewardPoolConfig, None, [f"sources=[{{name: srm, kind: srm, path: '{srm_dir}', weight: 1.0}}]", "device=cpu"]
    )
    records, responses = _batch()
    scores = {}
    for onednn in (False, True):
        pool = RewardPool(cfg, prepare_model=use_onednn_linears if onednn else None)
        layers = sum(isinstance(m, OneDNNLinear) for m in pool.sources["srm"].model.modules())
        assert (layers > 0) == onednn
        scores[onednn] = pool.score(records, responses).per_source["srm"]
    assert scores[False].std() > 0  # a real score per response
    gap = (scores[True] - scores[False]).abs().max().item()
    assert_within(gap, 1e-5, "scalar RM scores, oneDNN vs MKL linear layers")
