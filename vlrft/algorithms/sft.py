"""Supervised fine-tuning loss as a pure tensor function: the masked token negative log-likelihood.

``L = -agg_t m_t log pi(y_t | y_<t, x)`` over the target tokens (``m_t = 1``: assistant tokens only),
aggregated with the house's loss aggregation (:func:`~vlrft.algorithms.aggregation.aggregate_loss`):
``token-mean`` over the global token count (the usual SFT mean, exact under gradient accumulation and
data parallelism), or a per-sequence mode. Maximum likelihood of the demonstrations (Ouyang et al. 2022,
arXiv 2203.02155, Sec. 3.5, "supervised fine-tuning").
"""

from __future__ import annotations

import torch

from vlrft.algorithms.aggregation import aggregate_loss

Tensor = torch.Tensor

IGNORE_INDEX = -100


def shifted_targets(labels: Tensor) -> tuple[Tensor, Tensor]:
    """``(targets, mask)`` for next-token prediction from ``labels [B, T]`` (``-100`` = no loss):
    ``targets[:, t] = labels[:, t + 1]`` with ignored positions replaced by id 0 and ``mask`` 0 there."""
    targets = labels[:, 1:]
    mask = targets != IGNORE_INDEX
    return targets.masked_fill(~mask, 0), mask


def sft_loss(
    token_logprobs: Tensor,
    mask: Tensor,
    *,
    loss_agg_mode: str = "token-mean",
    global_token_count: int | float | Tensor | None = None,
    num_sequences: int | float | Tensor | None = None,
) -> Tensor:
    """Masked NLL ``-log pi`` of ``token_logprobs [B, T]`` over ``mask [B, T]``, aggregated by ``loss_agg_mode``.

    The counts are those of the whole optimiser step (all micro-batches, all ranks); ``None``: this
    micro-batch's own.
    """
    return aggregate_loss(
        -token_logprobs,
        mask,
        loss_agg_mode,
        global_token_count=global_token_count,
        num_sequences=num_sequences,
    )
