"""A Qwen-VL vision tower's attention over its packed sequences, one SDPA call per sequence length
(``varlen_sdpa``; selected by ``attention_functions.use_varlen_vision_attention``)."""

from __future__ import annotations

from typing import Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward


def varlen_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    dropout: float = 0.0,
    scaling: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    is_causal: bool = False,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A vision tower's attention over its packed sequences (``query`` / ``key`` / ``value`` ``[1, heads, T, dim]``,
    sequence i at ``cu_seq_lens_q[i] .. cu_seq_lens_q[i + 1]``: one image, or one window of an image) with SDPA, the
    sequences of one length in one call (``[sequences, heads, length, dim]``) instead of one call per sequence: a
    Qwen2.5-VL image of 1,024 merged tokens is 64 windows of 64 patches, so its 28 windowed layers made 1,792 SDPA
    calls forward and as many backward, each with its launches and host work. Each sequence attends to itself only,
    as in the per-sequence calls (the same products and sums, in one batched kernel). Returns ``[1, T, heads, dim]``,
    as transformers' attention functions do. Without ``cu_seq_lens_q``: transformers' SDPA."""
    if cu_seq_lens_q is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs
        )
    other_keys = cu_seq_lens_k is not None and cu_seq_lens_k is not cu_seq_lens_q  # (vision towers pass one tensor)
    if attention_mask is not None or (other_keys and not torch.equal(cu_seq_lens_k, cu_seq_lens_q)):
        raise ValueError("varlen_sdpa: self-attention within packed sequences only (no mask, the same bounds for keys)")
    _, heads, total, _ = query.shape
    bounds = cu_seq_lens_q.tolist()  # one host sync per layer (the per-sequence path's split has one too)
    if bounds[0] != 0 or bounds[-1] != total:
        raise ValueError(f"varlen_sdpa: sequence bounds {bounds[0]}..{bounds[-1]} do not cover the {total} positions")
    starts_by_length: dict[int, list[int]] = {}
    for start, end in zip(bounds[:-1], bounds[1:]):
        if end > start:  # Qwen2.5-VL's window bounds can repeat (an empty window)
            starts_by_length.setdefault(end - start, []).append(start)
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, heads, dim]
    outs, where = [], []
    for length, starts in starts_by_length.items():
        if len(starts_by_length) == 1:  # one length: the sequences tile [0, T) in order, no gather
            at = None
            chunks = [x.view(len(starts), length, heads, x.shape[-1]).transpose(1, 2) for x in (q, k, v)]
        else:
            at = (torch.tensor(starts, device=q.device)[:, None] + torch.arange(length, device=q.device)).flatten()
            chunks = [x[at].view(len(starts), length, heads, x.shape[-1]).transpose(1, 2) for x in (q, k, v)]
        o = torch.nn.functional.scaled_dot_product_attention(
            *chunks, dropout_p=dropout, scale=scaling, is_causal=is_causal
        )  # [sequences, heads, length, dim]
        outs.append(o.transpose(1, 2).reshape(-1, heads, o.shape[-1]))
        where.append(at)
    if len(outs) == 1:
        return outs[0][None], None
    out = q.new_empty(total, heads, v.shape[-1]).index_copy(0, torch.cat(where), torch.cat(outs))
    return out[None], None
