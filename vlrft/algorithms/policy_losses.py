"""Policy losses, selected by name (``algorithm.policy_loss``), and the PPO value loss.

``compute_policy_loss(name, log_probs, old_log_probs, advantages, response_mask, ...) -> (loss, metrics)``:
each loss builds a per-token loss matrix ``[B, T]`` (sequence-level losses put the sequence's loss on
each of its tokens), optionally multiplies it by truncated importance weights, and reduces it with
:func:`vlrft.algorithms.aggregation.aggregate_loss` (``algorithm.loss_agg_mode``). For the
sequence-level losses (gspo, gmpo) use ``seq-mean-token-mean``, which gives exactly the papers'
``1/G sum_i loss_i``. Metrics are detached floats: ``clip_fraction`` (fraction of valid tokens whose
objective is clipped; for cispo whose weight is clipped, for sapo whose gate weight is below 1/2),
``approx_kl`` (mean k3 estimate of KL(pi_old || pi_theta), >= 0), ``ratio_mean``, plus loss-specific ones.

Log-ratios are clamped to +-20 before exponentiation so that a wild token cannot produce inf.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from vlrft.algorithms.aggregation import aggregate_loss
from vlrft.algorithms.masked import masked_mean, masked_sum

Tensor = torch.Tensor
_MAX_LOG_RATIO = 20.0


@dataclass(frozen=True)
class PolicyLoss:
    """One policy loss: its function and the inputs it takes beyond the common ones (``clip_low``,
    ``clip_high``, ``dual_clip``), declared once. The trainer passes exactly ``extra_inputs``, each from the
    ``algorithm.*`` option of the same name."""

    fn: Callable
    extra_inputs: tuple[str, ...]


# name -> entry; filled by @register_policy_loss below
POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str, *, extra_inputs: tuple[str, ...] = ()) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn(log_probs, old_log_probs, advantages, mask, *, clip_low, clip_high, **_) ->
    (loss_matrix [B, T], log_ratio, metrics)`` under ``name``, with the keyword inputs it takes beyond the
    common ones. A new loss is one function and this line (plus an ``algorithm.*`` option per extra input)."""
    if name in POLICY_LOSSES:
        raise ValueError(f"policy loss {name!r} is already registered")

    def register(fn: Callable) -> Callable:
        POLICY_LOSSES[name] = PolicyLoss(fn, tuple(extra_inputs))
        return fn

    return register


def _log_ratio(log_probs: Tensor, old_log_probs: Tensor) -> Tensor:
    return (log_probs - old_log_probs.detach()).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)


def _common_metrics(log_ratio: Tensor, mask: Tensor) -> dict[str, float]:
    with torch.no_grad():
        ratio = log_ratio.exp()
        return {
            "approx_kl": float(masked_mean(ratio - 1 - log_ratio, mask)),
            "ratio_mean": float(masked_mean(ratio, mask)),
        }


def _seq_mean(x: Tensor, mask: Tensor) -> Tensor:
    return masked_sum(x, mask, dim=-1) / mask.sum(-1).clamp(min=1).to(x.dtype)


@register_policy_loss("ppo")
def ppo_loss(log_probs, old_log_probs, advantages, mask, *, clip_low=0.2, clip_high=0.2, dual_clip=None, **_):
    """PPO clipped surrogate (Schulman et al. 2017, arXiv 1707.06347, eq. 7), per token:
    ``L = -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A)``. ``clip_high > clip_low`` is DAPO's
    clip-higher (arXiv 2503.14476, eq. 10). ``dual_clip = c > 1`` bounds the loss of negative-advantage
    tokens by ``-c A`` (Ye et al. 2020, arXiv 1912.09729, eq. 5): ``L = min(L, -c A)`` where ``A < 0``."""
    log_ratio = _log_ratio(log_probs, old_log_probs)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    metrics = {"clip_fraction": float(masked_mean((clipped > unclipped).to(ratio.dtype), mask))}
    if dual_clip is not None:
        if dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1 (or null), got {dual_clip}")
        bound = -advantages * dual_clip
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        metrics["dual_clip_fraction"] = float(masked_mean(dual.to(ratio.dtype), mask))
    return loss, log_ratio, metrics


@register_policy_loss("gspo")
def gspo_loss(log_probs, old_log_probs, advantages, mask, *, clip_low=3e-4, clip_high=4e-4, **_):
    """GSPO (Zheng et al. 2025, arXiv 2507.18071, eqs. 5-7): sequence ratio
    ``s_i = exp(1/|y_i| sum_t log(pi/pi_old))`` (length-normalised), ``L_i = -min(s_i A_i,
    clip(s_i, 1 - clip_low, 1 + clip_high) A_i)`` with ``A_i`` the sample's mean token advantage.
    The paper's ranges are 3e-4 / 4e-4 (the caller passes its own)."""
    log_ratio = _log_ratio(log_probs, old_log_probs)
    seq_log_ratio = _seq_mean(log_ratio, mask)
    s = seq_log_ratio.exp()
    adv = _seq_mean(advantages, mask)
    unclipped, clipped = -adv * s, -adv * s.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    clip = (clipped > unclipped)[:, None].expand(mask.shape)
    return loss[:, None].expand(mask.shape), log_ratio, {"clip_fraction": float(masked_mean(clip.to(s.dtype), mask))}


@register_policy_loss("gspo_token")
def gspo_token_loss(log_probs, old_log_probs, advantages, mask, *, clip_low=3e-4, clip_high=4e-4, **_):
    """GSPO-token (arXiv 2507.18071, eqs. 13-14): ``s_it = sg[s_i] * pi(y_it) / sg[pi(y_it)]`` (value
    ``s_i``, gradient of token ``t``), ``L_it = -min(s_it A_it, clip(s_it, ...) A_it)`` with per-token
    advantages. Equal to ``gspo`` when the advantages are the same on all tokens of a sample."""
    log_ratio = _log_ratio(log_probs, old_log_probs)
    seq_log_ratio = _seq_mean(log_ratio, mask).detach()
    s = (seq_log_ratio[:, None] + log_probs - log_probs.detach()).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO).exp()
    unclipped, clipped = -advantages * s, -advantages * s.clamp(1 - clip_low, 1 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    return loss, log_ratio, {"clip_fraction": float(masked_mean((clipped > unclipped).to(s.dtype), mask))}


@register_policy_loss("gmpo")
def gmpo_loss(log_probs, old_log_probs, advantages, mask, *, clip_low=0.4, clip_high=0.4, **_):
    """GMPO (Zhao et al. 2025, arXiv 2507.20673, eq. 5 and Alg. 1): the geometric mean of the clipped
    token objectives, computed in log space. Per token ``l_t = log(pi/pi_old)``; with ``g = sign(A_i)``,
    ``l~_t = g * min(g l_t, g clip(l_t, -clip_low, clip_high))``; ``L_i = -A_i exp(1/|y_i| sum_t l~_t)``.
    ``clip_low``/``clip_high`` are *log-space* bounds here (the paper's ratio range (e^-0.4, e^0.4))."""
    log_ratio = _log_ratio(log_probs, old_log_probs)
    sign = torch.sign(advantages)
    clipped = log_ratio.clamp(-clip_low, clip_high)
    chosen = sign * torch.minimum(sign * log_ratio, sign * clipped)
    seq_ratio = _seq_mean(chosen, mask).exp()
    adv = _seq_mean(advantages, mask)
    loss = -adv * seq_ratio
    clip = (sign * clipped < sign * log_ratio).to(log_ratio.dtype)
    return loss[:, None].expand(mask.shape), log_ratio, {"clip_fraction": float(masked_mean(clip, mask))}


@register_policy_loss("cpgd", extra_inputs=("policy_drift_coef",))
def cpgd_loss(log_probs, old_log_probs, advantages, mask, *, clip_low=0.2, clip_high=0.2, policy_drift_coef=0.1, **_):
    """CPGD (Liu et al. 2025, arXiv 2505.12504, eq. 5): policy gradient on the *clipped log-ratio* plus a
    policy-drift penalty, per token ``L = -min(l A, clip(l, log(1 - clip_low), log(1 + clip_high)) A)
    + alpha * KL(pi_old || pi_theta)`` with ``l = log(pi/pi_old)``, the drift estimated by k3
    ``(r - 1) - l`` on tokens sampled from ``pi_old`` and ``alpha = policy_drift_coef``."""
    if not 0 <= clip_low < 1:
        raise ValueError(f"cpgd needs 0 <= clip_low < 1 (log(1 - clip_low) must exist), got {clip_low}")
    log_ratio = _log_ratio(log_probs, old_log_probs)
    clipped = log_ratio.clamp(math.log(1 - clip_low), math.log1p(clip_high))
    unclipped_loss, clipped_loss = -advantages * log_ratio, -advantages * clipped
    drift = log_ratio.exp() - 1 - log_ratio
    loss = torch.maximum(unclipped_loss, clipped_loss) + policy_drift_coef * drift
    metrics = {
        "clip_fraction": float(masked_mean((clipped_loss > unclipped_loss).to(log_ratio.dtype), mask)),
        "policy_drift": float(masked_mean(drift.detach(), mask)),
    }
    return loss, log_ratio, metrics


@register_policy_loss("cispo")
def cispo_loss(log_probs, old_log_probs, advantages, mask, *, clip_low=1.0, clip_high=0.2, **_):
    """CISPO (MiniMax-M1, arXiv 2506.13585, eqs. 4-5): REINFORCE weighted by the clipped, stop-gradient
    importance weight, so no token's gradient is dropped: ``L = -sg(r^) A log pi_theta(y_t)`` with
    ``r^ = clip(r, 1 - clip_low, 1 + clip_high)``. Each token carries ``-sg(r^) A (log pi_theta - sg(log pi_old))``:
    the paper's gradient ``-r^ A grad log pi_theta``, and 0 at ``pi_theta = pi_old``. ``clip_low = 1`` leaves the
    weight unbounded below (``r >= 0``), as the paper does. ``clip_fraction``: share of valid tokens whose weight
    is clipped (``r`` outside ``[1 - clip_low, 1 + clip_high]``); they keep their gradient, scaled by the bound."""
    log_ratio = _log_ratio(log_probs, old_log_probs)
    ratio = log_ratio.detach().exp()
    weight = ratio.clamp(1 - clip_low, 1 + clip_high)
    # the log-ratio unclamped: clipping bounds the weight, never the gradient
    loss = -weight * advantages * (log_probs - old_log_probs.detach())
    clipped = (ratio < 1 - clip_low) | (ratio > 1 + clip_high)
    return loss, log_ratio, {"clip_fraction": float(masked_mean(clipped.to(ratio.dtype), mask))}


@register_policy_loss("sapo", extra_inputs=("sapo_tau_pos", "sapo_tau_neg"))
def sapo_loss(log_probs, old_log_probs, advantages, mask, *, sapo_tau_pos=1.0, sapo_tau_neg=1.05, **_):
    """SAPO (Gao et al. 2025, arXiv 2511.20347, the SAPO objective and its gate ``f_{i,t}``): a soft,
    temperature-controlled gate instead of the hard clip. Per token ``L = -f(r) A``,
    ``f(r) = (4 / tau) sigmoid(tau (r - 1))``, ``tau = sapo_tau_pos`` where ``A > 0``, else ``sapo_tau_neg``.
    Its gradient is ``-w r A grad log pi_theta`` with the gate weight ``w = 4 s (1 - s)``, ``s = sigmoid(tau (r - 1))``:
    ``w = 1`` at ``r = 1`` (the policy gradient), decaying smoothly as ``r`` leaves 1, faster for a larger ``tau``
    (``sapo_tau_neg > sapo_tau_pos`` damps negative-advantage updates sooner). No clip range (``clip_low``,
    ``clip_high`` are not read). ``clip_fraction``: share of valid tokens whose gate weight ``w < 1/2``, i.e.
    ``|tau (r - 1)| > 2 asinh(1) = 1.7627`` (unreachable below 1 for ``tau < 1.7627``, as ``r > 0``);
    ``gate_weight_mean``: mean ``w``."""
    if not (sapo_tau_pos > 0 and sapo_tau_neg > 0):
        raise ValueError(f"sapo needs sapo_tau_pos > 0 and sapo_tau_neg > 0, got {sapo_tau_pos}, {sapo_tau_neg}")
    log_ratio = _log_ratio(log_probs, old_log_probs)
    ratio = log_ratio.exp()
    tau = torch.full_like(ratio, sapo_tau_neg).masked_fill(advantages > 0, sapo_tau_pos)
    gate = torch.sigmoid(tau * (ratio - 1))
    loss = -(4 / tau) * gate * advantages
    with torch.no_grad():
        weight = 4 * gate * (1 - gate)
        metrics = {
            "clip_fraction": float(masked_mean((weight < 0.5).to(ratio.dtype), mask)),
            "gate_weight_mean": float(masked_mean(weight, mask)),
        }
    return loss, log_ratio, metrics


def compute_policy_loss(
    name: str,
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    response_mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    loss_agg_mode: str = "token-mean",
    global_token_count: int | float | Tensor | None = None,
    num_sequences: int | float | Tensor | None = None,
    max_response_length: int | None = None,
    is_weights: Tensor | None = None,
    **kwargs,
) -> tuple[Tensor, dict[str, float]]:
    """The policy loss ``name`` aggregated to a scalar, and its metrics (see the module docstring).

    ``dual_clip`` applies to ``ppo`` only; a loss's own inputs (``POLICY_LOSSES[name].extra_inputs``, e.g.
    cpgd's ``policy_drift_coef``) are passed as keyword arguments. ``is_weights``
    ``[B, T]`` (from :func:`truncated_is_weights`) multiply the per-token loss. Gradients flow into
    ``log_probs`` only.
    """
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy_loss {name!r}; choose one of {', '.join(POLICY_LOSSES)}")
    if dual_clip is not None and name != "ppo":
        raise ValueError(f"dual_clip applies to policy_loss 'ppo' only, not {name!r}; set it to null")
    shapes = {t.shape for t in (log_probs, old_log_probs, advantages, response_mask)}
    if len(shapes) != 1 or log_probs.dim() != 2:
        raise ValueError(
            "compute_policy_loss: log_probs, old_log_probs, advantages and response_mask must all be [B, T]; got "
            f"{[tuple(t.shape) for t in (log_probs, old_log_probs, advantages, response_mask)]}"
        )
    mask = response_mask.bool()
    advantages = advantages.detach().to(log_probs.dtype)
    loss_mat, log_ratio, metrics = POLICY_LOSSES[name].fn(
        log_probs,
        old_log_probs,
        advantages,
        mask,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
        **kwargs,
    )
    if is_weights is not None:
        if is_weights.shape != mask.shape:
            raise ValueError(f"is_weights shape {tuple(is_weights.shape)} != response_mask {tuple(mask.shape)}")
        loss_mat = loss_mat * is_weights.detach().to(loss_mat.dtype)
    loss = aggregate_loss(
        loss_mat,
        mask,
        loss_agg_mode,
        global_token_count=global_token_count,
        num_sequences=num_sequences,
        max_response_length=max_response_length,
    )
    metrics.update(_common_metrics(log_ratio, mask))
    return loss, metrics


def truncated_is_weights(trainer_logp: Tensor, rollout_logp: Tensor, mask: Tensor, cap: float = 2.0) -> Tensor:
    """Truncated importance-sampling weights ``w_t = min(pi_trainer(y_t) / pi_rollout(y_t), cap)`` for
    rollouts sampled by another engine (vLLM) whose probabilities differ from the trainer's (Yao et al.
    2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training", TIS; the truncated IS
    of Espeholt et al. 2018, arXiv 1802.01561, eq. 1). ``trainer_logp`` are the trainer's old log-probs.
    Detached, 0 outside ``mask``; multiply the per-token policy loss by them (``is_weights=``)."""
    if cap <= 0:
        raise ValueError(f"truncated_is_weights: cap must be > 0, got {cap}")
    with torch.no_grad():
        w = _log_ratio(trainer_logp.detach(), rollout_logp).exp().clamp(max=cap)
        return torch.where(mask.bool(), w, torch.zeros_like(w))


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip_range: float | None = 0.2,
    *,
    loss_agg_mode: str = "token-mean",
    global_token_count: int | float | Tensor | None = None,
    num_sequences: int | float | Tensor | None = None,
    max_response_length: int | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped value loss (arXiv 1707.06347 Sec. 5; the clipping of OpenAI baselines ppo2):
    ``V_clip = V_old + clip(V - V_old, -c, c)``, ``L = 1/2 max((V - R)^2, (V_clip - R)^2)``;
    ``clip_range=None`` gives ``1/2 (V - R)^2``. Metrics: ``vf_clip_fraction``, ``vf_mean``."""
    m = mask.bool()
    returns, old_values = returns.detach(), old_values.detach()
    unclipped = (values - returns).square()
    if clip_range is None:
        loss_mat, frac = 0.5 * unclipped, 0.0
    else:
        v_clip = old_values + (values - old_values).clamp(-clip_range, clip_range)
        clipped = (v_clip - returns).square()
        loss_mat = 0.5 * torch.maximum(unclipped, clipped)
        frac = float(masked_mean((clipped > unclipped).to(values.dtype), m))
    loss = aggregate_loss(
        loss_mat,
        m,
        loss_agg_mode,
        global_token_count=global_token_count,
        num_sequences=num_sequences,
        max_response_length=max_response_length,
    )
    return loss, {"vf_clip_fraction": frac, "vf_mean": float(masked_mean(values.detach(), m))}
