"""Policy losses (PPO-clip, clip-higher, dual-clip, GSPO, GSPO-token, GMPO, CPGD), truncated IS, value loss."""

import math

import pytest
import torch

from vlrft.algorithms.policy_losses import POLICY_LOSSES, compute_policy_loss, truncated_is_weights, value_loss

F64 = torch.float64


def _tokens(ratios, advantages):
    """One-token-per-position batch [1, n] with log pi_old = 0, so log pi = log(ratio)."""
    logp = torch.tensor([math.log(r) for r in ratios], dtype=F64)[None].requires_grad_()
    return (
        logp,
        torch.zeros_like(logp),
        torch.tensor(advantages, dtype=F64)[None],
        torch.ones_like(logp, dtype=torch.bool),
    )


def _per_token(name, ratios, advantages, **kw):
    logp, old, adv, mask = _tokens(ratios, advantages)
    loss_mat, _, _ = POLICY_LOSSES[name].fn(logp, old, adv, mask, **kw)
    (grad,) = torch.autograd.grad(loss_mat.sum(), logp)
    return loss_mat.detach()[0], grad[0]


# ---------------------------------------------------------------- hand-computed cases


def test_ppo_clip_hand_computed():
    # eps 0.2: (r=1.5, A=+1) clipped -> -1.2 ; (0.5, +1) -> -0.5 ; (1.5, -1) -> 1.5 ; (0.5, -1) clipped -> 0.8
    logp, old, adv, mask = _tokens([1.5, 0.5, 1.5, 0.5], [1, 1, -1, -1])
    loss, metrics = compute_policy_loss("ppo", logp, old, adv, mask)
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 1.5 + 0.8) / 4, abs=1e-12)  # 0.15
    assert metrics["clip_fraction"] == pytest.approx(0.5)
    assert metrics["ratio_mean"] == pytest.approx(1.0)
    # k3 of KL(old || new) = mean(r - 1 - log r)
    assert metrics["approx_kl"] == pytest.approx(2 * ((0.5 - math.log(1.5)) + (-0.5 - math.log(0.5))) / 4)
    (g,) = torch.autograd.grad(loss, logp)
    # d/dlogp of -A r / 4 where unclipped: token 1: -0.5/4, token 2: 1.5/4; clipped tokens: 0
    assert g[0].tolist() == pytest.approx([0, -0.125, 0.375, 0], abs=1e-12)


def test_gspo_hand_computed_differs_from_ppo_on_mixed_ratios():
    # one sequence, token ratios (1.5, 0.7), A = +1, clip 0.2 both sides
    logp, old, adv, mask = _tokens([1.5, 0.7], [1, 1])
    ppo, _ = compute_policy_loss("ppo", logp, old, adv, mask, loss_agg_mode="seq-mean-token-mean")
    assert ppo.item() == pytest.approx((-1.2 - 0.7) / 2, abs=1e-12)  # token 1 clipped
    gspo, m = compute_policy_loss("gspo", logp, old, adv, mask, loss_agg_mode="seq-mean-token-mean")
    s = math.sqrt(1.5 * 0.7)  # geometric mean 1.0247 lies inside [0.8, 1.2]: not clipped
    assert gspo.item() == pytest.approx(-s, abs=1e-12)
    assert m["clip_fraction"] == 0
    (g,) = torch.autograd.grad(gspo, logp)
    assert g[0].tolist() == pytest.approx([-s / 2, -s / 2], abs=1e-12)  # both tokens get gradient
    (g_ppo,) = torch.autograd.grad(
        compute_policy_loss("ppo", logp, old, adv, mask, loss_agg_mode="seq-mean-token-mean")[0], logp
    )
    assert g_ppo[0].tolist() == pytest.approx([0, -0.35], abs=1e-12)  # PPO: clipped token gets none


def test_gmpo_hand_computed():
    # log ratios (0.5, -0.1), clip +-0.4 in log space
    # A = +1: min(0.5, 0.4) = 0.4, min(-0.1, -0.1) = -0.1 -> mean 0.15 -> loss -exp(0.15)
    logp = torch.tensor([[0.5, -0.1]], dtype=F64)
    old, mask = torch.zeros_like(logp), torch.ones(1, 2, dtype=torch.bool)
    loss, m = compute_policy_loss(
        "gmpo",
        logp,
        old,
        torch.tensor([[1.0, 1.0]], dtype=F64),
        mask,
        clip_low=0.4,
        clip_high=0.4,
        loss_agg_mode="seq-mean-token-mean",
    )
    assert loss.item() == pytest.approx(-math.exp(0.15), abs=1e-12)
    assert m["clip_fraction"] == 0.5
    # A = -1: -min(-0.5, -0.4) = 0.5, -min(0.1, 0.1) = -0.1 -> mean 0.2 -> loss +exp(0.2)
    loss, _ = compute_policy_loss(
        "gmpo",
        logp,
        old,
        torch.tensor([[-1.0, -1.0]], dtype=F64),
        mask,
        clip_low=0.4,
        clip_high=0.4,
        loss_agg_mode="seq-mean-token-mean",
    )
    assert loss.item() == pytest.approx(math.exp(0.2), abs=1e-12)


def test_cpgd_hand_computed():
    # l = 0.5, A = +1, clip 0.2: clip(l) = log 1.2 = 0.18232 -> pg = max(-0.5, -0.18232) = -0.18232
    # drift k3 = e^0.5 - 1 - 0.5 = 0.148721 ; alpha 0.1 -> -0.18232 + 0.0148721
    logp = torch.tensor([[0.5]], dtype=F64)
    loss, m = compute_policy_loss(
        "cpgd",
        logp,
        torch.zeros_like(logp),
        torch.ones_like(logp),
        torch.ones(1, 1, dtype=torch.bool),
        policy_drift_coef=0.1,
    )
    assert loss.item() == pytest.approx(-math.log(1.2) + 0.1 * (math.exp(0.5) - 1.5), abs=1e-12)
    assert m["clip_fraction"] == 1.0 and m["policy_drift"] == pytest.approx(math.exp(0.5) - 1.5)
    # l = -0.5, A = +1: unclipped -(-0.5) = 0.5 is the max -> 0.5 + drift
    logp = torch.tensor([[-0.5]], dtype=F64)
    loss, _ = compute_policy_loss(
        "cpgd",
        logp,
        torch.zeros_like(logp),
        torch.ones_like(logp),
        torch.ones(1, 1, dtype=torch.bool),
        policy_drift_coef=0.1,
    )
    assert loss.item() == pytest.approx(0.5 + 0.1 * (math.exp(-0.5) - 0.5), abs=1e-12)


# ---------------------------------------------------------------- differ from PPO-clip exactly where defined

# ratios on each side of each bound: 1-0.2=0.8, 1+0.2=1.2, 1+0.28=1.28, dual-clip c=3
RATIOS = [0.5, 0.79, 0.81, 1.0, 1.19, 1.21, 1.27, 1.29, 2.0, 2.9, 3.1, 5.0]


def test_clip_higher_differs_only_above_one_plus_clip_low_for_positive_advantages():
    for a in (1.0, -1.0):
        base_loss, base_grad = _per_token("ppo", RATIOS, [a] * len(RATIOS), clip_low=0.2, clip_high=0.2)
        high_loss, high_grad = _per_token("ppo", RATIOS, [a] * len(RATIOS), clip_low=0.2, clip_high=0.28)
        r = torch.tensor(RATIOS, dtype=F64)
        differs_value = ~torch.isclose(base_loss, high_loss, atol=1e-12, rtol=0)
        differs_grad = ~torch.isclose(base_grad, high_grad, atol=1e-12, rtol=0)
        if a > 0:
            assert torch.equal(differs_value, r > 1.2)  # value: clipped at 1.2 vs 1.28 (or unclipped)
            assert torch.equal(differs_grad, (r > 1.2) & (r < 1.28))  # only there does clip-higher keep a gradient
        else:
            assert not differs_value.any() and not differs_grad.any()  # low side unchanged


def test_dual_clip_differs_only_for_negative_advantages_beyond_c():
    for a in (1.0, -1.0):
        base_loss, base_grad = _per_token("ppo", RATIOS, [a] * len(RATIOS))
        dual_loss, dual_grad = _per_token("ppo", RATIOS, [a] * len(RATIOS), dual_clip=3.0)
        r = torch.tensor(RATIOS, dtype=F64)
        expected = (r > 3.0) if a < 0 else torch.zeros_like(r, dtype=torch.bool)
        assert torch.equal(~torch.isclose(base_loss, dual_loss, atol=1e-12, rtol=0), expected)
        assert torch.equal(~torch.isclose(base_grad, dual_grad, atol=1e-12, rtol=0), expected)
        if a < 0:
            assert dual_loss[r > 3.0].tolist() == pytest.approx([3.0, 3.0])  # bounded by -c A
            assert (dual_grad[r > 3.0] == 0).all()


def test_gspo_equals_ppo_when_all_token_ratios_agree_and_differs_when_they_do_not():
    # each sequence repeats one ratio: sequence ratio = token ratio, so GSPO clipping = PPO clipping
    n = len(RATIOS)
    for a in (1.0, -1.0):
        logp = torch.tensor([[math.log(r)] * 3 for r in RATIOS], dtype=F64, requires_grad=True)
        adv = torch.full((n, 3), a, dtype=F64)
        mask = torch.ones(n, 3, dtype=torch.bool)
        kw = dict(clip_low=0.2, clip_high=0.2, loss_agg_mode="seq-mean-token-mean")
        ppo, _ = compute_policy_loss("ppo", logp, torch.zeros_like(logp), adv, mask, **kw)
        gspo, _ = compute_policy_loss("gspo", logp, torch.zeros_like(logp), adv, mask, **kw)
        assert gspo.item() == pytest.approx(ppo.item(), abs=1e-12)
        g1 = torch.autograd.grad(ppo, logp)[0]
        g2 = torch.autograd.grad(gspo, logp)[0]
        torch.testing.assert_close(g1, g2)
    # mixed ratios (1.5, 0.9, 0.9): PPO clips token 1 only; GSPO's s = 1.5^(1/3) 0.9^(2/3) = 1.0296 clips nothing
    logp = torch.tensor([[math.log(1.5), math.log(0.9), math.log(0.9)]], dtype=F64, requires_grad=True)
    adv, mask = torch.ones(1, 3, dtype=F64), torch.ones(1, 3, dtype=torch.bool)
    gspo, m = compute_policy_loss("gspo", logp, torch.zeros_like(logp), adv, mask, loss_agg_mode="seq-mean-token-mean")
    s = 1.5 ** (1 / 3) * 0.9 ** (2 / 3)
    assert gspo.item() == pytest.approx(-s, abs=1e-12) and m["clip_fraction"] == 0
    # and a sequence ratio beyond 1.2 is clipped as a whole: no gradient on any of its tokens
    logp2 = torch.tensor([[math.log(1.5), math.log(1.3), math.log(1.0)]], dtype=F64, requires_grad=True)
    gspo2, m2 = compute_policy_loss(
        "gspo", logp2, torch.zeros_like(logp2), adv, mask, loss_agg_mode="seq-mean-token-mean"
    )
    assert (1.5 * 1.3) ** (1 / 3) > 1.2 and m2["clip_fraction"] == 1.0
    assert gspo2.item() == pytest.approx(-1.2, abs=1e-12)
    assert (torch.autograd.grad(gspo2, logp2)[0] == 0).all()


def test_gspo_token_equals_gspo_for_sequence_constant_advantages():
    torch.manual_seed(0)
    logp = (torch.randn(4, 5, dtype=F64) * 0.05).requires_grad_()
    old = torch.zeros_like(logp)
    adv = torch.randn(4, 1, dtype=F64).expand(4, 5)
    mask = torch.arange(5)[None] < torch.tensor([[5], [3], [1], [4]])
    kw = dict(clip_low=0.02, clip_high=0.03, loss_agg_mode="seq-mean-token-mean")
    a, _ = compute_policy_loss("gspo", logp, old, adv, mask, **kw)
    b, _ = compute_policy_loss("gspo_token", logp, old, adv, mask, **kw)
    assert a.item() == pytest.approx(b.item(), abs=1e-12)
    torch.testing.assert_close(torch.autograd.grad(a, logp)[0], torch.autograd.grad(b, logp)[0])


def test_gspo_token_gradient_is_the_defined_one_for_per_token_advantages():
    # log ratios (log 1.1, 0): s = sqrt(1.1); the value of every token is s_i, the gradient of token t is
    # that of -A_t * s_i * pi_t / sg(pi_t): -A_t * s_i (unclipped), / 2 tokens for token-mean
    logp = torch.tensor([[math.log(1.1), 0.0]], dtype=F64, requires_grad=True)
    adv = torch.tensor([[1.0, -2.0]], dtype=F64)
    loss, _ = compute_policy_loss(
        "gspo_token", logp, torch.zeros_like(logp), adv, torch.ones(1, 2, dtype=torch.bool), clip_low=0.5, clip_high=0.5
    )
    s = math.sqrt(1.1)
    assert loss.item() == pytest.approx((-1.0 * s + 2.0 * s) / 2, abs=1e-12)
    assert torch.autograd.grad(loss, logp)[0][0].tolist() == pytest.approx([-s / 2, s], abs=1e-12)


# ---------------------------------------------------------------- float64 reference loops


def _ref_loss(name, logp, old, adv, mask, cl, ch, dual, alpha):
    """Per-sequence loops, token-mean over all valid tokens (seq-level losses weighted by their length)."""
    total, count = 0.0, 0
    for i in range(logp.shape[0]):
        valid = [t for t in range(logp.shape[1]) if mask[i, t]]
        if not valid:
            continue
        lr = [float(logp[i, t] - old[i, t]) for t in valid]
        a = [float(adv[i, t]) for t in valid]
        if name == "ppo":
            per = []
            for x, at in zip(lr, a):
                r = math.exp(x)
                v = max(-at * r, -at * min(max(r, 1 - cl), 1 + ch))
                if dual is not None and at < 0:
                    v = min(v, -at * dual)
                per.append(v)
        elif name == "gspo":
            s = math.exp(sum(lr) / len(lr))
            am = sum(a) / len(a)
            per = [max(-am * s, -am * min(max(s, 1 - cl), 1 + ch))] * len(lr)
        elif name == "gmpo":
            am = sum(a) / len(a)
            chosen = []
            for x, at in zip(lr, a):
                sg = (at > 0) - (at < 0)
                chosen.append(sg * min(sg * x, sg * min(max(x, -cl), ch)))
            per = [-am * math.exp(sum(chosen) / len(chosen))] * len(lr)
        else:  # cpgd
            per = []
            for x, at in zip(lr, a):
                c = min(max(x, math.log(1 - cl)), math.log(1 + ch))
                per.append(max(-at * x, -at * c) + alpha * (math.exp(x) - 1 - x))
        total += sum(per)
        count += len(per)
    return total / max(count, 1)


@pytest.mark.parametrize(
    "name,cl,ch,dual",
    [
        ("ppo", 0.2, 0.28, None),
        ("ppo", 0.2, 0.2, 3.0),
        ("gspo", 0.01, 0.02, None),
        ("gmpo", 0.1, 0.15, None),
        ("cpgd", 0.2, 0.28, None),
    ],
)
def test_matches_float64_reference_loop(name, cl, ch, dual):
    g = torch.Generator().manual_seed(3)
    logp = torch.randn(6, 7, generator=g, dtype=F64) * 0.4
    old = logp + torch.randn(6, 7, generator=g, dtype=F64) * 0.3
    adv = torch.randn(6, 7, generator=g, dtype=F64)
    if name in ("gspo", "gmpo"):
        adv = adv[:, :1].expand(6, 7)  # outcome advantages: one value per sequence
    mask = torch.arange(7)[None] < torch.tensor([[7], [1], [0], [4], [6], [3]])
    loss, _ = compute_policy_loss(
        name, logp, old, adv, mask, clip_low=cl, clip_high=ch, dual_clip=dual, policy_drift_coef=0.3
    )
    assert loss.item() == pytest.approx(_ref_loss(name, logp, old, adv, mask, cl, ch, dual, 0.3), abs=1e-12)


# gspo_token is absent on purpose: its stop-gradients make its gradient differ from the derivative of its
# value by design (arXiv 2507.18071 eq. 14); it is checked against its defined gradient below.
@pytest.mark.parametrize(
    "name,kw",
    [
        ("ppo", {"clip_high": 0.28}),
        ("ppo", {"dual_clip": 3.0}),
        ("gspo", {}),
        ("gmpo", {}),
        ("cpgd", {"policy_drift_coef": 0.2}),
    ],
)
def test_gradcheck_float64(name, kw):
    g = torch.Generator().manual_seed(4)
    old = torch.randn(3, 4, generator=g, dtype=F64)
    logp = (old + torch.randn(3, 4, generator=g, dtype=F64) * 0.5).requires_grad_()
    adv = torch.randn(3, 4, generator=g, dtype=F64)
    mask = torch.arange(4)[None] < torch.tensor([[4], [2], [3]])
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        assert torch.autograd.gradcheck(
            lambda x: compute_policy_loss(name, x, old, adv, mask, loss_agg_mode=mode, **kw)[0], (logp,)
        )


# ---------------------------------------------------------------- degenerate cases


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_fully_masked_rows_and_empty_batch_are_finite(name):
    logp = torch.randn(3, 4, dtype=F64, requires_grad=True)
    old, adv = torch.randn(3, 4, dtype=F64), torch.randn(3, 4, dtype=F64)
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[1] = False  # a zero-length response
    for agg in ("token-mean", "seq-mean-token-mean"):
        loss, metrics = compute_policy_loss(name, logp, old, adv, mask, loss_agg_mode=agg)
        (g,) = torch.autograd.grad(loss, logp)
        assert torch.isfinite(loss) and torch.isfinite(g).all() and (g[1] == 0).all()
        assert all(math.isfinite(v) for v in metrics.values())
    loss, metrics = compute_policy_loss(name, logp, old, adv, torch.zeros_like(mask))
    (g,) = torch.autograd.grad(loss, logp)
    assert loss.item() == 0 and (g == 0).all()  # nothing to learn from: 0, not NaN
    assert metrics["clip_fraction"] == 0


def test_zero_width_batch_runs_end_to_end():
    """Every response of the batch has length 0 (T = 0): everything is empty or 0, nothing raises or NaNs."""
    from vlrft.algorithms import (
        ADVANTAGE_ESTIMATORS,
        LOSS_AGG_MODES,
        compute_advantages,
        entropy_from_logits,
        high_entropy_mask,
        logprobs_from_logits,
    )

    logits = torch.randn(2, 0, 5, requires_grad=True)
    lp = logprobs_from_logits(logits, torch.zeros(2, 0, dtype=torch.long))
    (lp.sum() + entropy_from_logits(logits).sum()).backward()
    assert lp.shape == (2, 0) and logits.grad.shape == (2, 0, 5)
    mask = torch.zeros(2, 0, dtype=torch.bool)
    assert high_entropy_mask(torch.zeros(2, 0), mask, 0.2).shape == (2, 0)
    for est, spec in ADVANTAGE_ESTIMATORS.items():
        rewards = torch.zeros(2, 0) if spec.teacher else torch.tensor([1.0, 0.0])  # opd: per-token rewards
        adv, ret = compute_advantages(est, rewards, mask, group_ids=[0, 0], values=torch.zeros(2, 0))
        assert adv.shape == ret.shape == (2, 0)
    for name in POLICY_LOSSES:
        for mode in LOSS_AGG_MODES:
            x = torch.zeros(2, 0, requires_grad=True)
            loss, metrics = compute_policy_loss(name, x, x.detach(), x.detach(), mask, loss_agg_mode=mode)
            loss.backward()
            assert loss.item() == 0 and all(v == 0 for v in metrics.values())
    assert value_loss(torch.zeros(2, 0), torch.zeros(2, 0), torch.zeros(2, 0), mask)[0].item() == 0


def test_zero_advantages_give_zero_policy_gradient():
    logp = torch.randn(2, 3, dtype=F64, requires_grad=True)
    for name in ("ppo", "gspo", "gmpo"):
        loss, _ = compute_policy_loss(
            name, logp, logp.detach() + 0.1, torch.zeros(2, 3, dtype=F64), torch.ones(2, 3, dtype=torch.bool)
        )
        assert loss.item() == 0 and (torch.autograd.grad(loss, logp)[0] == 0).all()


def test_bad_arguments_raise():
    x = torch.zeros(1, 2)
    m = torch.ones(1, 2, dtype=torch.bool)
    with pytest.raises(ValueError, match="unknown policy_loss 'grpo'"):
        compute_policy_loss("grpo", x, x, x, m)
    with pytest.raises(ValueError, match="dual_clip applies to policy_loss 'ppo' only"):
        compute_policy_loss("gspo", x, x, x, m, dual_clip=3.0)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        compute_policy_loss("ppo", x, x, x, m, dual_clip=0.5)
    with pytest.raises(ValueError, match="must all be"):
        compute_policy_loss("ppo", x, x, torch.zeros(1, 3), m)


# ---------------------------------------------------------------- truncated IS and the value loss


def test_truncated_is_weights_hand_computed_and_applied():
    trainer = torch.tensor([[-1.0, -1.0, -1.0]], dtype=F64)
    rollout = torch.tensor([[-2.0, -0.5, -3.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    w = truncated_is_weights(trainer, rollout, mask, cap=2.0)
    # exp(1) = 2.718 -> capped at 2 ; exp(-0.5) = 0.6065 ; masked -> 0
    assert w[0].tolist() == pytest.approx([2.0, math.exp(-0.5), 0.0], abs=1e-12)
    logp = torch.zeros(1, 3, dtype=F64, requires_grad=True)
    adv = torch.ones(1, 3, dtype=F64)
    plain, _ = compute_policy_loss("ppo", logp, torch.zeros_like(logp), adv, mask)
    weighted, _ = compute_policy_loss("ppo", logp, torch.zeros_like(logp), adv, mask, is_weights=w)
    assert plain.item() == pytest.approx(-1.0) and weighted.item() == pytest.approx(-(2.0 + math.exp(-0.5)) / 2)
    with pytest.raises(ValueError, match="cap must be > 0"):
        truncated_is_weights(trainer, rollout, mask, cap=0)


def test_value_loss_hand_computed_and_gradcheck():
    # v 1.0, old 0.5, R 2.0, c 0.2: v_clip 0.7 -> max(1, 1.69)/2 = 0.845 ; v 0.6, old 0.5, R 0: both 0.36 -> 0.18
    values = torch.tensor([[1.0, 0.6]], dtype=F64, requires_grad=True)
    old = torch.tensor([[0.5, 0.5]], dtype=F64)
    ret = torch.tensor([[2.0, 0.0]], dtype=F64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, m = value_loss(values, old, ret, mask, 0.2)
    assert loss.item() == pytest.approx((0.845 + 0.18) / 2, abs=1e-12)
    assert m["vf_clip_fraction"] == 0.5
    loss, _ = value_loss(values, old, ret, mask, None)
    assert loss.item() == pytest.approx((0.5 * 1.0 + 0.5 * 0.36) / 2, abs=1e-12)
    g = torch.Generator().manual_seed(5)
    v = torch.randn(2, 3, generator=g, dtype=F64, requires_grad=True)
    o, r = torch.randn(2, 3, generator=g, dtype=F64), torch.randn(2, 3, generator=g, dtype=F64)
    assert torch.autograd.gradcheck(lambda x: value_loss(x, o, r, torch.ones(2, 3, dtype=torch.bool), 0.3)[0], (v,))


def test_docs_example_runs(tmp_path):
    """The example at the top of docs/algorithms.md runs as written (our own documentation as a script)."""
    import pathlib
    import re
    import runpy

    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "algorithms.md").read_text()
    script = tmp_path / "algorithms_example.py"
    script.write_text(re.search(r"```python\n(.*?)```", text, re.S).group(1))
    namespace = runpy.run_path(str(script))
    assert torch.isfinite(namespace["loss"]) and (namespace["adv"][4:] == 0).all()
