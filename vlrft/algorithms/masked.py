"""Masked reductions shared by the algorithm modules (pure tensor functions)."""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Sum of ``x`` where ``mask`` is true (masked entries contribute exactly 0, even if NaN/inf)."""
    x = torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return x.sum() if dim is None else x.sum(dim=dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over ``mask``; 0 (not NaN) where the mask is empty."""
    count = mask.to(x.dtype).sum() if dim is None else mask.to(x.dtype).sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


def masked_std(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Standard deviation of the masked entries (Bessel-corrected by default); 0 for fewer than 2 entries."""
    n = mask.to(x.dtype).sum()
    mean = masked_mean(x, mask)
    var = masked_sum((x - mean) ** 2, mask) / (n - 1 if unbiased else n).clamp(min=1)
    return var.sqrt()


def masked_whiten(x: Tensor, mask: Tensor, eps: float = 1e-6) -> Tensor:
    """``(x - mean) / (std + eps)`` over the masked entries (unbiased std); masked entries come out 0.

    If all masked entries are equal (or there are none) the result is exactly 0: never NaN, never
    rounding noise divided by ``eps``.
    """
    m = mask.bool()
    valid = x[m]
    if valid.numel() == 0 or bool((valid == valid[0]).all()):
        return torch.zeros_like(x)
    out = (x - masked_mean(x, m)) / (masked_std(x, m) + eps)
    return torch.where(m, out, torch.zeros_like(out))
