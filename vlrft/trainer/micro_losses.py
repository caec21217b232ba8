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
    routing = capture_routing(module) if is_moe(module) and not shared else nullcontext(None)
    # entropy is always computed: it is the metric that shows a collapsing policy
    with routing as calls:
        logits = response_logits(module, mb, mb["response_ids"].shape[1], shared=shared, suppress=suppress)
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
        kl = kl_penalty(logp, mb["ref_log_probs"].to(dev), a.kl_estimator)
        kl_term = aggregate_loss(kl, mask, a.loss_agg_mode, **agg)
        metrics["kl"] = float(kl.detach()[mask.bool()].mean()) if mask.any() else 0.0
        if a.use_kl_loss:
            loss = loss + kl_coef * kl_term
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
        aux, moe_metrics = _router_terms(module, calls, mb)
        metrics.update(moe_metrics)
        coef = router_aux_coef(module, a.router_aux_coef)
        if coef > 0:  # this micro-batch's share of the step's tokens: the ranks' micro-batches sum to a token mean
            loss = loss + coef * aux * (float(mask.sum()) / max(global_token_count, 1))
    return loss, metrics


def update_shares_prompts(module: torch.nn.Module, mb: dict[str, torch.Tensor], a: Any, shared: bool) -> bool:
    """Whether the update's forward of micro-batch ``mb`` computes each prompt once per group (``shared`` asked and
    the model and batch allow it: ``vlrft.models.packing.shared_forward_applies``). A mixture-of-experts policy
    whose router loss is on (``algorithm.router_aux_coef``, ``vlrft.models.moe.router_aux_coef``) takes the plain
    path: its router logits are read there, one row per sample. A dense policy with the coefficient set > 0:
    ConfigError."""
    if router_aux_coef(module, a.router_aux_coef) > 0:
        return False
    return shared and shared_forward_applies(module, mb)


def _router_terms(
    module: torch.nn.Module, calls: list[RouterCall], mb: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, float]]:
    """The load-balancing loss (``vlrft.models.moe.load_balancing_loss``) and the expert-load metrics of the plain
    forward's router ``calls`` over the response tokens (the tokens of ``response_mask``, at their own positions of
    the rows ``[prompt | response | pad]``): ``moe/aux_loss``, ``moe/expert_load_entropy``, ``moe/max_expert_share``
    (means over the MoE layers)."""
    rows, width = mb["input_ids"].shape
    if not calls:
        raise ValueError(f"{type(module).__name__}: its config names experts, but no sparse MoE block routed a token")
    if any(c.shape != (rows, width) for c in calls):
        raise ValueError(
            f"router calls of shapes {sorted({c.shape for c in calls})}, not the forward's {(rows, width)}"
        )
    mask = mb["response_mask"]
    pos = mb["prompt_lengths"][:, None] + torch.arange(mask.shape[1])[None]  # [N, R]
    tokens = torch.zeros(rows, width + mask.shape[1], dtype=torch.float32)
    tokens.scatter_(1, pos, mask.float())
    tokens = tokens[:, :width].reshape(-1)  # [N * width]
    num_experts = calls[0].logits.shape[-1]
    dev = calls[0].logits.device
    aux = load_balancing_loss([c.logits for c in calls], [c.experts for c in calls], num_experts, tokens.to(dev))
    load = torch.stack([expert_load(c.experts, num_experts, tokens) for c in calls])
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
