"""Numerical checks and reductions every strategy and trainer shares: whether tensors hold NaN or infinities (the
non-finite guard), whether AdamW with ``eps=0`` would divide zero by zero, and metrics averaged over the ranks."""

from __future__ import annotations

from typing import Any

import torch


def any_nonfinite(tensors: list[torch.Tensor]) -> bool:
    """Whether an element of ``tensors`` is NaN or infinite, with one device sync for all of them. Each tensor's
    absolute sum (``torch._foreach_norm(tensors, 1)``: on a GPU a few multi-tensor kernels for all the tensors, where
    each tensor's extremes and their stack were two launches per tensor, 1,655 of the 21.5 k operators of a 3B update
    step: docs/benchmarks.md) is NaN or infinite when one of its elements is, since NaN and infinities
    propagate through sums. The absolute sum of a tensor whose elements are all finite can still overflow its dtype
    (above 3.4e38 in float32, far beyond any trained weights), so a tensor so flagged is read again by its extremes,
    which are finite exactly when all its elements are: only NaN and infinite elements count."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors:
        return False
    flagged = (~torch.stack(torch._foreach_norm(tensors, 1)).isfinite()).nonzero().flatten().tolist()
    return any(not bool(torch.stack(torch.aminmax(tensors[i])).isfinite().all()) for i in flagged)


def mean_over_ranks(strategy: Any, metrics: dict[str, float], weight: float = 1.0, missing: str = "skip") -> dict:
    """Metrics averaged over the ranks, each rank's weighted by ``weight`` (its count of prompts, say), over the union
    of the ranks' keys (one collective shape everywhere). A key a rank lacks is left out of that key's mean
    (``missing="skip"``: a figure undefined on its share) or counts as 0 (``"zero"``: a count of nothing)."""
    if not strategy.distributed:
        return dict(metrics)
    keys = sorted(set().union(*strategy.all_gather_object(sorted(metrics))))
    rows = [[metrics.get(k, 0.0) * weight, weight if k in metrics or missing == "zero" else 0.0] for k in keys]
    total = strategy.all_reduce(torch.tensor(rows, dtype=torch.float64), "sum").tolist()
    return {k: s / n for k, (s, n) in zip(keys, total) if n > 0}


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t`` (a DTensor's local shard), or ``t`` itself."""
    return t.to_local() if hasattr(t, "to_local") else t


def adamw_zero_over_zero(optimizer: torch.optim.Optimizer) -> bool:
    """Whether AdamW with ``eps=0`` would write NaN: an element whose gradient and second moment are both
    zero gets ``0 / (sqrt(0) + 0)``."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is None:
                continue
            zero_grad = local_tensor(p.grad) == 0
            v = optimizer.state.get(p, {}).get("exp_avg_sq")
            if bool((zero_grad & (local_tensor(v) == 0) if v is not None else zero_grad).any()):
                return True
    return False
