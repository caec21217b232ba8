"""Token log-probabilities and entropies from logits, in chunks so a 150k vocabulary stays bounded.

Both functions run forward *and* backward chunk by chunk (custom autograd functions that recompute the
float32 softmax of one chunk in backward), so the peak extra memory is one chunk of
``chunk_size x V`` float32 values instead of a float32 copy of the whole ``[B, T, V]`` tensor. The only
full-size tensor created is the gradient of the logits, in the logits' own dtype.

Temperature is applied as in sampling (vLLM, HF ``generate``): ``softmax(logits / temperature)``, so
the log-probs match those of the engine that sampled with that temperature.
"""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor

DEFAULT_CHUNK_SIZE = 1024  # positions per chunk: 1024 x 152k float32 = 0.6 GB


def _chunks(shape: torch.Size, chunk_size: int):
    """(b, t0, t1) slices of a ``[B, T, ...]`` tensor with at most ``chunk_size`` rows each; slicing per
    row keeps views of non-contiguous logits (e.g. ``logits[:, :-1]``) copy-free."""
    batch, length = shape[0], shape[1]
    step = max(1, int(chunk_size))
    for b in range(batch):
        for t0 in range(0, length, step):
            yield b, t0, min(t0 + step, length)


def _compute_dtype(logits: Tensor) -> torch.dtype:
    # float32 for bf16/fp16/fp32 logits; float64 stays float64 (gradcheck, references)
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _flat(t: Tensor) -> Tensor:
    """``[B, T, ...] -> [1, B*T, ...]`` when that is a view, so chunks span rows (fewer, larger kernels)."""
    return t.view(1, -1, *t.shape[2:]) if t.is_contiguous() else t


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


class _ChunkedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, labels: Tensor, temperature: float, chunk_size: int) -> Tensor:
        out = torch.empty(labels.shape, dtype=_compute_dtype(logits), device=logits.device)
        for b, t0, t1 in _chunks(labels.shape, chunk_size):
            x = logits[b, t0:t1].to(_compute_dtype(logits)) / temperature
            lab = labels[b, t0:t1, None]
            out[b, t0:t1] = x.gather(-1, lab).squeeze(-1) - torch.logsumexp(x, dim=-1)
        ctx.save_for_backward(logits, labels)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        logits, labels = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for b, t0, t1 in _chunks(labels.shape, ctx.chunk_size):
            x = logits[b, t0:t1].to(_compute_dtype(logits)) / ctx.temperature
            # d log p_label / d x_j = onehot_j - softmax_j ; d x / d logits = 1 / temperature
            gx = -torch.softmax(x, dim=-1)
            gx.scatter_add_(-1, labels[b, t0:t1, None], torch.ones_like(gx[:, :1]))
            gx *= (grad_out[b, t0:t1].to(x.dtype) / ctx.temperature)[:, None]
            grad[b, t0:t1] = gx.to(grad.dtype)
        return grad, None, None, None


class _ChunkedEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, temperature: float, chunk_size: int) -> Tensor:
        out = torch.empty(logits.shape[:-1], dtype=_compute_dtype(logits), device=logits.device)
        for b, t0, t1 in _chunks(logits.shape, chunk_size):
            x = logits[b, t0:t1].to(_compute_dtype(logits)) / temperature
            p = torch.softmax(x, dim=-1)
            out[b, t0:t1] = torch.logsumexp(x, dim=-1) - (p * x).sum(-1)
        ctx.save_for_backward(logits)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        (logits,) = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for b, t0, t1 in _chunks(logits.shape, ctx.chunk_size):
            x = logits[b, t0:t1].to(_compute_dtype(logits)) / ctx.temperature
            p = torch.softmax(x, dim=-1)
            # dH/dx_j = -p_j (x_j - sum_k p_k x_k)
            gx = -p * (x - (p * x).sum(-1, keepdim=True))
            gx *= (grad_out[b, t0:t1].to(x.dtype) / ctx.temperature)[:, None]
            grad[b, t0:t1] = gx.to(grad.dtype)
        return grad, None, None


def logprobs_from_logits(
    logits: Tensor, labels: Tensor, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> Tensor:
    """``log softmax(logits / temperature)[label]`` per position, ``[B, T]`` in float32 (float64 for float64 logits).

    ``logits[:, t]`` must already be the prediction of ``labels[:, t]`` (the caller shifts: for a causal
    LM, ``logits[:, :-1]`` against ``input_ids[:, 1:]``). Every position is computed; apply the
    response mask afterwards. Differentiable; the backward pass is chunked as well.
    The policy-gradient log-likelihood of Williams (1992), as used by PPO (arXiv 1707.06347, eq. 6).
    """
    _check_temperature(temperature)
    if logits.dim() != 3 or logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logprobs_from_logits: logits {tuple(logits.shape)} do not match labels {tuple(labels.shape)}: "
            "logits[:, t] must predict labels[:, t] (shift before calling)"
        )
    shape = labels.shape
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= logits.shape[-1]):
        raise ValueError(
            f"logprobs_from_logits: label ids must lie in [0, {logits.shape[-1]}), got "
            f"[{int(labels.min())}, {int(labels.max())}] "
            "(replace ignore-index/padding labels by a valid id and mask them)"
        )
    labels = labels.long()
    if logits.is_contiguous():
        logits, labels = _flat(logits), _flat(labels.contiguous())
    out = _ChunkedLogProbs.apply(logits, labels, float(temperature), int(chunk_size))
    return out.reshape(shape)


def entropy_from_logits(logits: Tensor, temperature: float = 1.0, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Tensor:
    """Entropy ``H = logsumexp(x) - sum_j softmax(x)_j x_j`` of ``x = logits / temperature``, ``[B, T]`` float32
    (float64 for float64 logits).

    Shannon entropy of the next-token distribution (the bonus of PPO, arXiv 1707.06347, eq. 9).
    Differentiable, chunked in forward and backward.
    """
    _check_temperature(temperature)
    if logits.dim() != 3:
        raise ValueError(f"entropy_from_logits: logits must be [B, T, V], got shape {tuple(logits.shape)}")
    return _ChunkedEntropy.apply(_flat(logits), float(temperature), int(chunk_size)).reshape(logits.shape[:-1])


def high_entropy_mask(entropy: Tensor, mask: Tensor, rho: float) -> Tensor:
    """Keep the ``ceil(rho * n)`` highest-entropy tokens among the ``n`` valid tokens of ``mask``.

    "Beyond the 80/20 Rule" (Wang et al. 2025, arXiv 2506.01939, Sec. 5, eq. 9): the policy gradient
    is computed only on the top-``rho`` "forking" tokens (rho = 0.2 in the paper) of the batch.
    Ties at the threshold are broken by position (``torch.topk``). ``rho = 1`` returns ``mask``; an empty
    mask returns all False. The fraction is taken over the tensors given (one micro-batch).
    """
    if not 0 < rho <= 1:
        raise ValueError(f"high_entropy_mask: rho must be in (0, 1], got {rho}")
    if entropy.shape != mask.shape:
        raise ValueError(f"high_entropy_mask: entropy {tuple(entropy.shape)} != mask {tuple(mask.shape)}")
    m = mask.bool()
    n = int(m.sum())
    k = min(n, math.ceil(rho * n - 1e-9))  # 1e-9: 0.2 * 10 must give 2, not 3
    keep = torch.zeros(m.numel(), dtype=torch.bool, device=m.device)
    if k > 0:
        scores = torch.where(m, entropy.detach().float(), torch.full_like(entropy, -torch.inf, dtype=torch.float32))
        keep[scores.reshape(-1).topk(k).indices] = True
    return keep.reshape(m.shape)
