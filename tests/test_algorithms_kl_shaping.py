"""KL estimators and controllers, reward shaping, dynamic sampling."""

import math

import pytest
import torch

from vlrft.algorithms.dynamic_sampling import (
    DynamicSamplingExhausted,
    filter_zero_variance_groups,
    more_prompts_needed,
)
from vlrft.algorithms.kl import AdaptiveKLController, FixedKLController, apply_kl_penalty, kl_penalty
from vlrft.algorithms.shaping import RunningRewardNormalizer, clip_rewards, combine_rewards, overlong_penalty
from vlrft.config import ConfigError, load_config
from vlrft.trainer.config import PolicyTrainConfig

F64 = torch.float64


# ---------------------------------------------------------------- KL


def test_kl_estimators_hand_computed():
    # pi = 0.5, ref = 0.25: k1 = ln 2 ; k2 = (ln 2)^2 / 2 ; k3 = r - 1 - ln r with r = ref/pi = 0.5
    lp, ref = torch.tensor([[math.log(0.5)]], dtype=F64), torch.tensor([[math.log(0.25)]], dtype=F64)
    assert kl_penalty(lp, ref, "k1").item() == pytest.approx(math.log(2), abs=1e-12)
    assert kl_penalty(lp, ref, "k2").item() == pytest.approx(math.log(2) ** 2 / 2, abs=1e-12)
    assert kl_penalty(lp, ref, "k3").item() == pytest.approx(0.5 - 1 - math.log(0.5), abs=1e-12)  # 0.19315
    assert kl_penalty(lp, ref, "low_var_kl").item() == kl_penalty(lp, ref, "k3").item()  # verl's name
    with pytest.raises(ValueError, match="unknown kl_estimator 'k4'"):
        kl_penalty(lp, ref, "k4")


def test_k1_and_k3_are_unbiased_for_the_exact_kl():
    """Float64 reference: the expectation under pi of k1 and k3 over the whole vocabulary is KL(pi || ref)."""
    g = torch.Generator().manual_seed(0)
    logp = torch.log_softmax(torch.randn(4, 9, generator=g, dtype=F64), -1)
    logref = torch.log_softmax(torch.randn(4, 9, generator=g, dtype=F64), -1)
    exact = [sum(math.exp(a) * (a - b) for a, b in zip(logp[i].tolist(), logref[i].tolist())) for i in range(4)]
    for est in ("k1", "k3"):
        expectation = (logp.exp() * kl_penalty(logp, logref, est)).sum(-1)
        assert expectation.tolist() == pytest.approx(exact, abs=1e-12)
    assert (kl_penalty(logp, logref, "k3") >= 0).all() and (kl_penalty(logp, logref, "k2") >= 0).all()


def test_kl_gradcheck_and_extreme_ratio_is_finite():
    g = torch.Generator().manual_seed(1)
    lp = torch.randn(2, 3, generator=g, dtype=F64, requires_grad=True)
    ref = torch.randn(2, 3, generator=g, dtype=F64)
    for est in ("k1", "k2", "k3"):
        assert torch.autograd.gradcheck(lambda x: kl_penalty(x, ref, est), (lp,))
    far = kl_penalty(torch.tensor([-200.0]), torch.tensor([0.0]), "k3")
    assert torch.isfinite(far).all()


def test_k3_bounded_by_kl_max_as_verl_and_openrlhf_bound_it():
    """``algorithm.kl_max`` (verl's low_var_kl and OpenRLHF's k3 clamp at 10): below the bound k3 and its gradient
    are unchanged (float64 reference: d k3 / d log pi = 1 - ref / pi); above it the value is the bound and the
    token gives no gradient; 0 leaves k3 unbounded."""
    lp = torch.tensor([math.log(0.5), math.log(1e-6), math.log(0.9)], dtype=F64, requires_grad=True)
    ref = torch.tensor([math.log(0.25), math.log(0.5), math.log(1e-7)], dtype=F64)
    bounded = kl_penalty(lp, ref, "k3", max_value=10.0)
    (grad,) = torch.autograd.grad(bounded.sum(), lp)
    r = [0.5, 0.5 / 1e-6, 1e-7 / 0.9]
    k3 = [x - 1 - math.log(x) for x in r]  # 0.193, 5e5 (above 10), 15.0 (above 10: pi 9e6 x ref)
    assert bounded.tolist() == pytest.approx([k3[0], 10.0, 10.0], abs=1e-12)
    assert grad.tolist() == pytest.approx([1 - r[0], 0.0, 0.0], abs=1e-12)
    assert kl_penalty(lp, ref, "k3", max_value=0.0).tolist() == pytest.approx(k3, rel=1e-12)
    # a bound the chosen estimator would not read is refused, not ignored
    with pytest.raises(ConfigError) as e:
        load_config(PolicyTrainConfig, None, ["algorithm.kl_max=10", "algorithm.kl_estimator=k1"])
    assert (
        str(e.value) == "algorithm.kl_max=10.0: bounds the k3 estimator only, not algorithm.kl_estimator=k1; leave it 0"
    )


def test_apply_kl_penalty_hand_computed():
    r = torch.tensor([2.0, 5.0], dtype=F64)
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.5, 0.6]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [0, 0, 0]], dtype=torch.bool)  # second response is empty
    out = apply_kl_penalty(r, kl, mask, kl_coef=0.5)
    assert out[0].tolist() == pytest.approx([-0.05, 2.0 - 0.1, 0.0], abs=1e-12)
    assert out[1].tolist() == [0.0, 0.0, 0.0]


def test_kl_controllers():
    fixed = FixedKLController(0.05)
    fixed.update(100.0, 256)
    assert fixed.value == 0.05
    ctl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=10000)
    ctl.update(current_kl=9.0, n_steps=256)  # error clip(9/6 - 1) = 0.2 -> x (1 + 0.2 * 256 / 10000)
    assert ctl.value == pytest.approx(0.1 * 1.00512, abs=1e-15)
    ctl.update(current_kl=6.6, n_steps=256)  # error 0.1 -> x (1 + 0.1 * 0.0256)
    assert ctl.value == pytest.approx(0.1 * 1.00512 * 1.00256, abs=1e-15)
    ctl.update(current_kl=0.0, n_steps=256)  # error -1 clipped to -0.2
    v = 0.1 * 1.00512 * 1.00256 * (1 - 0.00512)
    assert ctl.value == pytest.approx(v, abs=1e-15)
    resumed = AdaptiveKLController(1.0, 1.0, 1)
    resumed.load_state_dict(ctl.state_dict())
    resumed.update(7.0, 100)
    ctl.update(7.0, 100)
    assert resumed.value == ctl.value
    with pytest.raises(ValueError, match="target_kl > 0"):
        AdaptiveKLController(0.1, 0.0, 10)


# ---------------------------------------------------------------- shaping


def test_overlong_penalty_dapo_eq13_hand_computed():
    lengths = torch.tensor([10, 15, 16, 18, 20, 21])
    # L_max 20, L_cache 5: free up to 15, then (15 - |y|)/5, -1 beyond 20
    assert overlong_penalty(lengths, 20, 5).tolist() == pytest.approx([0, 0, -0.2, -0.6, -1, -1])
    assert overlong_penalty(lengths, 20, 5, penalty_factor=0.5).tolist() == pytest.approx(
        [0, 0, -0.1, -0.3, -0.5, -0.5]
    )
    assert overlong_penalty(lengths, 20, 0).tolist() == [0, 0, 0, 0, 0, -1]  # hard cut-off
    assert overlong_penalty(torch.tensor([0]), 20, 5).tolist() == [0]  # zero-length response: no penalty
    with pytest.raises(ValueError, match="overlong_buffer_len <= max_response_length"):
        overlong_penalty(lengths, 20, 30)


def test_clip_rewards():
    assert clip_rewards(torch.tensor([-5.0, 0.5, 9.0]), -1.0, 1.0).tolist() == [-1.0, 0.5, 1.0]
    assert clip_rewards(torch.tensor([-5.0, 9.0]), None, 1.0).tolist() == [-5.0, 1.0]
    with pytest.raises(ValueError, match="min_value 2"):
        clip_rewards(torch.tensor([0.0]), 2.0, 1.0)


def test_running_reward_normalizer_matches_float64_reference_and_resumes():
    norm = RunningRewardNormalizer(eps=0.0)
    first = norm.normalize(torch.tensor([1.0, 2.0, 3.0], dtype=F64))
    # its own stats: mean 2, population std sqrt(2/3)
    assert first.tolist() == pytest.approx([-1 / math.sqrt(2 / 3), 0, 1 / math.sqrt(2 / 3)], abs=1e-12)
    state = norm.state_dict()
    second = norm.normalize(torch.tensor([4.0, 5.0], dtype=F64))
    # all seen 1..5: mean 3, population std sqrt(2)
    assert (norm.mean, norm.std, norm.count) == (pytest.approx(3.0), pytest.approx(math.sqrt(2)), 5)
    assert second.tolist() == pytest.approx([1 / math.sqrt(2), 2 / math.sqrt(2)], abs=1e-12)
    resumed = RunningRewardNormalizer()
    resumed.load_state_dict(state)
    assert resumed.normalize(torch.tensor([4.0, 5.0], dtype=F64)).tolist() == second.tolist()
    # streaming over many random batches = statistics of everything at once
    g = torch.Generator().manual_seed(0)
    batches = [torch.randn(int(n), generator=g, dtype=F64) * 3 + 1 for n in torch.randint(1, 9, (20,), generator=g)]
    stream = RunningRewardNormalizer()
    for b in batches:
        stream.update(b)
    allr = torch.cat(batches)
    assert stream.mean == pytest.approx(allr.mean().item(), abs=1e-12)
    assert stream.std == pytest.approx(allr.std(unbiased=False).item(), abs=1e-12)
    fresh = RunningRewardNormalizer()
    assert fresh.normalize(torch.tensor([0.5])).tolist() == [0.5]  # fewer than min_count seen: unchanged
    with pytest.raises(ValueError, match="NaN or inf"):
        fresh.update(torch.tensor([math.nan]))


def test_combine_rewards_weights_and_errors():
    sources = {"accuracy": torch.tensor([1.0, 0.0]), "format": torch.tensor([1.0, 1.0])}
    assert combine_rewards(sources, {"accuracy": 1.0, "format": 0.1}).tolist() == pytest.approx([1.1, 0.1])
    with pytest.raises(ValueError, match=r"sources without a weight: \['format'\]"):
        combine_rewards(sources, {"accuracy": 1.0})
    with pytest.raises(ValueError, match=r"weights without a source: \['rm'\]"):
        combine_rewards(sources, {"accuracy": 1.0, "format": 1.0, "rm": 1.0})
    with pytest.raises(ValueError, match=r"source 'format' gave a non-finite score for sample \[1\]"):
        combine_rewards({"format": torch.tensor([0.0, math.inf])}, {"format": 1.0})


# ---------------------------------------------------------------- dynamic sampling


def test_filter_zero_variance_groups():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 2.0, 0.0, 0.0])
    ids = torch.tensor([0, 0, 1, 1, 2, 2, 3, 4, 4])  # 0: all right, 1: mixed, 2: equal, 3: one sample, 4: all wrong
    keep, kept = filter_zero_variance_groups(rewards, ids)
    assert keep.tolist() == [False, False, True, True, False, False, False, False, False]
    assert kept == 1
    keep, kept = filter_zero_variance_groups(torch.tensor([1.0, 0.0, 1.0, 1.0]), ["p", "p", "q", "q"])
    assert keep.tolist() == [True, True, False, False] and kept == 1
    keep, kept = filter_zero_variance_groups(torch.zeros(0), torch.zeros(0, dtype=torch.long))
    assert keep.numel() == 0 and kept == 0


def test_more_prompts_needed_and_max_tries():
    assert more_prompts_needed(num_kept_groups=1, target_num_groups=4, num_tries=1, max_tries=3) == 3
    assert more_prompts_needed(5, 4, 3, 3) == 0  # full (over-full is trimmed by the trainer)
    assert more_prompts_needed(0, 4, 50, 0) == 4  # max_tries 0: no limit
    with pytest.raises(DynamicSamplingExhausted, match="3 generation rounds kept 2 of 4 groups"):
        more_prompts_needed(2, 4, 3, 3)
