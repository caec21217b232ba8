"""Offline preference losses (DPO family) as pure tensor functions.

Every function takes sequence log-probabilities ``log pi(y|x)`` (the sum over the response's tokens) of
the policy and of a frozen reference, for the chosen ``y_w`` and the rejected ``y_l`` response of each
pair (shape ``[B]``), and returns the per-pair loss ``[B]`` (the caller sums and divides by the global
pair count) and per-pair metrics. With ``h = log pi(y_w)/pi_ref(y_w) - log pi(y_l)/pi_ref(y_l)``:

- ``sigmoid``: DPO, Rafailov et al. 2023 (arXiv 2305.18290), eq. 7: ``-log sigma(beta h)``.
  With ``label_smoothing = eps > 0`` it is conservative DPO (Mitchell 2023, "A note on DPO with noisy
  preferences"): ``-(1 - eps) log sigma(beta h) - eps log sigma(-beta h)``, the preference label flipped
  with probability ``eps``.
- ``ipo``: IPO, Azar et al. 2023 (arXiv 2310.12036), eq. 17: ``(h - 1 / (2 tau))^2`` with ``tau = beta``.
  The paper's ``h`` uses the same log-likelihood ratios; pass token-mean log-probs for the length-
  normalised variant.
- RPO (Pang et al. 2024, arXiv 2404.19733, eq. 3): ``+ alpha * NLL(y_w)``, the chosen response's
  negative log-likelihood divided by its length, added by :func:`rpo_loss` to either loss.

The implicit reward of DPO (eq. 5) is ``r(x, y) = beta log pi(y|x) / pi_ref(y|x)``; the metrics report it
for both responses (``rewards/chosen``, ``rewards/rejected``), their difference (``rewards/margins``) and
whether the chosen response wins (``rewards/accuracy``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

Tensor = torch.Tensor

PREFERENCE_LOSSES = ("sigmoid", "ipo")


def preference_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    *,
    loss_type: str = "sigmoid",
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-pair DPO/cDPO (``sigmoid``) or IPO (``ipo``) loss ``[B]`` and per-pair metrics (detached ``[B]``).

    Args:
        policy_chosen, policy_rejected: ``log pi_theta(y|x)`` of the chosen / rejected responses, ``[B]``.
        ref_chosen, ref_rejected: the same under the frozen reference (no gradient flows into them).
        beta: DPO's beta (the KL strength); IPO's tau.
        label_smoothing: conservative DPO's ``eps`` in ``[0, 0.5)`` (sigmoid only).
    """
    if loss_type not in PREFERENCE_LOSSES:
        raise ValueError(f"unknown preference loss {loss_type!r}; choose one of {', '.join(PREFERENCE_LOSSES)}")
    shapes = {tuple(t.shape) for t in (policy_chosen, policy_rejected, ref_chosen, ref_rejected)}
    if len(shapes) != 1 or policy_chosen.dim() != 1:
        raise ValueError(f"preference_loss: the four log-prob tensors must all be [B], got shapes {sorted(shapes)}")
    if not beta > 0:
        raise ValueError(f"preference_loss: beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"preference_loss: label_smoothing must lie in [0, 0.5), got {label_smoothing}")
    chosen_ratio = policy_chosen - ref_chosen.detach()
    rejected_ratio = policy_rejected - ref_rejected.detach()
    h = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        loss = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    else:
        loss = (h - 1 / (2 * beta)) ** 2
    with torch.no_grad():
        chosen_reward, rejected_reward = beta * chosen_ratio, beta * rejected_ratio
        metrics = {
            "rewards/chosen": chosen_reward,
            "rewards/rejected": rejected_reward,
            "rewards/margins": chosen_reward - rejected_reward,
            "rewards/accuracy": (chosen_reward > rejected_reward).to(chosen_reward.dtype),
            "logps/chosen": policy_chosen.detach(),
            "logps/rejected": policy_rejected.detach(),
        }
    return loss, metrics


def rpo_loss(preference: Tensor, chosen_logps: Tensor, chosen_lengths: Tensor, alpha: float) -> Tensor:
    """RPO (Pang et al. 2024, eq. 3): per-pair ``preference + alpha * (-log pi(y_w|x) / |y_w|)``, ``[B]``.

    ``chosen_logps`` is the chosen response's summed log-prob ``[B]``, ``chosen_lengths`` its token count.
    ``alpha = 0`` returns ``preference`` unchanged.
    """
    if alpha == 0:
        return preference
    return preference + alpha * (-chosen_logps / chosen_lengths.to(chosen_logps.dtype).clamp(min=1))
