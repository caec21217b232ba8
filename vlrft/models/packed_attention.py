"""Attention over packed rows: the text attention of SDPA models once they are switched to it (``packed_sdpa``).

Attention over a packed row (``[prompt | r_1 | ... | r_K]``, laid out by ``vlrft.models.packing``) computes only the
query-key pairs the block mask allows: per row, the prompt's causal attention, then every response's queries at once
(responses of the row padded to the longest) against the prompt's keys followed by the response's own keys under a
causal mask; rows of the same shape are computed together. A row of a 183-token prompt and 16 responses of 48 tokens
needs 176 k of the 951^2 = 904 k pairs a dense mask computes; this computes 210 k. On CPU, responses no longer than
the head dimension attend through explicit float32 scores with each prompt's keys read once for all its responses
(``prefix_decoding.prefix_attention``, the decode's attention over a shared prompt cache), the rest through SDPA over
copies of the prompt's keys. Without packed rows it is SDPA itself (generation included), except a decode step with
grouped KV heads (:func:`grouped_decode_attention`) and keys of a shared prompt cache (``SharedPrefixLayer``). Eager
attention keeps the dense 4-D mask, which also rides along as the mask of record. The model's text layers are
switched to it by ``attention_functions.use_packed_attention``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from vlrft.models.prefix_decoding import prefix_attention


@dataclass
class PackedRow:
    """A packed row's extent."""

    prompt: int  # prompt tokens (positions 0 .. prompt-1)
    length: int  # real tokens of the row (the rest is padding)


@dataclass
class PackedBlock:
    """The packed rows of one shape (prompt length, number of responses K, longest response L), which
    ``packed_sdpa`` computes together (one attention call for their prompts, one for all their responses)."""

    rows: torch.Tensor  # [G] the rows
    prompt: int
    prompt_at: torch.Tensor  # [G * prompt] flat positions (row * width + i) of the prompts' tokens
    responses: int  # K
    gather: torch.Tensor | None  # [2, G * K * L] row and position of response k's token j (padding repeats a real one)
    valid: torch.Tensor | None  # indices into the flattened [G * K * L] of the real response tokens
    dest: torch.Tensor | None  # their flat positions (row * width + position)
    mask: torch.Tensor | None  # [1, 1, L, prompt + L] every response query sees the prompt, and its own past


@dataclass
class PackedLayout:
    """The packed rows of one forward (passed to the attention as the keyword ``vlrft_packed``)."""

    rows: list[PackedRow]
    width: int  # the rows' padded length
    blocks: list[PackedBlock]


def packed_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    vlrft_packed: PackedLayout | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The text attention of SDPA models (registered as ``attention_functions.PACKED_SDPA``). Given packed rows or a
    shared prompt cache, whose layouts are Python data that differ at every step: :func:`_packed_sdpa_eager`, which
    runs eagerly inside a compiled block (``strategy.compile_blocks``). Otherwise :func:`_sdpa`, traceable, so that a
    compiled decode step (a static cache: ``rollout.hf.compile``) is one graph; compiler-disabled whole, it broke that
    step into a graph per layer (the third H200 run: decode 3.7x slower, docs/benchmarks.md)."""
    if vlrft_packed is not None or getattr(key, "vlrft_prefix", None) is not None:
        return _packed_sdpa_eager(module, query, key, value, attention_mask, dropout, scaling, vlrft_packed, kwargs)
    return _sdpa(module, query, key, value, attention_mask, dropout, scaling, **kwargs)


def _sdpa(module, query, key, value, attention_mask, dropout, scaling, **kwargs) -> tuple[torch.Tensor, None]:
    """Transformers' SDPA attention, on the KV heads for a decode step with grouped KV heads and a mask."""
    if _grouped_decode_applies(module, query, attention_mask, dropout):
        scale = module.scaling if scaling is None else scaling
        return grouped_decode_attention(query, key, value, attention_mask, scale)
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


@torch.compiler.disable
def _packed_sdpa_eager(module, query, key, value, attention_mask, dropout, scaling, layout, kwargs):
    """:func:`_sdpa`, except on a causal (text) layer in two cases. Given packed rows (``query``
    ``[rows, heads, width, dim]``, the layout as ``vlrft_packed``): the block mask's attention computed from its
    allowed pairs only. Per row, the prompt's queries attend causally to the prompt; the responses' queries,
    gathered as ``[K, heads, L, dim]``, attend to the prompt's keys (shared, expanded) followed by their own keys,
    causally; the rows of one :class:`PackedBlock` (the same prompt length, number of responses and longest
    response) in one call for their prompts and one for their responses (:func:`prefix_attention` instead of SDPA
    where :func:`_explicit_scores` says so). Padding positions output zeros (nothing reads them). Exact: each query
    sees the same keys as under the dense block mask. Given keys from a ``prefix_decoding.SharedPrefixLayer``
    (decoding): attention over each sample's prompt, read once per prompt, and its own keys
    (:func:`prefix_attention`)."""
    scale = module.scaling if scaling is None else scaling
    matmul = getattr(module, "prompt_matmul", torch.matmul)  # the products over a prompt (the strategy may set it)
    shared = getattr(key, "vlrft_prefix", None)  # keys of a SharedPrefixLayer: decoding n samples per prompt
    if shared is not None and getattr(module, "is_causal", False):
        prefix = shared.prefix_keys, shared.prefix_values, shared.prompt_mask
        return prefix_attention(query, key, value, *prefix, scale, matmul=matmul)
    if (
        layout is None
        or not getattr(module, "is_causal", False)
        or query.shape[0] != len(layout.rows)
        or query.shape[2] != layout.width
    ):
        return _sdpa(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    rows, heads, width, dim = query.shape
    pieces, where = [], []
    for block in layout.blocks:
        p = block.prompt
        pk, pv = key[block.rows, :, :p], value[block.rows, :, :p]  # the block's prompts: [G, heads, p, dim]
        if p:
            o, _ = sdpa_attention_forward(
                module,
                query[block.rows, :, :p],
                pk,
                pv,
                None,
                dropout=dropout,
                scaling=scaling,
                is_causal=True,
            )  # [G, p, heads, dim]
            pieces.append(o.flatten(0, 1))
            where.append(block.prompt_at)
        if block.gather is not None:
            n, length = block.responses, block.mask.shape[2]
            at_row, at = block.gather

            def own(x: torch.Tensor) -> torch.Tensor:  # [rows, heads, width, dim] -> [G * K, heads, L, dim]
                return x[at_row, :, at].unflatten(0, (-1, length)).transpose(1, 2)

            def shared(x: torch.Tensor) -> torch.Tensor:  # a prompt's, once per response: [G * K, heads, p, dim]
                return x[:, None].expand(-1, n, -1, -1, -1).flatten(0, 1)

            if _explicit_scores(query, length, dropout):  # each prompt's keys read once for its K responses
                o, _ = prefix_attention(own(query), own(key), own(value), pk, pv, None, scale, matmul=matmul)
            else:
                keys = torch.cat([shared(pk), own(key)], dim=2)
                values = torch.cat([shared(pv), own(value)], dim=2)
                o, _ = sdpa_attention_forward(
                    module, own(query), keys, values, block.mask, dropout=dropout, scaling=scaling
                )  # [G * K, L, heads, dim]
            pieces.append(o.flatten(0, 1)[block.valid])
            where.append(block.dest)
    out = query.new_zeros(rows * width, heads, dim)  # padding positions stay zero (nothing reads them)
    out = out.index_put((torch.cat(where),), torch.cat(pieces))
    return out.unflatten(0, (rows, width)), None


def _grouped_decode_applies(module: torch.nn.Module, query: torch.Tensor, mask: torch.Tensor | None, dropout: float):
    """One query token per row (a decode step), grouped KV heads and a mask shared by all heads and queries (the
    padding of a static or left-padded cache): transformers' SDPA would copy every key and value once per query head
    of its group (``repeat_kv``: SDPA's GQA flag needs no mask), and under torch.compile it always does."""
    groups = getattr(module, "num_key_value_groups", 1)
    return (
        groups > 1
        and query.shape[2] == 1
        and mask is not None
        and mask.dim() == 4
        and mask.shape[1] == mask.shape[2] == 1
        and not dropout
    )


def grouped_decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, scale: float
) -> tuple[torch.Tensor, None]:
    """Decode attention with grouped KV heads (GQA, Ainslie et al. 2023, section 2) without copying the cache: the
    ``g`` query heads of KV head ``j`` (heads ``j g .. j g + g - 1``, transformers' ``repeat_kv`` order) become ``g``
    queries of that head, so SDPA reads each key and value once for all of them. ``query`` ``[B, heads, 1, dim]``,
    ``key`` / ``value`` ``[B, kv_heads, S, dim]``, ``mask`` ``[B or 1, 1, 1, S]`` (bool or additive, broadcast over
    the g queries). The same scores, weights and outputs as SDPA over the repeated cache (one dot product per
    query and key either way). Returns ``[B, 1, heads, dim]``, as transformers' attention functions do."""
    batch, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(batch, kv_heads, heads // kv_heads, dim), key, value, attn_mask=mask, scale=scale
    )  # [B, kv_heads, g, dim]
    return out.reshape(batch, 1, heads, value.shape[-1]), None


def _explicit_scores(query: torch.Tensor, longest: int, dropout: float) -> bool:
    """Whether a block's responses attend through :func:`prefix_attention` (explicit float32 scores; each prompt's
    keys and values read once for its K responses) rather than SDPA over per-response copies of the prompt's keys
    and values, repeated per query head. On CPU, where it takes two thirds of SDPA's time forward and backward
    (docs/benchmarks.md), for responses no longer than the head dimension D: then what it keeps for the backward
    (the scores and weights, about L(2P + L + 2D) floats per response and query head for responses of L tokens
    after a P-token prompt) is no more than SDPA's copies (2(P + L)D + 2LD). CUDA keeps SDPA's fused kernels."""
    return query.device.type == "cpu" and not dropout and longest <= query.shape[-1]
