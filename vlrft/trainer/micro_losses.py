"""The losses of one micro-batch of the policy update (``PolicyTrainer.train_on``): the policy's (the registered
policy loss with rollout correction, plus KL and entropy terms) and PPO's critic's. Each takes the model, the
micro-batch (``Experience.micro_batch``), the ``algorithm`` section and the global counts the aggregation divides by
(``global_token_count``, ``num_sequences``, ``max_response_length``: every rank's micro-batches of one optimizer
step sum to the global objective)."""

from __future__ import annotations

from typing import Any

import torch

from vlrft.algorithms import aggregate_loss, compute_policy_loss, high_entropy_mask, kl_penalty, value_loss
from vlrft.algorithms.rollout_correction import decoupled_weights, rollout_correction
from vlrft.trainer.experience import response_logprobs, response_values


def policy_micro_loss(
    module: torch.nn.Module,
    mb: dict[str, torch.Tensor],
    a: Any,
    global_token_count: int,
    num_sequences: int,
    max_response_length: int,
    *,
    kl_coef: float,
    temperature: float,
    shared: bool,
    suppress: torch.Tensor,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy loss of micro-batch ``mb`` (``a``: the algorithm section; ``kl_coef``: the KL controller's value
    this step) and its metrics (``policy/*``, rollout correction's or decoupled PPO's ``off_policy/*``, ``kl``,
    ``entropy``)."""
    # entropy is always computed: it is the metric that shows a collapsing policy
    logp, entropy = response_logprobs(
        module, mb, mb["response_ids"], temperature=temperature, with_entropy=True, shared=shared, suppress=suppress
    )
    dev = logp.device
    mask = mb["response_mask"].to(dev)
    old = mb["old_log_probs"].to(dev) if "old_log_probs" in mb else logp.detach()
    loss_mask = mask
    if a.high_entropy_rho < 1.0:
        loss_mask = high_entropy_mask(entropy.detach(), mask, a.high_entropy_rho).to(mask.dtype)
    agg = dict(
        global_token_count=global_token_count, num_sequences=num_sequences, max_response_length=max_response_length
    )
    if a.off_policy == "decoupled":
        is_weights, loss_mask, rc_metrics = _decoupled(mb, old, loss_mask, a.behav_imp_weight_cap)
    else:  # the engine's own log-probs (vllm, hf with FIRE; None for hf otherwise) vs the trainer's
        rollout_logp = mb.get("rollout_log_probs")
        is_weights, loss_mask, rc_metrics = rollout_correction(
            a.rollout_correction, old, rollout_logp, loss_mask, cap=a.rollout_is_cap, threshold=a.rollout_mask_threshold
        )
    loss, metrics = compute_policy_loss(
        a.policy_loss,
        logp,
        old,
        mb["advantages"].to(dev),
        loss_mask,
        clip_low=a.clip_low,
        clip_high=a.clip_high,
        dual_clip=a.dual_clip or None,
        is_weights=is_weights,
        loss_agg_mode=a.loss_agg_mode,
        **agg,
        **a.policy_loss_inputs(),
    )
    metrics = {f"policy/{k}": float(v) for k, v in metrics.items()} | rc_metrics
    metrics["policy/loss"] = float(loss.detach())
    if "ref_log_probs" in mb:
        kl = kl_penalty(logp, mb["ref_log_probs"].to(dev), a.kl_estimator)
        kl_term = aggregate_loss(kl, mask, a.loss_agg_mode, **agg)
        metrics["kl"] = float(kl.detach()[mask.bool()].mean()) if mask.any() else 0.0
        if a.use_kl_loss:
            loss = loss + kl_coef * kl_term
    if entropy is not None:
        ent = aggregate_loss(entropy, mask, a.loss_agg_mode, **agg)
        metrics["entropy"] = float(entropy.detach()[mask.bool()].mean()) if mask.any() else 0.0
        if a.entropy_coef > 0:
            loss = loss - a.entropy_coef * ent
    return loss, metrics


def _decoupled(
    mb: dict[str, torch.Tensor], old: torch.Tensor, loss_mask: torch.Tensor, cap: float | None
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Decoupled PPO's weights pi_prox / pi_behav (``vlrft.algorithms.rollout_correction.decoupled_weights``), loss
    mask and metrics; ``old`` (the trainer's old log-probs, ``mb["old_log_probs"]``) is pi_prox, the clip's anchor."""
    for key, what in (
        ("rollout_log_probs", "the engine reported no log-probs of the sampled tokens (pi_behav)"),
        ("old_log_probs", "the trainer computed no old log-probs (pi_prox)"),
    ):
        if key not in mb:
            raise ValueError(f"algorithm.off_policy=decoupled: the micro-batch has no {key}: {what}")
    return decoupled_weights(old, mb["rollout_log_probs"], loss_mask, cap=cap)


def critic_micro_loss(
    module: torch.nn.Module,
    mb: dict[str, torch.Tensor],
    a: Any,
    global_token_count: int,
    num_sequences: int,
    max_response_length: int,
    *,
    device: torch.device,
    shared: bool,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped value loss of micro-batch ``mb`` (unweighted; the caller weighs it by ``value_coef``) and its
    metrics (``critic/loss``, ``critic/*``)."""
    values = response_values(module, mb, mb["response_ids"].shape[1], device, shared)
    dev = values.device
    loss, m = value_loss(
        values,
        mb["values"].to(dev),
        mb["returns"].to(dev),
        mb["response_mask"].to(dev),
        a.value_clip or None,
        loss_agg_mode=a.loss_agg_mode,
        global_token_count=global_token_count,
        num_sequences=num_sequences,
        max_response_length=max_response_length,
    )
    return loss, {"critic/loss": float(loss.detach()), **{f"critic/{k}": float(v) for k, v in m.items()}}
