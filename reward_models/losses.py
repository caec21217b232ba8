"""Pairwise losses for scalar reward models, as pure tensor functions.

Every function takes the rewards of the chosen and rejected responses (shape ``[B]``) and returns the
per-pair loss (shape ``[B]``); the caller averages. Ties are handled in one of two documented ways:

- ``tie_mode="half"``: a tie is a Bradley-Terry pair with soft target 1/2, i.e. the binary
  cross-entropy ``-(1/2) log sigma(d) - (1/2) log sigma(-d)``, minimised at ``d = 0``.
- ``tie_mode="rao_kupper"``: Rao & Kupper (1967), "Ties in paired-comparison experiments: a
  generalization of the Bradley-Terry model", JASA 62(317), eq. (2.1)-(2.2), with ``pi = exp(r)`` and
  ``theta = exp(tau)``: ``P(c > r) = sigma(d - tau)``, ``P(r > c) = sigma(-d - tau)`` and
  ``P(tie) = 1 - P(c > r) - P(r > c)``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

TIE_MODES = ("half", "rao_kupper")


def bradley_terry_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    margin: torch.Tensor | float | None = None,
    tie: torch.Tensor | None = None,
    tie_mode: str = "half",
    log_theta: float = 1.0,
) -> torch.Tensor:
    """Per-pair Bradley-Terry loss with optional margin and ties.

    Non-tied pairs: ``-log sigma(r_c - r_r - m)`` (Touvron et al. 2023, "Llama 2", eq. 2; ``m = 0``
    gives Bradley & Terry 1952 / Ouyang et al. 2022 eq. 1). Under ``tie_mode="rao_kupper"`` the
    non-tied loss is ``-log sigma(r_c - r_r - m - tau)`` and a tie costs ``-log P(tie)`` with
    ``log P(tie) = (tau - d) + log(1 - e^{-2 tau}) - softplus(tau - d) - softplus(-tau - d)``,
    the stable form of ``sigma(tau - d) - sigma(-tau - d)``. Margins are not applied to ties.

    Args:
        chosen, rejected: rewards ``[B]``.
        margin: ``[B]`` or a scalar, or ``None`` for no margin.
        tie: bool ``[B]``, true where the pair is a tie; ``None`` for no ties.
        tie_mode: ``"half"`` or ``"rao_kupper"``.
        log_theta: Rao-Kupper ``tau = log theta > 0`` (the width of the tie region).
    """
    if tie_mode not in TIE_MODES:
        raise ValueError(f"tie_mode must be one of {TIE_MODES}, got {tie_mode!r}")
    if chosen.shape != rejected.shape or chosen.dim() != 1:
        raise ValueError(f"chosen {tuple(chosen.shape)} and rejected {tuple(rejected.shape)} must both be [B]")
    d = chosen - rejected
    m = torch.zeros_like(d) if margin is None else torch.as_tensor(margin, dtype=d.dtype, device=d.device).expand_as(d)
    if tie_mode == "half":
        win = -F.logsigmoid(d - m)
        tied = -0.5 * (F.logsigmoid(d) + F.logsigmoid(-d))
    else:
        if not log_theta > 0:
            raise ValueError(f"Rao-Kupper needs log_theta > 0, got {log_theta}")
        tau = log_theta
        win = -F.logsigmoid(d - m - tau)
        log_p_tie = (tau - d) + math.log(-math.expm1(-2 * tau)) - F.softplus(tau - d) - F.softplus(-tau - d)
        tied = -log_p_tie
    if tie is None:
        return win
    return torch.where(tie.to(torch.bool), tied, win)


def pairwise_accuracy(chosen: torch.Tensor, rejected: torch.Tensor, tie: torch.Tensor | None = None) -> tuple[int, int]:
    """``(correct, counted)``: pairs with ``r_c > r_r`` among the non-tied pairs (ties are not counted)."""
    keep = torch.ones_like(chosen, dtype=torch.bool) if tie is None else ~tie.to(torch.bool)
    return int(((chosen > rejected) & keep).sum()), int(keep.sum())


def judge_sft_loss(
    logits: torch.Tensor, labels: torch.Tensor, verdict_mask: torch.Tensor | None = None, verdict_weight: float = 1.0
) -> torch.Tensor:
    """Weighted token-mean next-token cross-entropy for judge SFT (labels ``-100`` are ignored).

    ``loss = sum_t w_t CE_t / sum_t w_t`` over labelled target tokens, with ``w_t = verdict_weight``
    where ``verdict_mask`` marks the verdict's tokens and 1 elsewhere; ``verdict_weight = 1`` is the
    usual SFT token mean. ``logits [B, T, V]`` predict position ``t + 1`` from ``t`` (shifted here).
    """
    shift_logits, shift_labels = logits[:, :-1], labels[:, 1:]
    if shift_logits.dtype in (torch.float16, torch.bfloat16):
        shift_logits = shift_logits.float()
    ce = F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.shape[-1]), shift_labels.reshape(-1), ignore_index=-100, reduction="none"
    )
    weights = (shift_labels != -100).reshape(-1).to(ce.dtype)
    if verdict_mask is not None and verdict_weight != 1.0:
        weights = weights * (1 + (verdict_weight - 1) * verdict_mask[:, 1:].reshape(-1).to(ce.dtype))
    return (ce * weights).sum() / weights.sum().clamp(min=1)
