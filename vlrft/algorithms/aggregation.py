"""Loss aggregation (``algorithm.loss_agg_mode``) and the global token / sequence counts it divides by.

Every mode is written as ``sum over this micro-batch / a global constant``, so that summing the
micro-batch losses of all gradient-accumulation steps (and, with DDP/FSDP averaging, all ranks) gives
exactly the loss and gradient of one big batch, whatever the lengths in each micro-batch.

The modes (``L_it`` the per-token loss, ``m_it`` the response mask, ``|o_i| = sum_t m_it``):

- ``token-mean``: ``sum_i sum_t m_it L_it / N_tok`` with ``N_tok`` the number of response tokens in
  the whole step (DAPO, arXiv 2503.14476, eq. 8: token-level policy-gradient loss).
- ``seq-mean-token-mean``: ``(1/N_seq) sum_i (1/|o_i|) sum_t m_it L_it`` (GRPO, arXiv 2402.03300, eq. 3).
- ``seq-mean-token-sum``: ``(1/N_seq) sum_i sum_t m_it L_it``.
- ``seq-mean-token-sum-norm``: ``(1/N_seq) sum_i sum_t m_it L_it / L_max`` with a constant ``L_max``
  (Dr.GRPO, arXiv 2503.20783, eq. 3 and its code: the per-sequence sum divided by the generation
  budget). verl's mode of the same name omits ``1/N_seq``; here it is kept so that the loss scale
  does not grow with the batch size.

``N_seq`` counts the sequences with at least one response token: a zero-length response contributes
nothing and is not counted. With no valid token at all, every mode returns 0 (attached to the graph,
so ``backward`` still works and gives zero gradients).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist

from vlrft.algorithms.masked import masked_sum

Tensor = torch.Tensor

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def aggregate_loss(
    loss_mat: Tensor,
    mask: Tensor,
    mode: str,
    *,
    global_token_count: int | float | Tensor | None = None,
    num_sequences: int | float | Tensor | None = None,
    max_response_length: int | None = None,
) -> Tensor:
    """Reduce a per-token loss ``loss_mat[B, T]`` over ``mask[B, T]`` to a scalar (see module docstring).

    ``global_token_count`` (token-mean) and ``num_sequences`` (seq-mean-*) are the counts over the whole
    optimiser step: all gradient-accumulation micro-batches on all ranks (compute them once with
    :func:`global_token_count` / :func:`global_sequence_count`). Left ``None`` they default to this
    micro-batch's own counts, which is right only for a single micro-batch on a single rank.
    ``max_response_length`` (seq-mean-token-sum-norm) should be the configured generation budget so
    that it stays constant over training; it defaults to ``T``.
    """
    if loss_mat.shape != mask.shape:
        raise ValueError(f"aggregate_loss: loss_mat shape {tuple(loss_mat.shape)} != mask shape {tuple(mask.shape)}")
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; choose one of {', '.join(LOSS_AGG_MODES)}")
    m = mask.bool()
    if mode == "token-mean":
        count = m.sum() if global_token_count is None else global_token_count
        return masked_sum(loss_mat, m) / _positive(count)
    seq_tokens = m.sum(dim=-1)
    seq_sum = masked_sum(loss_mat, m, dim=-1)
    if mode == "seq-mean-token-mean":
        per_seq = seq_sum / seq_tokens.clamp(min=1).to(loss_mat.dtype)
    elif mode == "seq-mean-token-sum":
        per_seq = seq_sum
    else:
        length = max(loss_mat.shape[-1], 1) if max_response_length is None else max_response_length
        if length <= 0:
            raise ValueError(f"seq-mean-token-sum-norm needs max_response_length > 0, got {length}")
        per_seq = seq_sum / length
    n = (seq_tokens > 0).sum() if num_sequences is None else num_sequences
    return per_seq.sum() / _positive(n)


def _positive(count: int | float | Tensor) -> int | float | Tensor:
    # an empty step has a zero numerator; dividing by 1 keeps it 0 instead of NaN
    if isinstance(count, Tensor):
        return count.clamp(min=1)
    if count < 0:
        raise ValueError(f"aggregate_loss: a token/sequence count must be >= 0, got {count}")
    return max(count, 1)


def _collective_device(backend: str, cuda_available: bool) -> torch.device | None:
    """Where a CPU count must go for a collective of ``backend``: on a CUDA machine the default
    group may hold NCCL alone (DeepSpeed's ``init_distributed``, FSDP2's device mesh), which takes no
    CPU tensors, so counts go to the current CUDA device unless the group is plain gloo.
    ``None``: leave it where it is."""
    if cuda_available and backend.lower() != "gloo":
        return torch.device("cuda")  # the current CUDA device
    return None


def _all_reduce_sum(total: Tensor, group=None) -> int:

    if dist.is_available() and dist.is_initialized():
        device = _collective_device(str(dist.get_backend(group)), torch.cuda.is_available())
        if device is not None and total.device.type != device.type:
            total = total.to(device)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return int(total.item())


def _as_list(masks: Tensor | Iterable[Tensor]) -> list[Tensor]:
    masks = [masks] if isinstance(masks, Tensor) else list(masks)
    if not masks:
        raise ValueError("global_token_count: got no masks")
    return masks


def global_token_count(masks: Tensor | Iterable[Tensor], group=None) -> int:
    """Number of response tokens in ``masks`` (one mask or the masks of all micro-batches of a step),
    summed over the ranks of ``group`` when ``torch.distributed`` is initialised.

    This (with :func:`global_sequence_count`) is the only place in ``vlrft.algorithms`` that touches
    distributed state; it is a collective, so every rank must call it.
    """
    masks = _as_list(masks)
    total = sum(m.bool().sum().to(torch.int64) for m in masks)
    return _all_reduce_sum(total.reshape(1), group)


def global_sequence_count(masks: Tensor | Iterable[Tensor], group=None) -> int:
    """Number of sequences with at least one response token, over micro-batches and ranks (a collective)."""
    masks = _as_list(masks)
    total = sum((m.bool().sum(dim=-1) > 0).sum().to(torch.int64) for m in masks)
    return _all_reduce_sum(total.reshape(1), group)
