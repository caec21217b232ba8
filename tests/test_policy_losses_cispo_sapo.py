"""CISPO (MiniMax-M1, arXiv 2506.13585) and SAPO (arXiv 2511.20347): hand-computed float64 values and analytic
gradients at ratio 1, off-ratio inside and outside the bounds, both advantage signs, masked tokens, every
aggregation mode; their options in the config (``algorithm.sapo_tau_pos`` / ``sapo_tau_neg``)."""

import math

import pytest
import torch

from vlrft.algorithms import LOSS_AGG_MODES
from vlrft.algorithms.policy_losses import POLICY_LOSSES, compute_policy_loss
from vlrft.config import ConfigError, load_config
from vlrft.trainer.config import PolicyTrainConfig

F64 = torch.float64


def _tokens(ratios, advantages, mask=None):
    """One sequence [1, n] with log pi_old = 0, so log pi = log(ratio)."""
    logp = torch.tensor([[math.log(r) for r in ratios]], dtype=F64, requires_grad=True)
    adv = torch.tensor([advantages], dtype=F64)
    m = torch.ones_like(adv, dtype=torch.bool) if mask is None else torch.tensor([mask], dtype=torch.bool)
    return logp, torch.zeros_like(adv), adv, m


def _loss_and_grad(name, logp, old, adv, mask, **kw):
    loss, metrics = compute_policy_loss(name, logp, old, adv, mask, **kw)
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.item(), grad[0].tolist(), metrics


# ---------------------------------------------------------------- CISPO, by hand


def test_cispo_hand_computed_values_gradients_and_clip_fraction():
    # clip 0.2 / 0.2: weights sg(clip(r, 0.8, 1.2)); token loss -w A log r, gradient -w A (/ 4 tokens, token-mean)
    #   r 1.0 A +1: w 1.0 (ratio 1)           loss 0                        grad -0.25
    #   r 1.1 A -1: w 1.1 (inside)            loss  1.1 ln 1.1 =  0.1048412  grad  0.275
    #   r 1.5 A +1: w 1.2 (clipped above)     loss -1.2 ln 1.5 = -0.4865581  grad -0.3   (PPO: 0)
    #   r 0.5 A -1: w 0.8 (clipped below)     loss  0.8 ln 0.5 = -0.5545177  grad  0.2
    logp, old, adv, mask = _tokens([1.0, 1.1, 1.5, 0.5], [1, -1, 1, -1])
    loss, grad, m = _loss_and_grad("cispo", logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert loss == pytest.approx(-0.23405866909824902, abs=1e-12)
    assert grad == pytest.approx([-0.25, 0.275, -0.3, 0.2], abs=1e-12)
    assert m["clip_fraction"] == 0.5 and m["ratio_mean"] == pytest.approx(1.025)
    # PPO drops the gradient of the token clipped above with A > 0 (and of the one below with A < 0); CISPO keeps it
    _, ppo_grad, _ = _loss_and_grad("ppo", logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert ppo_grad == pytest.approx([-0.25, 0.275, 0.0, 0.0], abs=1e-12)
    # clip_low 1.0: the lower bound is open (weight >= 0 >= 1 - 1), as in the paper: r 0.5 keeps its weight 0.5
    loss, grad, m = _loss_and_grad("cispo", logp, old, adv, mask, clip_low=1.0, clip_high=0.2)
    assert loss == pytest.approx((0.1048411967 - 0.4865581297 + 0.5 * math.log(0.5)) / 4, abs=1e-9)
    assert grad == pytest.approx([-0.25, 0.275, -0.3, 0.125], abs=1e-12)
    assert m["clip_fraction"] == 0.25


def test_cispo_gradient_is_the_weighted_policy_gradient_and_equals_ppo_at_ratio_one():
    # at r = 1 every weight is 1: the gradient -A/n of REINFORCE, the same as PPO's, for both signs
    for a in (1.0, -2.0):
        logp, old, adv, mask = _tokens([1.0, 1.0], [a, a])
        _, grad, m = _loss_and_grad("cispo", logp, old, adv, mask)
        _, ppo_grad, _ = _loss_and_grad("ppo", logp, old, adv, mask)
        assert grad == pytest.approx([-a / 2, -a / 2], abs=1e-12) == ppo_grad
        assert m["clip_fraction"] == 0
    # far off-ratio (r = e^25, past the +-20 clamp of the log-ratio): the weight is the bound 1.2, the gradient is kept
    logp, old, adv, mask = torch.full((1, 1), 25.0, dtype=F64, requires_grad=True), *_tokens([1.0], [1.0])[1:]
    loss, grad, m = _loss_and_grad("cispo", logp, old, adv, mask)
    assert loss == pytest.approx(-1.2 * 25.0, abs=1e-12) and grad == pytest.approx([-1.2], abs=1e-12)
    assert m["clip_fraction"] == 1.0


def test_cispo_masked_tokens_count_nothing():
    # token 2 is masked with a wild ratio and advantage: value, gradient and clip fraction ignore it
    logp, old, adv, mask = _tokens([1.1, 50.0, 0.9], [1, -7, 1], mask=[1, 0, 1])
    loss, grad, m = _loss_and_grad("cispo", logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    assert loss == pytest.approx(-(1.1 * math.log(1.1) + 0.9 * math.log(0.9)) / 2, abs=1e-12)
    assert grad == pytest.approx([-0.55, 0.0, -0.45], abs=1e-12)
    assert m["clip_fraction"] == 0


# ---------------------------------------------------------------- SAPO, by hand


def test_sapo_hand_computed_values_gradients_and_gate_metrics():
    # tau_pos 1, tau_neg 1.05; s = sigmoid(tau (r - 1)); token loss -(4/tau) s A; gradient -w r A, w = 4 s (1 - s)
    # = sech^2(tau (r - 1) / 2); / 5 tokens (token-mean)
    #   r 1.0 A +1 tau 1   : s 0.5        loss -2            w 1          grad -1
    #   r 1.0 A -1 tau 1.05: s 0.5        loss 2/1.05        w 1          grad  1
    #   r 1.5 A +1 tau 1   : s 0.6224593  loss -2.4898373    w 0.9400148  grad -1.4100223
    #   r 0.5 A -1 tau 1.05: s 0.3716838  loss  1.4159383    w 0.9341398  grad  0.4670699
    #   r 4.0 A +1 tau 1   : s 0.9525741  loss -3.8102965    w 0.1807066  grad -0.7228266  (w < 1/2: "clipped")
    logp, old, adv, mask = _tokens([1.0, 1.0, 1.5, 0.5, 4.0], [1, -1, 1, -1, 1])
    loss, grad, m = _loss_and_grad("sapo", logp, old, adv, mask, sapo_tau_pos=1.0, sapo_tau_neg=1.05)
    assert loss == pytest.approx((-2 + 2 / 1.05 - 2.4898373248074184 + 1.4159383303033666 - 3.8102965072897335) / 5)
    assert grad == pytest.approx(
        [-0.2, 0.2, -1.410022273209567 / 5, 0.4670699116426963 / 5, -0.722826555694592 / 5], abs=1e-12
    )
    assert m["clip_fraction"] == pytest.approx(0.2)
    assert m["gate_weight_mean"] == pytest.approx((2 + 0.940014848806378 + 0.9341398232853926 + 0.180706638923648) / 5)
    # the weights are sech^2(tau (r - 1) / 2), the closed form of 4 s (1 - s)
    assert 1 / math.cosh(0.25) ** 2 == pytest.approx(0.940014848806378, abs=1e-12)
    assert 1 / math.cosh(1.05 * -0.5 / 2) ** 2 == pytest.approx(0.9341398232853926, abs=1e-12)


def test_sapo_at_ratio_one_is_the_policy_gradient_for_both_signs_and_any_tau():
    for a in (1.0, -2.0):
        for taus in ((1.0, 1.05), (0.3, 7.0)):
            logp, old, adv, mask = _tokens([1.0, 1.0], [a, a])
            _, grad, m = _loss_and_grad("sapo", logp, old, adv, mask, sapo_tau_pos=taus[0], sapo_tau_neg=taus[1])
            _, ppo_grad, _ = _loss_and_grad("ppo", logp, old, adv, mask)
            assert grad == pytest.approx([-a / 2, -a / 2], abs=1e-12) == ppo_grad
            assert m["clip_fraction"] == 0 and m["gate_weight_mean"] == 1.0


def test_sapo_temperatures_reach_the_loss_and_the_negative_side_closes_sooner():
    # same |A| and r = 1.8 on both sides: w = sech^2(tau 0.4), smaller for the larger tau (the negative one)
    logp, old, adv, mask = _tokens([1.8, 1.8], [1, -1])
    _, grad, _ = _loss_and_grad("sapo", logp, old, adv, mask, sapo_tau_pos=1.0, sapo_tau_neg=3.0)
    w_pos, w_neg = 1 / math.cosh(0.4) ** 2, 1 / math.cosh(1.2) ** 2
    assert grad == pytest.approx([-w_pos * 1.8 / 2, w_neg * 1.8 / 2], abs=1e-12)
    assert w_neg < w_pos
    # through the config: policy_loss_inputs() carries exactly the two temperatures
    cfg = load_config(PolicyTrainConfig, None, ["algorithm.policy_loss=sapo", "algorithm.sapo_tau_neg=3.0"])
    assert cfg.algorithm.policy_loss_inputs() == {"sapo_tau_pos": 1.0, "sapo_tau_neg": 3.0}
    assert POLICY_LOSSES["sapo"].extra_inputs == ("sapo_tau_pos", "sapo_tau_neg")
    assert POLICY_LOSSES["cispo"].extra_inputs == ()


def test_sapo_masked_tokens_count_nothing():
    logp, old, adv, mask = _tokens([1.5, 40.0, 1.0], [1, -9, -1], mask=[1, 0, 1])
    loss, grad, m = _loss_and_grad("sapo", logp, old, adv, mask)
    s = 1 / (1 + math.exp(-0.5))
    assert loss == pytest.approx((-4 * s + 2 / 1.05) / 2, abs=1e-12)
    assert grad == pytest.approx([-4 * s * (1 - s) * 1.5 / 2, 0.0, 0.5], abs=1e-12)
    assert m["clip_fraction"] == 0


# ---------------------------------------------------------------- every aggregation mode, against a float64 loop


def _ref_token(name, lr, a):
    """(loss, d loss / d log pi) of one token, in Python floats; cispo clip 0.2 / 0.28, sapo tau 1.0 / 1.05."""
    r = math.exp(lr)
    if name == "cispo":
        w = min(max(r, 0.8), 1.28)
        return -w * a * lr, -w * a
    tau = 1.0 if a > 0 else 1.05
    s = 1 / (1 + math.exp(-tau * (r - 1)))
    return -(4 / tau) * s * a, -4 * s * (1 - s) * r * a


def _ref_aggregate(name, logp, old, adv, mask, mode):
    rows = [[t for t in range(mask.shape[1]) if mask[i, t]] for i in range(mask.shape[0])]
    n_tok, n_seq, t_max = sum(map(len, rows)), sum(1 for r in rows if r), mask.shape[1]
    loss, grad = 0.0, torch.zeros_like(logp)
    for i, valid in enumerate(rows):
        for t in valid:
            value, g = _ref_token(name, float(logp[i, t] - old[i, t]), float(adv[i, t]))
            scale = {
                "token-mean": 1 / n_tok,
                "seq-mean-token-mean": 1 / (n_seq * len(valid)),
                "seq-mean-token-sum": 1 / n_seq,
                "seq-mean-token-sum-norm": 1 / (n_seq * t_max),
            }[mode]
            loss += scale * value
            grad[i, t] = scale * g
    return loss, grad


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
@pytest.mark.parametrize("name", ["cispo", "sapo"])
def test_matches_float64_loop_in_every_aggregation_mode(name, mode):
    g = torch.Generator().manual_seed(7)
    old = torch.randn(4, 5, generator=g, dtype=F64)
    logp = (old + torch.randn(4, 5, generator=g, dtype=F64) * 0.6).requires_grad_()  # ratios in and out of bounds
    adv = torch.randn(4, 5, generator=g, dtype=F64)
    mask = torch.arange(5)[None] < torch.tensor([[5], [3], [0], [1]])  # a zero-length response among them
    kw = {"clip_low": 0.2, "clip_high": 0.28} if name == "cispo" else {"sapo_tau_pos": 1.0, "sapo_tau_neg": 1.05}
    loss, metrics = compute_policy_loss(name, logp, old, adv, mask, loss_agg_mode=mode, **kw)
    (grad,) = torch.autograd.grad(loss, logp)
    ref_loss, ref_grad = _ref_aggregate(name, logp.detach(), old, adv, mask, mode)
    assert loss.item() == pytest.approx(ref_loss, abs=1e-12)
    torch.testing.assert_close(grad, ref_grad, atol=1e-12, rtol=0)
    r = (logp - old).detach().exp()[mask]
    if name == "cispo":  # the batch has clipped tokens on both sides: the test covers them
        assert ((r < 0.8).any() and (r > 1.28).any()) and metrics["clip_fraction"] > 0
    assert (grad[~mask] == 0).all() and (grad[mask] != 0).all()  # every valid token keeps a gradient


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_sapo_gradcheck_float64(mode):
    # SAPO has no stop-gradient: its autograd gradient is the derivative of its value (CISPO's is not, by design)
    g = torch.Generator().manual_seed(8)
    old = torch.randn(3, 4, generator=g, dtype=F64)
    logp = (old + torch.randn(3, 4, generator=g, dtype=F64) * 0.5).requires_grad_()
    adv = torch.randn(3, 4, generator=g, dtype=F64)
    mask = torch.arange(4)[None] < torch.tensor([[4], [2], [3]])
    assert torch.autograd.gradcheck(
        lambda x: compute_policy_loss("sapo", x, old, adv, mask, loss_agg_mode=mode, sapo_tau_neg=2.0)[0], (logp,)
    )


# ---------------------------------------------------------------- bad input


def test_bad_temperatures_and_unread_options_are_one_line_errors():
    def refused(overrides):
        with pytest.raises(ConfigError) as e:
            load_config(PolicyTrainConfig, None, overrides)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert (
        refused(["algorithm.policy_loss=sapo", "algorithm.sapo_tau_pos=0"]) == "algorithm.sapo_tau_pos=0.0: must be > 0"
    )
    assert (
        refused(["algorithm.policy_loss=sapo", "algorithm.sapo_tau_neg=-1"])
        == "algorithm.sapo_tau_neg=-1.0: must be > 0"
    )
    assert refused(["algorithm.policy_loss=sapo", "algorithm.clip_high=0.28"]) == (
        "algorithm.clip_high=0.28: sapo has no clip range (its gate: algorithm.sapo_tau_pos / _neg); leave it unset"
    )
    assert refused(["algorithm.policy_loss=cispo", "algorithm.sapo_tau_pos=2"]) == (
        "algorithm.sapo_tau_pos=2.0: read by policy_loss sapo only, not cispo; leave it unset"
    )
    x, m = torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="sapo needs sapo_tau_pos > 0 and sapo_tau_neg > 0, got 1.0, 0.0"):
        compute_policy_loss("sapo", x, x, x, m, sapo_tau_neg=0.0)
