"""The losses of one micro-batch of the policy update (``PolicyTrainer.train_on``): the policy's (the registered
policy loss with rollout correction, plus KL and entropy terms) and PPO's critic's. Each takes the model, the
micro-batch (``Experience.micro_batch``), the ``algorithm`` section and the global counts the aggregation divides by
(``global_token_count``, ``num_sequences``, ``max_response_length``: every rank's micro-batches of one optimizer
step sum to the global objective)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable

import torch

from vlrft.algorithms import (
    aggregate_loss,
    compute_policy_loss,
    high_entropy_mask,
    kl_penalty,
    value_loss,
    vocabulary_reverse_kl,
)
from vlrft.algorithms.rollout_correction import decoupled_weights, rollout_correction
from vlrft.models.moe import (
    RouterCall,
    capture_routing,
    expert_load,
    expert_load_entropy,
    is_moe,
    load_balancing_loss,
    max_expert_share,
    router_aux_coef,
)
from vlrft.models.packing import shared_forward_applies
from vlrft.trainer.experience import logprobs_and_entropy, response_logits, response_values


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
    teacher: tuple[Callable[..., torch.Tensor], float] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy loss of micro-batch ``mb`` (``a``: the algorithm section; ``kl_coef``: the KL controller's value
    this step) and its metrics (``policy/*``, rollout correction's or decoupled PPO's ``off_policy/*``, ``kl``,
    ``entropy``; a mixture-of-experts policy's ``moe/*`` where the forward took the plain path:
    :func:`update_shares_prompts`). ``teacher``: ``(the teacher's vocabulary log-probs of a micro-batch, coef)`` for
    ``teacher.per_token: vocabulary``: ``coef`` times the exact reverse KL over the vocabulary
    (:func:`~vlrft.algorithms.vocabulary_reverse_kl`), aggregated as the policy loss, is added to the loss."""
    shared = update_shares_prompts(module, mb, a, shared)
    moe = is_moe(module)
    routing = capture_routing(module) if moe else nullcontext(None)
    token_masks: list | None = [] if moe else None  # each forward's response positions, for the router's loss
    # entropy is always computed: it is the metric that shows a collapsing policy
    with routing as calls:
        width = mb["response_ids"].shape[1]
        logits = response_logits(module, mb, width, shared=shared, suppress=suppress, token_masks=token_masks)
    logp, entropy = logprobs_and_entropy(logits, mb["response_ids"], temperature, with_entropy=True)
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
        kl = kl_penalty(logp, mb["ref_log_probs"].to(dev), a.kl_estimator, a.kl_max)
        metrics["kl"] = float(kl.detach()[mask.bool()].mean()) if mask.any() else 0.0
        if a.use_kl_loss:
            if a.off_policy == "decoupled":  # the KL's tokens came from pi_behav too: weighed by pi_prox / pi_behav
                every_token = a.high_entropy_rho >= 1.0
                kl = kl * (is_weights if every_token else _decoupled(mb, old, mask, a.behav_imp_weight_cap)[0])
            loss = loss + kl_coef * aggregate_loss(kl, mask, a.loss_agg_mode, **agg)
    if teacher is not None:  # teacher.per_token: vocabulary
        vocabulary_log_probs, coef = teacher
        divergence = vocabulary_reverse_kl(logits, vocabulary_log_probs(mb).to(dev), temperature)
        metrics["distill/vocabulary_reverse_kl"] = float(divergence.detach()[mask.bool()].mean()) if mask.any() else 0.0
        loss = loss + coef * aggregate_loss(divergence, mask, a.loss_agg_mode, **agg)
    if entropy is not None:
        ent = aggregate_loss(entropy, mask, a.loss_agg_mode, **agg)
        metrics["entropy"] = float(entropy.detach()[mask.bool()].mean()) if mask.any() else 0.0
        if a.entropy_coef > 0:
            loss = loss - a.entropy_coef * ent
    if calls is not None:
        aux, moe_metrics = _router_terms(module, calls, token_masks)
        metrics.update(moe_metrics)
        coef = router_aux_coef(module, a.router_aux_coef)
        if coef > 0:  # this micro-batch's share of the step's tokens: the ranks' micro-batches sum to a token mean
            loss = loss + coef * aux * (float(mask.sum()) / max(global_token_count, 1))
    return loss, metrics


def update_shares_prompts(module: torch.nn.Module, mb: dict[str, torch.Tensor], a: Any, shared: bool) -> bool:
    """Whether the update's forward of micro-batch ``mb`` computes each prompt once per group (``shared`` asked and
    the model and batch allow it: ``vlrft.models.packing.shared_forward_applies``). A mixture-of-experts policy's
    router loss is taken on either path (over the response tokens of each forward). A dense policy with
    ``algorithm.router_aux_coef`` > 0: ConfigError."""
    router_aux_coef(module, a.router_aux_coef)
    return shared and shared_forward_applies(module, mb)


def _router_terms(
    module: torch.nn.Module, calls: list[RouterCall], token_masks: list[torch.Tensor]
) -> tuple[torch.Tensor, dict[str, float]]:
    """The load-balancing loss (``vlrft.models.moe.load_balancing_loss``) and the expert-load metrics of the router
    ``calls`` of the forwards that computed a micro-batch's logits, over its response tokens: ``token_masks`` holds,
    per forward in call order, the ``[rows, positions]`` mask of its response tokens (``experience.response_logits``:
    one plain or packed forward, or the cached path's prompts and continuation; each response token is in exactly
    one), and each forward made one router call per MoE layer, in layer order. ``moe/aux_loss``,
    ``moe/expert_load_entropy``, ``moe/max_expert_share`` (means over the MoE layers)."""
    if not calls:
        raise ValueError(f"{type(module).__name__}: its config names experts, but no sparse MoE block routed a token")
    layers = len({c.layer for c in calls})
    shapes = [tuple(m.shape) for m in token_masks for _ in range(layers)]
    if len(calls) != len(shapes) or any(c.shape != s for c, s in zip(calls, shapes, strict=True)):
        raise ValueError(
            f"router calls of shapes {[c.shape for c in calls]}, not the forwards' {shapes} ({layers} MoE layers)"
        )
    tokens = torch.cat([m.reshape(-1) for m in token_masks])  # the forwards' tokens, in call order
    per_layer = [[c for c in calls if c.layer == layer] for layer in sorted({c.layer for c in calls})]
    logits = [torch.cat([c.logits for c in cs]) for cs in per_layer]  # [tokens of all forwards, E] per layer
    experts = [torch.cat([c.experts for c in cs]) for cs in per_layer]
    num_experts = logits[0].shape[-1]
    aux = load_balancing_loss(logits, experts, num_experts, tokens.to(logits[0].device))
    load = torch.stack([expert_load(e, num_experts, tokens) for e in experts])
    return aux, {
        "moe/aux_loss": float(aux.detach()),
        "moe/expert_load_entropy": float(expert_load_entropy(load)),
        "moe/max_expert_share": float(max_expert_share(load)),
    }


def _decoupled(
    mb: dict[str, torch.Tensor], old: torch.Tensor, loss_mask: torch.Tensor, cap: float | None
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Decoupled PPO's weights pi_prox / pi_behav (``vlrft.algorithms.rollout_correction.decoupled_weights``), loss
    mask and metrics; ``old`` is pi_prox, the clip's anchor: the trainer's old log-probs (``mb["old_log_probs"]``,
    frozen at the start of a step that makes several updates) or, in a step of one update, the current policy's own,
    detached (the policy before this update is the current one)."""
    if "rollout_log_probs" not in mb:
        raise ValueError(
            "algorithm.off_policy=decoupled: the micro-batch has no rollout_log_probs: the engine reported no "
            "log-probs of the sampled tokens (pi_behav)"
        )
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
