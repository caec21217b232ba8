"""Rollout correction: the engine that sampled the responses (vLLM) is not exactly the trainer.

Its kernels, precision and sampling code give probabilities ``pi_rollout`` that differ from the
trainer's ``pi_old`` for the same weights, so an "on-policy" update is in fact slightly off-policy.
``algorithm.rollout_correction`` chooses what to do about it (``ROLLOUT_CORRECTIONS``):

- ``none``: nothing (the engine's log-probs are still compared with the trainer's and logged).
- ``token_tis``: truncated importance sampling per token, ``w_t = min(pi_old(y_t) / pi_rollout(y_t), C)``
  multiplying the per-token policy loss (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings
  You Off-Policy RL Training", TIS; the weights are :func:`~vlrft.algorithms.policy_losses.truncated_is_weights`).
- ``sequence_mask``: masked importance sampling per sequence: a response whose geometric-mean ratio
  ``exp(mean_t log(pi_old(y_t) / pi_rollout(y_t)))`` lies outside ``[1/tau, tau]`` is left out of the loss
  (verl's rollout correction, "rollout_rs" sequence-level rejection / MIS, with the geometric mean so
  that the threshold does not depend on the response length).

Metrics (over response tokens): ``rollout/logprob_diff_mean`` and ``rollout/logprob_diff_max`` of
``|log pi_old - log pi_rollout|``, ``rollout/is_weight_mean`` (the weight each token gets: the TIS weight,
1 or 0 under sequence masking, 1 under none) and ``rollout/frac_masked`` (tokens whose sequence was masked).

``algorithm.off_policy`` (``OFF_POLICY_CORRECTIONS``) is the asynchronous-RL counterpart: ``decoupled`` is AReaL's
decoupled PPO (:func:`decoupled_weights`), where the engine's log-probs are those of the (possibly older, per token
different) policy that sampled each token, and the same weight ``pi_old / pi_rollout`` corrects both the staleness
and the engine mismatch; it replaces rollout correction.
"""

from __future__ import annotations

import torch

from vlrft.algorithms.masked import masked_mean
from vlrft.algorithms.policy_losses import truncated_is_weights

Tensor = torch.Tensor

ROLLOUT_CORRECTIONS = ("none", "token_tis", "sequence_mask")
OFF_POLICY_CORRECTIONS = ("none", "decoupled")
_MAX_LOG_RATIO = 20.0


def sequence_mask_keep(trainer_logp: Tensor, rollout_logp: Tensor, mask: Tensor, threshold: float = 2.0) -> Tensor:
    """``[B]`` bool: sequences whose geometric-mean importance ratio lies in ``[1/threshold, threshold]``
    (empty sequences are kept; they carry no loss anyway)."""
    if threshold <= 1:
        raise ValueError(f"sequence_mask threshold must be > 1, got {threshold}")
    with torch.no_grad():
        m = mask.bool()
        diff = torch.where(m, trainer_logp.detach() - rollout_logp.detach(), torch.zeros_like(trainer_logp))
        mean_log_ratio = diff.sum(-1) / m.sum(-1).clamp(min=1).to(diff.dtype)
        bound = torch.log(torch.tensor(threshold, dtype=diff.dtype))
        return mean_log_ratio.abs() <= bound


def rollout_correction(
    mode: str,
    trainer_logp: Tensor,
    rollout_logp: Tensor | None,
    mask: Tensor,
    *,
    cap: float = 2.0,
    threshold: float = 2.0,
) -> tuple[Tensor | None, Tensor, dict[str, float]]:
    """``(is_weights, loss_mask, metrics)`` for one micro-batch ``[B, T]``.

    ``trainer_logp``: the trainer's old log-probs of the sampled tokens; ``rollout_logp``: the engine's.
    ``is_weights`` (``token_tis``, else None) go to ``compute_policy_loss(is_weights=...)``; ``loss_mask``
    replaces the response mask of the policy loss (``sequence_mask`` zeroes masked sequences). Nothing
    here carries gradient. ``rollout_logp=None`` (an engine that reports none: ``hf`` without FIRE) changes nothing."""
    if mode not in ROLLOUT_CORRECTIONS:
        raise ValueError(f"unknown rollout_correction {mode!r}; choose one of {', '.join(ROLLOUT_CORRECTIONS)}")
    if rollout_logp is None:
        return None, mask, {}
    rollout_logp = rollout_logp.to(trainer_logp.device)
    if trainer_logp.shape != rollout_logp.shape or trainer_logp.shape != mask.shape:
        raise ValueError(
            f"rollout_correction: shapes {tuple(trainer_logp.shape)}, {tuple(rollout_logp.shape)}, "
            f"{tuple(mask.shape)} must agree"
        )
    m = mask.bool()
    with torch.no_grad():
        diff = (trainer_logp.detach() - rollout_logp.detach()).abs()
        is_weights = None
        loss_mask = mask
        per_token = torch.ones_like(diff)
        if mode == "token_tis":
            is_weights = truncated_is_weights(trainer_logp, rollout_logp, m, cap=cap)
            per_token = is_weights
        elif mode == "sequence_mask":
            keep = sequence_mask_keep(trainer_logp, rollout_logp, m, threshold)
            loss_mask = mask * keep.unsqueeze(-1).to(mask.dtype)
            per_token = keep.unsqueeze(-1).to(diff.dtype).expand_as(diff)
        masked_out = m & ~loss_mask.bool()
        metrics = {
            "rollout/logprob_diff_mean": float(masked_mean(diff, m)),
            "rollout/logprob_diff_max": float(diff[m].max()) if m.any() else 0.0,
            "rollout/is_weight_mean": float(masked_mean(per_token, m)),
            "rollout/frac_masked": float(masked_out.sum()) / max(int(m.sum()), 1),
        }
    return is_weights, loss_mask, metrics


def decoupled_weights(
    proximal_logp: Tensor, behaviour_logp: Tensor, mask: Tensor, cap: float | None = None
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """``(weights, loss_mask, metrics)`` of AReaL's decoupled PPO for one micro-batch ``[B, T]`` (Fu et al. 2025,
    "AReaL: A Large-Scale Asynchronous Reinforcement Learning System for Language Reasoning", arXiv 2505.24298,
    Sec. 5.2, the decoupled PPO objective). Per token the loss is
    ``-(pi_prox / pi_behav) min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)`` with ``r = pi_theta / pi_prox``:
    ``proximal_logp`` is ``pi_prox`` (the trainer's old log-probs, recomputed before the update: the trust-region
    anchor), ``behaviour_logp`` is ``pi_behav`` (the engine's log-prob of the policy version that sampled each token;
    under asynchronous RL the tokens of one response may come from different versions). Pass ``weights`` as
    ``compute_policy_loss(..., old_log_probs=proximal_logp, is_weights=weights)``.

    ``weights = exp(log pi_prox - log pi_behav)``, detached, 0 outside ``mask`` (the log-ratio clamped to +-20, an
    infinite one too; a NaN one, from -inf - -inf, read as 0, i.e. weight 1, as AReaL reads it). ``cap`` (> 1; AReaL's
    ``behav_imp_weight_cap``): a token whose weight exceeds it (``weight > cap``; ``weight == cap`` is kept) gets weight
    0 and so no loss and no gradient, but it stays in ``loss_mask``, which is ``mask`` unchanged: as in AReaL
    (``actor_loss_fn`` divides by the count of the original loss mask), a capped token still counts in the
    aggregation's denominator, so capping never scales up the other tokens' gradients.

    Metrics (over ``mask``): ``off_policy/behav_weight_mean`` (the weight each token gets, 0 when capped),
    ``off_policy/behav_weight_max`` (the largest weight before the cap), ``off_policy/frac_capped`` (share of tokens
    capped) and ``off_policy/logprob_diff_mean`` (mean ``|log pi_prox - log pi_behav|``)."""
    if cap is not None and not cap > 1:
        raise ValueError(f"decoupled_weights: cap must be > 1 (or None), got {cap}")
    behaviour_logp = behaviour_logp.to(proximal_logp.device)
    if proximal_logp.shape != behaviour_logp.shape or proximal_logp.shape != mask.shape:
        raise ValueError(
            f"decoupled_weights: shapes {tuple(proximal_logp.shape)}, {tuple(behaviour_logp.shape)}, "
            f"{tuple(mask.shape)} must agree"
        )
    m = mask.bool()
    with torch.no_grad():
        diff = (proximal_logp.detach() - behaviour_logp.detach().to(proximal_logp.dtype)).nan_to_num(nan=0.0)
        raw = diff.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()
        capped = m & (raw > cap) if cap is not None else torch.zeros_like(m)
        weights = torch.where(m & ~capped, raw, torch.zeros_like(raw))
        n = max(int(m.sum()), 1)
        metrics = {
            "off_policy/behav_weight_mean": float(masked_mean(weights, m)),
            "off_policy/behav_weight_max": float(raw[m].max()) if m.any() else 0.0,
            "off_policy/frac_capped": float(capped.sum()) / n,
            "off_policy/logprob_diff_mean": float(masked_mean(diff.abs(), m)),
        }
    return weights, mask, metrics
