"""Rollout correction (none | token_tis | sequence_mask): hand-computed tensors, float64 references, gradients."""

import math

import pytest
import torch

from vlrft.algorithms.policy_losses import compute_policy_loss
from vlrft.algorithms.rollout_correction import ROLLOUT_CORRECTIONS, rollout_correction, sequence_mask_keep

F64 = torch.float64

# two sequences of 3 tokens; the second has 2 response tokens
TRAINER = torch.tensor([[-1.0, -1.0, -1.0], [-0.5, -2.0, -9.0]], dtype=F64)
ROLLOUT = torch.tensor([[-2.0, -0.5, -3.0], [-0.5, -1.0, -1.0]], dtype=F64)
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.long)


def test_none_changes_nothing_and_reports_the_mismatch():
    w, loss_mask, m = rollout_correction("none", TRAINER, ROLLOUT, MASK)
    assert w is None and torch.equal(loss_mask, MASK)
    # |diff| on the 5 response tokens: 1, 0.5, 2, 0, 1 (the masked 8 is ignored)
    assert m["rollout/logprob_diff_mean"] == pytest.approx(4.5 / 5)
    assert m["rollout/logprob_diff_max"] == pytest.approx(2.0)
    assert m["rollout/is_weight_mean"] == 1.0 and m["rollout/frac_masked"] == 0.0


def test_token_tis_weights_hand_computed():
    w, loss_mask, m = rollout_correction("token_tis", TRAINER, ROLLOUT, MASK, cap=2.0)
    expected = [[2.0, math.exp(-0.5), 2.0], [1.0, math.exp(-1.0), 0.0]]  # exp(1), exp(2) capped at 2
    torch.testing.assert_close(w, torch.tensor(expected, dtype=F64), rtol=0, atol=1e-12)
    assert torch.equal(loss_mask, MASK)
    assert m["rollout/is_weight_mean"] == pytest.approx((4.0 + math.exp(-0.5) + 1.0 + math.exp(-1.0)) / 5)
    assert m["rollout/frac_masked"] == 0.0


def test_token_tis_cap_bounds_every_weight():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(4, 7, generator=g, dtype=F64), torch.randn(4, 7, generator=g, dtype=F64)
    for cap in (0.5, 1.0, 3.0):
        w, _, _ = rollout_correction("token_tis", a, b, torch.ones(4, 7), cap=cap)
        assert float(w.max()) <= cap
        ref = torch.minimum((a - b).exp(), torch.tensor(cap, dtype=F64))
        torch.testing.assert_close(w, ref, rtol=0, atol=1e-12)


def test_sequence_mask_geometric_mean_threshold():
    # seq 0: mean log ratio (1 - 0.5 + 2) / 3 = 0.8333 ; seq 1: (0 - 1) / 2 = -0.5
    keep = sequence_mask_keep(TRAINER, ROLLOUT, MASK, threshold=2.0)  # log 2 = 0.693
    assert keep.tolist() == [False, True]
    keep = sequence_mask_keep(TRAINER, ROLLOUT, MASK, threshold=3.0)  # log 3 = 1.0986
    assert keep.tolist() == [True, True]
    keep = sequence_mask_keep(TRAINER, ROLLOUT, MASK, threshold=1.5)  # log 1.5 = 0.405
    assert keep.tolist() == [False, False]


def test_sequence_mask_masks_whole_sequences_and_counts_them():
    w, loss_mask, m = rollout_correction("sequence_mask", TRAINER, ROLLOUT, MASK, threshold=2.0)
    assert w is None
    assert loss_mask.tolist() == [[0, 0, 0], [1, 1, 0]]
    assert m["rollout/frac_masked"] == pytest.approx(3 / 5)
    assert m["rollout/is_weight_mean"] == pytest.approx(2 / 5)


def test_token_tis_loss_and_gradient_match_float64_reference():
    """PPO-clip token-mean loss with TIS weights vs a loop written from the definition."""
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(3, 5, generator=g, dtype=F64) * 2
    rollout = old + 0.3 * torch.randn(3, 5, generator=g, dtype=F64)
    logp = (old + 0.1 * torch.randn(3, 5, generator=g, dtype=F64)).requires_grad_()
    adv = torch.randn(3, 5, generator=g, dtype=F64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]])
    w, loss_mask, _ = rollout_correction("token_tis", old, rollout, mask, cap=1.5)
    loss, _ = compute_policy_loss("ppo", logp, old, adv, loss_mask, is_weights=w, clip_low=0.2, clip_high=0.2)
    (grad,) = torch.autograd.grad(loss, logp)

    ref_logp = logp.detach().clone().requires_grad_()
    total = torch.zeros((), dtype=F64)
    for i in range(3):
        for t in range(5):
            if mask[i, t]:
                ratio = torch.exp(ref_logp[i, t] - old[i, t])
                weight = min(math.exp(float(old[i, t] - rollout[i, t])), 1.5)
                clipped = torch.clamp(ratio, 0.8, 1.2)
                total = total + weight * torch.maximum(-adv[i, t] * ratio, -adv[i, t] * clipped)
    ref = total / int(mask.sum())
    (ref_grad,) = torch.autograd.grad(ref, ref_logp)
    torch.testing.assert_close(loss.detach(), ref.detach(), rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-12)


def test_sequence_mask_loss_gradient_is_zero_on_masked_sequences():
    logp = TRAINER.clone().requires_grad_()
    adv = torch.ones_like(TRAINER)
    _, loss_mask, _ = rollout_correction("sequence_mask", TRAINER, ROLLOUT, MASK, threshold=2.0)
    loss, _ = compute_policy_loss("ppo", logp, TRAINER, adv, loss_mask)
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad[0].abs().sum() == 0  # the masked sequence gets no gradient
    # token-mean over the 2 kept tokens: d/dlogp of -A * ratio at ratio 1 is -1/2 per token
    assert grad[1].tolist() == pytest.approx([-0.5, -0.5, 0.0], abs=1e-12)


def test_no_gradient_flows_through_the_correction():
    old = TRAINER.clone().requires_grad_()
    rollout = ROLLOUT.clone().requires_grad_()
    w, _, _ = rollout_correction("token_tis", old, rollout, MASK)
    assert not w.requires_grad
    _, loss_mask, _ = rollout_correction("sequence_mask", old, rollout, MASK)
    assert not loss_mask.requires_grad


def test_bad_arguments_are_refused_with_the_rule():
    assert ROLLOUT_CORRECTIONS == ("none", "token_tis", "sequence_mask")
    with pytest.raises(ValueError, match="unknown rollout_correction 'tis'"):
        rollout_correction("tis", TRAINER, ROLLOUT, MASK)
    with pytest.raises(ValueError, match="threshold must be > 1"):
        rollout_correction("sequence_mask", TRAINER, ROLLOUT, MASK, threshold=1.0)
    with pytest.raises(ValueError, match="cap must be > 0"):
        rollout_correction("token_tis", TRAINER, ROLLOUT, MASK, cap=0.0)
    with pytest.raises(ValueError, match="must agree"):
        rollout_correction("none", TRAINER, ROLLOUT[:, :2], MASK)
