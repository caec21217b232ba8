"""AReaL's decoupled PPO (Fu et al. 2025, arXiv 2505.24298, Sec. 5.2): per token
``-(pi_prox / pi_behav) min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)``, ``r = pi_theta / pi_prox``, with the
optional ``behav_imp_weight_cap`` (a token whose weight exceeds the cap gets weight 0 and stays in the denominator).
``decoupled_weights`` + ``compute_policy_loss("ppo", old=pi_prox, is_weights=...)`` against a float64 loop (values
and gradients, token-mean and seq-mean-token-mean, responses whose tokens come from two policy versions, a cap that
drops some), the exact reduction to PPO when nothing is stale, the config rules, and ``policy_micro_loss`` on a
tiny model's micro-batch."""

import math

import pytest
import torch

from data_pipelines.collate import collate_sequences, encode_prompt
from data_pipelines.records import PromptRecord
from vlrft.algorithms import aggregate_loss, compute_policy_loss, decoupled_weights, kl_penalty
from vlrft.config import ConfigError, load_config
from vlrft.trainer.config import PolicyTrainConfig
from vlrft.trainer.experience import Experience, response_logprobs, response_tensors
from vlrft.trainer.micro_losses import policy_micro_loss

F64 = torch.float64
EPS_LOW, EPS_HIGH = 0.2, 0.28


# ---------------------------------------------------------------- the float64 reference, one token at a time


def _ref_token(logp: float, prox: float, behav: float, adv: float, cap: float | None) -> tuple[float, float]:
    """(loss, d loss / d log pi_theta) of one token, in Python floats."""
    w = math.exp(prox - behav)
    if cap is not None and w > cap:
        w = 0.0
    r = math.exp(logp - prox)
    unclipped, clipped = r * adv, min(max(r, 1 - EPS_LOW), 1 + EPS_HIGH) * adv
    # the objective is the smaller term; only the unclipped one depends on r where they differ (d(rA)/dlog r = rA)
    grad_objective = r * adv if unclipped <= clipped else 0.0
    return -w * min(unclipped, clipped), -w * grad_objective


def _ref_loss(logp, prox, behav, adv, mask, mode, cap):
    rows = [[t for t in range(mask.shape[1]) if mask[i, t]] for i in range(mask.shape[0])]
    n_tok, n_seq = sum(map(len, rows)), sum(1 for r in rows if r)
    loss, grad = 0.0, torch.zeros_like(logp)
    for i, valid in enumerate(rows):
        for t in valid:
            value, g = _ref_token(float(logp[i, t]), float(prox[i, t]), float(behav[i, t]), float(adv[i, t]), cap)
            scale = 1 / n_tok if mode == "token-mean" else 1 / (n_seq * len(valid))
            loss += scale * value
            grad[i, t] = scale * g
    return loss, grad


def _decoupled_loss(logp, prox, behav, adv, mask, mode, cap):
    weights, loss_mask, metrics = decoupled_weights(prox, behav, mask, cap=cap)
    loss, _ = compute_policy_loss(
        "ppo",
        logp,
        prox,
        adv,
        loss_mask,
        clip_low=EPS_LOW,
        clip_high=EPS_HIGH,
        is_weights=weights,
        loss_agg_mode=mode,
    )
    (grad,) = torch.autograd.grad(loss, logp)
    return loss, grad, weights, metrics


def _policy_logp(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Log-probs ``[B, T]`` of ``tokens`` under a hand-made policy given by its logits ``[B, T, V]``."""
    return logits.log_softmax(-1).gather(-1, tokens[..., None])[..., 0]


def _two_version_batch(seed: int = 11):
    """Four responses over a 6-word vocabulary: each token sampled by policy version 0 or 1 (``version``), the
    proximal policy a third one, the current policy the proximal one moved; a zero-length response among them."""
    g = torch.Generator().manual_seed(seed)
    b, t, v = 4, 6, 6
    tokens = torch.randint(0, v, (b, t), generator=g)
    logits_v0 = torch.randn(b, t, v, generator=g, dtype=F64)
    logits_v1 = logits_v0 + 0.8 * torch.randn(b, t, v, generator=g, dtype=F64)
    logits_prox = logits_v1 + 0.8 * torch.randn(b, t, v, generator=g, dtype=F64)
    version = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 1, 0, 1, 0, 1], [1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
    behav = torch.where(version == 0, _policy_logp(logits_v0, tokens), _policy_logp(logits_v1, tokens))
    prox = _policy_logp(logits_prox, tokens)
    logp = (prox + 0.3 * torch.randn(b, t, generator=g, dtype=F64)).requires_grad_()
    adv = torch.randn(b, t, generator=g, dtype=F64)
    mask = torch.arange(t)[None] < torch.tensor([[6], [4], [0], [5]])
    return logp, prox, behav, adv, mask, version


# ---------------------------------------------------------------- by hand


def test_hand_computed_tokens_cap_semantics_and_metrics():
    # pi_prox 0.5 on three tokens; pi_behav 0.5, 0.25, 0.1: weights 1, 2, 5. The cap is the second weight itself:
    # a weight equal to the cap is kept, the third (5 > cap) gets 0 and stays in the denominator (3 tokens).
    prox = torch.full((1, 3), math.log(0.5), dtype=F64)
    behav = torch.log(torch.tensor([[0.5, 0.25, 0.1]], dtype=F64))
    mask = torch.ones(1, 3, dtype=torch.bool)
    cap = float((prox - behav).exp()[0, 1])
    assert cap == pytest.approx(2.0, abs=1e-15)
    # r = 1.1, 1.0, 1.0; A = +1, -1, +1
    logp = (prox + torch.log(torch.tensor([[1.1, 1.0, 1.0]], dtype=F64))).requires_grad_()
    adv = torch.tensor([[1.0, -1.0, 1.0]], dtype=F64)
    loss, grad, weights, m = _decoupled_loss(logp, prox, behav, adv, mask, "token-mean", cap)
    assert weights[0].tolist() == pytest.approx([1.0, 2.0, 0.0], abs=1e-15)
    # token 0: -1 * 1.1 * 1; token 1: -2 * 1 * (-1) = 2; token 2: weight 0. Mean over 3 tokens.
    assert loss.item() == pytest.approx((-1.1 + 2.0) / 3, abs=1e-12)
    assert grad[0].tolist() == pytest.approx([-1.1 / 3, 2 / 3, 0.0], abs=1e-12)
    assert m["off_policy/behav_weight_mean"] == pytest.approx(1.0, abs=1e-12)
    assert m["off_policy/behav_weight_max"] == pytest.approx(5.0, abs=1e-12)
    assert m["off_policy/frac_capped"] == pytest.approx(1 / 3)
    assert m["off_policy/logprob_diff_mean"] == pytest.approx((math.log(2) + math.log(5)) / 3, abs=1e-12)
    # without a cap the third token counts with weight 5: -5 * 1 * 1
    loss, grad, weights, m = _decoupled_loss(logp, prox, behav, adv, mask, "token-mean", None)
    assert weights[0].tolist() == pytest.approx([1.0, 2.0, 5.0], abs=1e-12)
    assert loss.item() == pytest.approx((-1.1 + 2.0 - 5.0) / 3, abs=1e-12)
    assert grad[0].tolist() == pytest.approx([-1.1 / 3, 2 / 3, -5 / 3], abs=1e-12)
    assert m["off_policy/frac_capped"] == 0 and m["off_policy/behav_weight_mean"] == pytest.approx(8 / 3)


def test_weights_are_detached_and_zero_outside_the_mask():
    prox = torch.tensor([[-1.0, -2.0, -0.5]], dtype=F64, requires_grad=True)
    behav = torch.tensor([[-1.5, -1.0, -9.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0]])
    weights, loss_mask, m = decoupled_weights(prox, behav, mask, cap=5.0)
    assert not weights.requires_grad and loss_mask is mask
    assert weights[0].tolist() == pytest.approx([math.exp(0.5), math.exp(-1.0), 0.0], abs=1e-15)
    assert m["off_policy/behav_weight_max"] == pytest.approx(math.exp(0.5))  # the masked token's e^8.5 is not seen
    # a NaN log-ratio (-inf - -inf) reads as weight 1; an infinite one is clamped to e^20, which a cap drops
    inf = float("inf")
    weights, _, m = decoupled_weights(torch.tensor([[-inf, 0.0]]), torch.tensor([[-inf, -inf]]), torch.ones(1, 2), 5.0)
    assert weights.tolist() == [[1.0, 0.0]] and m["off_policy/frac_capped"] == 0.5
    assert m["off_policy/behav_weight_max"] == pytest.approx(math.exp(20.0), rel=1e-6)
    with pytest.raises(ValueError, match=r"decoupled_weights: cap must be > 1 \(or None\), got 1.0"):
        decoupled_weights(prox, behav, mask, cap=1.0)
    with pytest.raises(ValueError, match=r"decoupled_weights: shapes \(1, 3\), \(1, 2\), \(1, 3\) must agree"):
        decoupled_weights(prox, behav[:, :2], mask)


# ---------------------------------------------------------------- against the float64 loop


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("cap", [None, 1.5])
def test_matches_float64_loop_with_two_policy_versions_and_a_cap(mode, cap):
    logp, prox, behav, adv, mask, version = _two_version_batch()
    loss, grad, weights, m = _decoupled_loss(logp, prox, behav, adv, mask, mode, cap)
    ref_loss, ref_grad = _ref_loss(logp.detach(), prox, behav, adv, mask, mode, cap)
    assert loss.item() == pytest.approx(ref_loss, abs=1e-12)
    torch.testing.assert_close(grad, ref_grad, atol=1e-12, rtol=0)
    # the batch covers what the test claims: both versions among valid tokens, clipped tokens, and with the cap some
    # (not all) tokens dropped, which keep no gradient; masked tokens never have one
    assert {0, 1} <= set(version[mask].tolist())
    r = (logp - prox).detach().exp()[mask]
    assert ((r < 1 - EPS_LOW) | (r > 1 + EPS_HIGH)).any()
    raw = (prox - behav).exp()
    if cap is None:
        assert m["off_policy/frac_capped"] == 0
        torch.testing.assert_close(weights[mask], raw[mask], atol=0, rtol=0)
    else:
        dropped = mask & (raw > cap)
        assert 0 < int(dropped.sum()) < int(mask.sum())
        assert m["off_policy/frac_capped"] == pytest.approx(int(dropped.sum()) / int(mask.sum()))
        assert (weights[dropped] == 0).all() and (grad[dropped] == 0).all()
    assert (grad[~mask] == 0).all()
    assert m["off_policy/behav_weight_max"] == pytest.approx(float(raw[mask].max()), abs=1e-12)
    assert m["off_policy/logprob_diff_mean"] == pytest.approx(float((prox - behav).abs()[mask].mean()), abs=1e-12)


def test_behaviour_equal_to_proximal_is_plain_ppo_exactly():
    logp, prox, _, adv, mask, _ = _two_version_batch(seed=12)
    for mode in ("token-mean", "seq-mean-token-mean"):
        loss, grad, weights, m = _decoupled_loss(logp, prox, prox.clone(), adv, mask, mode, 1.5)
        assert (weights[mask] == 1).all() and m["off_policy/frac_capped"] == 0
        ppo, _ = compute_policy_loss(
            "ppo", logp, prox, adv, mask, clip_low=EPS_LOW, clip_high=EPS_HIGH, loss_agg_mode=mode
        )
        (ppo_grad,) = torch.autograd.grad(ppo, logp)
        assert loss.item() == ppo.item()
        assert torch.equal(grad, ppo_grad)


# ---------------------------------------------------------------- the config


def _refused(overrides):
    with pytest.raises(ConfigError) as e:
        load_config(PolicyTrainConfig, None, overrides)
    assert "\n" not in str(e.value)
    return str(e.value)


def test_config_rules_are_one_line_errors():
    cfg = load_config(PolicyTrainConfig, None, ["algorithm.off_policy=decoupled", "algorithm.behav_imp_weight_cap=5"])
    assert cfg.algorithm.off_policy == "decoupled" and cfg.algorithm.behav_imp_weight_cap == 5.0
    defaults = load_config(PolicyTrainConfig, None, [])
    assert defaults.algorithm.off_policy == "none" and defaults.algorithm.behav_imp_weight_cap is None
    assert _refused(["algorithm.off_policy=decoupled", "algorithm.rollout_correction=token_tis"]) == (
        "algorithm.rollout_correction=token_tis: not with algorithm.off_policy=decoupled, which already weights each "
        "token by pi_prox / pi_behav (what rollout correction does); set it to none"
    )
    assert _refused(["algorithm.behav_imp_weight_cap=5"]) == (
        "algorithm.behav_imp_weight_cap=5.0: read by off_policy decoupled only, not none; leave it unset"
    )
    for cap in ("1", "0.5"):
        assert _refused(["algorithm.off_policy=decoupled", f"algorithm.behav_imp_weight_cap={cap}"]) == (
            f"algorithm.behav_imp_weight_cap={float(cap)}: must be > 1"
        )
    assert "'algorithm.off_policy' = 'async' is not allowed" in _refused(["algorithm.off_policy=async"])


# ---------------------------------------------------------------- policy_micro_loss on a tiny model


def test_policy_micro_loss_decoupled_equals_compute_policy_loss_with_hand_weights(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_model("qwen2")
    model, tok = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    prompts = [encode_prompt(tok, PromptRecord(id=str(i), prompt=p)) for i, p in enumerate(["2+2?", "What is 3x4?"])]
    responses = [torch.tensor([11, 12, 13, 14]), torch.tensor([21, 22]), torch.tensor([31, 32, 33])]
    index = [0, 1, 1]
    batch = collate_sequences(prompts, index, responses, tok.pad_token_id)
    ids, mask = response_tensors(responses, tok.pad_token_id)
    with torch.no_grad():
        current, _ = response_logprobs(model, batch, ids)
    g = torch.Generator().manual_seed(5)
    prox = current + 0.3 * torch.randn(current.shape, generator=g)  # the proximal policy: a step behind
    # the engine's log-probs: each token from one of two older versions
    older = [prox + 0.6 * torch.randn(current.shape, generator=g) for _ in range(2)]
    version = torch.tensor([[0, 1, 0, 1], [1, 1, 0, 0], [0, 0, 1, 0]])
    behav = torch.where(version == 0, older[0], older[1])
    adv = torch.tensor([[1.0], [-0.5], [2.0]]).expand(3, 4).contiguous()
    exp = Experience(batch, ids, mask, prox, None, torch.zeros(3), adv, torch.tensor(index), rollout_log_probs=behav)
    mb = exp.micro_batch(torch.arange(3))
    cfg = load_config(
        PolicyTrainConfig,
        None,
        ["algorithm.off_policy=decoupled", "algorithm.behav_imp_weight_cap=1.5", "algorithm.clip_high=0.28"],
    )
    a, n_tok = cfg.algorithm, int(mask.sum())
    run = dict(kl_coef=0.0, temperature=1.0, shared=False, suppress=None)
    loss, metrics = policy_micro_loss(model, mb, a, n_tok, 3, 4, **run)

    # by hand: w = pi_prox / pi_behav, 0 where it exceeds the cap; PPO around pi_prox, the same global counts
    w = (prox - behav).exp()
    capped = mask.bool() & (w > 1.5)
    assert 0 < int(capped.sum()) < n_tok
    w = torch.where(mask.bool() & ~capped, w, torch.zeros_like(w))
    logp, _ = response_logprobs(model, batch, ids)
    expected, _ = compute_policy_loss(
        "ppo", logp, prox, adv, mask, clip_low=0.2, clip_high=0.28, is_weights=w, global_token_count=n_tok
    )
    assert loss.item() == pytest.approx(expected.item(), abs=1e-6)
    assert metrics["policy/loss"] == loss.item()
    assert metrics["off_policy/frac_capped"] == pytest.approx(int(capped.sum()) / n_tok)
    assert metrics["off_policy/behav_weight_mean"] == pytest.approx(float(w[mask.bool()].mean()), abs=1e-6)
    assert "rollout/logprob_diff_mean" not in metrics  # decoupled replaces rollout correction
    # with off_policy none the same micro-batch gets plain PPO (weights 1) and rollout correction's metrics
    plain, plain_metrics = policy_micro_loss(
        model, mb, load_config(PolicyTrainConfig, None, []).algorithm, n_tok, 3, 4, **run
    )
    expected_plain, _ = compute_policy_loss("ppo", logp, prox, adv, mask, global_token_count=n_tok)
    assert plain.item() == pytest.approx(expected_plain.item(), abs=1e-6) and plain.item() != pytest.approx(loss.item())
    assert "rollout/logprob_diff_mean" in plain_metrics and "off_policy/frac_capped" not in plain_metrics

    # without the engine's log-probs decoupled cannot run: said, not guessed
    no_engine = {k: v for k, v in mb.items() if k != "rollout_log_probs"}
    with pytest.raises(ValueError, match="algorithm.off_policy=decoupled: the micro-batch has no rollout_log_probs"):
        policy_micro_loss(model, no_engine, a, n_tok, 3, 4, **run)
    # in a step of one update the trainer computes no old log-probs: the proximal policy is the current one, its own
    # log-probs detached (the policy before this update), weighed against the engine's
    no_old = {k: v for k, v in mb.items() if k != "old_log_probs"}
    single, _ = policy_micro_loss(model, no_old, a, n_tok, 3, 4, **run)
    w1 = (logp.detach() - behav).exp()
    w1 = torch.where(mask.bool() & (w1 <= 1.5), w1, torch.zeros_like(w1))
    expected_single, _ = compute_policy_loss(
        "ppo", logp, logp.detach(), adv, mask, clip_low=0.2, clip_high=0.28, is_weights=w1, global_token_count=n_tok
    )
    assert single.item() == pytest.approx(expected_single.item(), abs=1e-6)

    # the KL term's tokens came from pi_behav too: under decoupled each token's k3 is weighed by the same
    # pi_prox / pi_behav (0 where capped), so the stale batch estimates the proximal policy's KL, not the behaviour's
    ref = current + 0.4 * torch.randn(current.shape, generator=g)
    with_ref = Experience(
        batch, ids, mask, prox, ref, torch.zeros(3), adv, torch.tensor(index), rollout_log_probs=behav
    )
    mb_ref = with_ref.micro_batch(torch.arange(3))
    kl_run = dict(run, kl_coef=0.1)
    with_kl, kl_metrics = policy_micro_loss(model, mb_ref, a, n_tok, 3, 4, **kl_run)
    k3 = kl_penalty(logp, ref, "k3")
    expected_kl = expected + 0.1 * aggregate_loss(k3 * w, mask, "token-mean", global_token_count=n_tok)
    assert with_kl.item() == pytest.approx(expected_kl.item(), abs=1e-6)
    assert kl_metrics["kl"] == pytest.approx(float(k3.detach()[mask.bool()].mean()), abs=1e-6)  # the metric: unweighted
    # with off_policy none the KL term is the plain mean of k3 over the response tokens
    plain_kl, _ = policy_micro_loss(
        model, mb_ref, load_config(PolicyTrainConfig, None, []).algorithm, n_tok, 3, 4, **kl_run
    )
    expected_plain_kl = expected_plain + 0.1 * aggregate_loss(k3, mask, "token-mean", global_token_count=n_tok)
    assert plain_kl.item() == pytest.approx(expected_plain_kl.item(), abs=1e-6)
    # with algorithm.high_entropy_rho < 1 the policy loss sees only the high-entropy tokens, the KL term every
    # response token, each weighed by pi_prox / pi_behav: the KL part of the loss is unchanged
    rho = load_config(
        PolicyTrainConfig,
        None,
        ["algorithm.off_policy=decoupled", "algorithm.behav_imp_weight_cap=1.5", "algorithm.high_entropy_rho=0.5"],
    ).algorithm
    with_rho, _ = policy_micro_loss(model, mb_ref, rho, n_tok, 3, 4, **kl_run)
    without_kl, _ = policy_micro_loss(model, mb_ref, rho, n_tok, 3, 4, **run)
    kl_part = 0.1 * aggregate_loss(k3 * w, mask, "token-mean", global_token_count=n_tok)
    assert (with_rho - without_kl).item() == pytest.approx(kl_part.item(), abs=1e-6)
