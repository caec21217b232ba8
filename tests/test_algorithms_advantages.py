"""Advantage estimators: hand-computed cases, float64 reference loops, degenerate inputs."""

import math
import statistics

import pytest
import torch

from vlrft.algorithms.advantages import ADVANTAGE_ESTIMATORS, compute_advantages
from vlrft.algorithms.kl import apply_kl_penalty

F64 = torch.float64


def _first_token(adv):
    return adv[:, 0].tolist()


def _ones(n, t=2):
    return torch.ones(n, t, dtype=torch.bool)


# ---------------------------------------------------------------- hand-computed cases


# Tolerances in this file: abs=1e-12 where float64 results meet closed forms (rounding ~1e-16 per op);
# abs=1e-5 / 1e-4 where the expected values are decimals written to 7 / 4 significant digits (the literal's
# own rounding is the bound).


def test_grpo_group_batch_and_none_hand_computed():
    r = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 1.0], dtype=F64)
    ids = [0, 0, 0, 1, 1, 1]
    # group 0: mean 2/3, unbiased std sqrt(1/3) = 0.57735 -> (1/3)/0.57735 = 0.57735, (-2/3)/0.57735 = -1.1547
    adv, ret = compute_advantages("grpo", r, _ones(6), group_ids=ids)
    assert _first_token(adv) == pytest.approx([0.5773497, -1.1547005, 0.5773497, 0, 0, 0], abs=1e-5)
    assert torch.equal(ret[:, 0], r)  # returns: the sample's reward on its tokens
    # Dr.GRPO: no std division
    adv, _ = compute_advantages("grpo", r, _ones(6), group_ids=ids, std_normalization="none")
    assert _first_token(adv) == pytest.approx([1 / 3, -2 / 3, 1 / 3, 0, 0, 0], abs=1e-12)
    # group mean, batch std: batch std of [1,0,1,1,1,1] = sqrt(1/6) = 0.408248
    adv, _ = compute_advantages("grpo", r, _ones(6), group_ids=ids, std_normalization="batch")
    assert _first_token(adv) == pytest.approx([0.8164946, -1.6329892, 0.8164946, 0, 0, 0], abs=1e-5)
    # cpgd's weighted advantage with w = 1/std equals the group-normalised one
    adv_c, _ = compute_advantages("cpgd", r, _ones(6), group_ids=ids)
    assert _first_token(adv_c) == pytest.approx([0.5773497, -1.1547005, 0.5773497, 0, 0, 0], abs=1e-5)


def test_rloo_leave_one_out_hand_computed():
    r = torch.tensor([3.0, 1.0, 0.0, 2.0, 1.0, 0.0, 1.0], dtype=F64)
    ids = torch.tensor([7, 7, 7, 7, 9, 9, 9])
    # 3 - (1+0+2)/3 = 2; 1 - 5/3 = -2/3; 0 - 6/3 = -2; 2 - 4/3 = 2/3 ; 1 - 1/2 = 1/2; 0 - 1 = -1; 1 - 1/2
    adv, _ = compute_advantages("rloo", r, _ones(7), group_ids=ids)
    assert _first_token(adv) == pytest.approx([2, -2 / 3, -2, 2 / 3, 0.5, -1, 0.5], abs=1e-12)


def test_reinforce_plus_plus_hand_computed():
    r = torch.tensor([1.0, 0.0], dtype=F64)
    mask = torch.tensor([[1, 1], [1, 0]], dtype=torch.bool)
    # gamma 1: token returns [1, 1], [0] -> values (1, 1, 0): mean 2/3, std sqrt(1/3)
    adv, ret = compute_advantages("reinforce_plus_plus", r, mask)
    assert ret.tolist() == [[1, 1], [0, 0]]
    assert adv.flatten().tolist() == pytest.approx([0.5773497, 0.5773497, -1.1547005, 0], abs=1e-5)
    # gamma 0.5: returns [0.5, 1], [0] -> mean 0.5, std 0.5 -> [0, 1], [-1]
    adv, ret = compute_advantages("reinforce_plus_plus", r, mask, gamma=0.5)
    assert ret.tolist() == [[0.5, 1], [0, 0]]
    assert adv.flatten().tolist() == pytest.approx([0, 0.999998, -0.999998, 0], abs=1e-5)


def test_reinforce_plus_plus_baseline_hand_computed():
    r = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=F64)
    # group means 0.5 and 1 -> centred (0.5, -0.5, 0, 0); batch mean 0, unbiased std sqrt(1/6)
    adv, _ = compute_advantages("reinforce_plus_plus_baseline", r, _ones(4, 1), group_ids=[0, 0, 1, 1])
    assert _first_token(adv) == pytest.approx([1.2247419, -1.2247419, 0, 0], abs=1e-5)


def test_gae_hand_computed_and_skips_masked_positions():
    # r = 1 on the last token, V = (0.5, 0.2, 0.4), gamma 0.9, lambda 0.8:
    # t2: delta = 1 - 0.4 = 0.6, A = 0.6 ; t1: delta = 0.9*0.4 - 0.2 = 0.16, A = 0.16 + 0.72*0.6 = 0.592
    # t0: delta = 0.9*0.2 - 0.5 = -0.32, A = -0.32 + 0.72*0.592 = 0.10624 ; returns = A + V
    r = torch.tensor([1.0], dtype=F64)
    v = torch.tensor([[0.5, 0.2, 0.4]], dtype=F64)
    adv, ret = compute_advantages("gae", r, _ones(1, 3), values=v, gamma=0.9, lam=0.8, std_normalization="none")
    assert adv[0].tolist() == pytest.approx([0.10624, 0.592, 0.6], abs=1e-12)
    assert ret[0].tolist() == pytest.approx([0.60624, 0.792, 1.0], abs=1e-12)
    # an observation token in the middle (mask 0, value 9) is skipped, not bootstrapped from
    v_gap = torch.tensor([[0.5, 9.0, 0.2, 0.4]], dtype=F64)
    gap = torch.tensor([[1, 0, 1, 1]], dtype=torch.bool)
    adv, ret = compute_advantages("gae", r, gap, values=v_gap, gamma=0.9, lam=0.8, std_normalization="none")
    assert adv[0].tolist() == pytest.approx([0.10624, 0, 0.592, 0.6], abs=1e-12)
    assert ret[0, 1] == 0
    # default "batch" whitens the advantages over valid tokens
    adv_w, _ = compute_advantages("gae", r, _ones(1, 3), values=v, gamma=0.9, lam=0.8)
    raw = [0.10624, 0.592, 0.6]
    mu, sd = statistics.mean(raw), statistics.stdev(raw)
    assert adv_w[0].tolist() == pytest.approx([(x - mu) / (sd + 1e-6) for x in raw], abs=1e-9)


def test_token_level_rewards_with_kl_penalty():
    # reward 1 on the last token, -0.1 * kl on each token: token rewards (-0.02, -0.03 + 1)
    r = torch.tensor([1.0], dtype=F64)
    kl = torch.tensor([[0.2, 0.3, 5.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0]], dtype=torch.bool)
    tok = apply_kl_penalty(r, kl, mask, kl_coef=0.1)
    assert tok[0].tolist() == pytest.approx([-0.02, 0.97, 0.0], abs=1e-12)
    _, ret = compute_advantages("reinforce_plus_plus", tok, mask)
    assert ret[0].tolist() == pytest.approx([0.95, 0.97, 0.0], abs=1e-12)
    # group estimators use the per-sample sum of token rewards: 0.95
    _, ret = compute_advantages("grpo", tok.expand(2, 3), mask.expand(2, 3), group_ids=[0, 0])
    assert ret[0, 0].item() == pytest.approx(0.95, abs=1e-12)


# ---------------------------------------------------------------- float64 reference loops


def _random_batch(seed, groups=4, n=5, length=6):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randint(0, 4, (groups * n,), generator=g).to(F64) / 3
    lengths = torch.randint(0, length + 1, (groups * n,), generator=g)
    lengths[0] = 0  # a zero-length response
    mask = torch.arange(length)[None] < lengths[:, None]
    ids = torch.arange(groups).repeat_interleave(n)[torch.randperm(groups * n, generator=g)]
    values = torch.randn(groups * n, length, generator=g, dtype=F64)
    return rewards, mask, ids, values


def _whiten_ref(vals):
    mu = statistics.mean(vals)
    sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
    return [(x - mu) / (sd + 1e-6) for x in vals] if len(set(vals)) > 1 else [0.0] * len(vals)


def _reference(name, rewards, mask, ids, values, gamma, lam, norm):
    n, length = mask.shape
    r = rewards.tolist()
    ids = ids.tolist()
    groups = {}
    for i, gid in enumerate(ids):
        groups.setdefault(gid, []).append(i)
    adv = [[0.0] * length for _ in range(n)]
    if name in ("grpo", "rloo"):
        batch_sd = statistics.stdev(r)
        for i in range(n):
            members = [r[j] for j in groups[ids[i]]]
            k = len(members)
            if name == "grpo":
                a = r[i] - statistics.mean(members)
            else:
                a = r[i] - (sum(members) - r[i]) / (k - 1)
            if len(set(members)) == 1:
                a = 0.0
            if norm == "group":
                a /= statistics.stdev(members) + 1e-6
            elif norm == "batch":
                a /= batch_sd + 1e-6
            for t in range(length):
                if mask[i, t]:
                    adv[i][t] = a
        return adv
    if name in ("reinforce_plus_plus", "reinforce_plus_plus_baseline"):
        rets = [[0.0] * length for _ in range(n)]
        flat = []
        for i in range(n):
            base = statistics.mean(r[j] for j in groups[ids[i]]) if name.endswith("baseline") else 0.0
            valid = [t for t in range(length) if mask[i, t]]
            g_ = 0.0
            for step, t in enumerate(reversed(valid)):
                g_ = (r[i] - base if step == 0 else 0.0) + gamma * g_
                rets[i][t] = g_
            flat += [rets[i][t] for t in valid]
        w = iter(_whiten_ref(flat))
        for i in range(n):
            for t in range(length):
                if mask[i, t]:
                    adv[i][t] = next(w)
        return adv
    # gae
    flat = []
    for i in range(n):
        valid = [t for t in range(length) if mask[i, t]]
        nxt_v, nxt_a = 0.0, 0.0
        for step, t in enumerate(reversed(valid)):
            rew = r[i] if step == 0 else 0.0
            delta = rew + gamma * nxt_v - float(values[i, t])
            nxt_a = delta + gamma * lam * nxt_a
            nxt_v = float(values[i, t])
            adv[i][t] = nxt_a
        flat += [adv[i][t] for t in valid]
    w = iter(_whiten_ref(flat))
    for i in range(n):
        for t in range(length):
            if mask[i, t]:
                adv[i][t] = next(w)
    return adv


@pytest.mark.parametrize(
    "name,norm,gamma,lam",
    [
        ("grpo", "group", 1.0, 1.0),
        ("grpo", "batch", 1.0, 1.0),
        ("grpo", "none", 1.0, 1.0),
        ("rloo", "none", 1.0, 1.0),
        ("rloo", "group", 1.0, 1.0),
        ("reinforce_plus_plus", None, 0.9, 1.0),
        ("reinforce_plus_plus_baseline", None, 1.0, 1.0),
        ("gae", None, 0.95, 0.9),
    ],
)
@pytest.mark.parametrize("seed", [0, 1])
def test_matches_float64_reference_loop(name, norm, gamma, lam, seed):
    rewards, mask, ids, values = _random_batch(seed)
    adv, _ = compute_advantages(
        name, rewards, mask, group_ids=ids, values=values, gamma=gamma, lam=lam, std_normalization=norm
    )
    ref = torch.tensor(_reference(name, rewards, mask, ids, values, gamma, lam, norm), dtype=F64)
    torch.testing.assert_close(adv, ref, atol=1e-9, rtol=1e-9)
    assert torch.isfinite(adv).all() and (adv[~mask] == 0).all()


# ---------------------------------------------------------------- degenerate cases


@pytest.mark.parametrize("name", ["grpo", "rloo", "cpgd"])
@pytest.mark.parametrize("norm", ["group", "batch", "none"])
def test_all_equal_group_gives_exact_zero(name, norm):
    # 0.1 three times: the float mean is not exactly 0.1, the advantage must still be exactly 0
    r = torch.tensor([0.1, 0.1, 0.1, 0.0, 1.0, 1.0])
    adv, _ = compute_advantages(name, r, _ones(6), group_ids=[0, 0, 0, 1, 1, 1], std_normalization=norm)
    assert torch.isfinite(adv).all()
    assert (adv[:3] == 0).all()
    assert (adv[3:] != 0).all()


@pytest.mark.parametrize("name", sorted(ADVANTAGE_ESTIMATORS))
def test_all_equal_batch_fully_masked_and_zero_length_are_finite(name):
    teacher = ADVANTAGE_ESTIMATORS[name].teacher  # opd: per-token rewards (0: the student is the teacher)
    r = torch.zeros(4, 2) if teacher else torch.full((4,), 0.7)
    mask = torch.tensor([[1, 1], [1, 0], [0, 0], [1, 1]], dtype=torch.bool)  # row 2: zero-length response
    kw = {"values": torch.full((4, 2), 0.7)} if name == "gae" else {}
    adv, ret = compute_advantages(name, r, mask, group_ids=[0, 0, 1, 1], **kw)
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    assert (adv[~mask] == 0).all()
    if name != "gae":  # all rewards equal -> nothing to prefer
        assert (adv == 0).all()
    r = torch.ones(4, 2) if teacher else torch.tensor([1.0, 0.0, 1.0, 0.0])
    adv, ret = compute_advantages(name, r, torch.zeros(4, 2, dtype=torch.bool), group_ids=[0, 0, 1, 1], **kw)
    assert (adv == 0).all() and (ret == 0).all()  # a fully masked batch: zeros, not NaN


@pytest.mark.parametrize("name", ["grpo", "rloo", "cpgd", "reinforce_plus_plus_baseline"])
def test_group_of_one_is_refused(name):
    with pytest.raises(ValueError, match=r"at least 2 samples per prompt group, but group 5 has 1"):
        compute_advantages(name, torch.tensor([1.0, 0.0, 1.0]), _ones(3), group_ids=[3, 3, 5])
    # reinforce_plus_plus needs no groups at all
    adv, _ = compute_advantages("reinforce_plus_plus", torch.tensor([1.0, 0.0, 1.0]), _ones(3))
    assert torch.isfinite(adv).all()


def test_bad_arguments_raise_clear_errors():
    r, m = torch.tensor([1.0, 0.0]), _ones(2)
    with pytest.raises(ValueError, match="unknown advantage_estimator 'ppo'"):
        compute_advantages("ppo", r, m, group_ids=[0, 0])
    with pytest.raises(ValueError, match="needs group_ids"):
        compute_advantages("grpo", r, m)
    with pytest.raises(ValueError, match="'gae' needs values"):
        compute_advantages("gae", r, m)
    with pytest.raises(ValueError, match="std_normalization='group' does not apply to advantage estimator 'gae'"):
        compute_advantages("gae", r, m, values=torch.zeros(2, 2), std_normalization="group")
    with pytest.raises(ValueError, match="reward of sample 1 is not finite"):
        compute_advantages("grpo", torch.tensor([1.0, math.nan]), m, group_ids=[0, 0])
    with pytest.raises(ValueError, match="group_ids has 3 entries for 2 samples"):
        compute_advantages("grpo", r, m, group_ids=[0, 0, 0])


def test_string_group_ids_and_float32_inputs():
    adv, _ = compute_advantages("grpo", torch.tensor([1.0, 0.0, 0.5, 0.5]), _ones(4), group_ids=["a", "a", "b", "b"])
    assert adv.dtype == torch.float32
    assert _first_token(adv) == pytest.approx([0.7071, -0.7071, 0, 0], abs=1e-4)
