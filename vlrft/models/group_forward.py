"""Group-shared forward: each prompt (text, image tokens, vision tower) computed once per group.

GRPO-family training samples n responses per prompt, and for vision-language prompts the prompt is
most of each sequence. Instead of n right-padded rows ``[prompt | r_i | pad]`` (the prompt and its
images computed n times), the samples of one prompt in a micro-batch become ONE packed row

    [prompt | r_1 | r_2 | ... | r_k]

with a block attention mask (every response token sees the whole prompt and its own response's past,
never another response) and per-response positions equal to those the response has in its unshared
sequence: the prompt's positions are Qwen-VL's own multimodal-rope (m-rope) positions from the
model's ``get_rope_index`` (image tokens get 3-D temporal/height/width positions), and each response's
text positions continue from the prompt's largest position + 1, as ``get_rope_index`` gives trailing
text. The result is exact (the same per-token log-probs, entropies, values and gradients as the
unshared path up to float rounding: tests/test_group_forward.py), the vision tower runs once per unique
prompt and no per-response padding is computed (rows of one micro-batch are padded to the longest row).

Memory stays bounded for large groups because a packed row holds only the samples of one micro-batch:
a group of 32 with ``micro_train_batch_size`` 8 is four rows in four micro-batches, each recomputing
the prompt (the prompt is paid once per chunk rather than once per sample).

Attention over a packed row computes only the query-key pairs the block mask allows (``packed_sdpa``): per row,
the prompt's causal attention, then every response's queries at once (responses of the row padded to the longest)
against the prompt's keys followed by the response's own keys under a causal mask; rows of the same shape are
computed together. A row of a 183-token prompt and 16 responses of 48 tokens needs 176 k of the 951^2 = 904 k
pairs a dense mask computes; this computes 210 k. On CPU, responses no longer than the head dimension attend
through explicit float32 scores with each prompt's keys read once for all its responses (``_prefix_attention``,
the decode's attention over a shared prompt cache), the rest through SDPA over copies of the prompt's keys. The
text model's attention becomes ``packed_sdpa`` the first time a model is packed (SDPA itself for every other call,
generation included); eager attention keeps the dense 4-D mask, which also rides along as the mask of record.
"""

from __future__ import annotations

import copy
import types
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from vlrft.models.cpu_matmul import onednn_linear, onednn_matmul

# the attention implementation of a packed model's text layers: SDPA, computing only the pairs a packed row allows
PACKED_SDPA = "vlrft_packed_sdpa"


@dataclass
class PackedGroups:
    """A micro-batch laid out as one packed row per unique prompt."""

    inputs: dict[str, torch.Tensor]  # model kwargs: input_ids, attention_mask (4-D), position_ids, images
    row: torch.Tensor  # [N] the packed row of each sample
    predict_at: torch.Tensor  # [N, R] position (in the row) whose output predicts response token j
    first: int  # the smallest position any sample reads: outputs before it are not needed


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
    """The text attention of SDPA models (registered as ``PACKED_SDPA``). Given packed rows or a shared prompt
    cache, whose layouts are Python data that differ at every step: :func:`_packed_sdpa_eager`, which runs eagerly
    inside a compiled block (``strategy.compile_blocks``). Otherwise :func:`_sdpa`, traceable, so that a compiled
    decode step (a static cache: ``rollout.hf.compile``) is one graph; compiler-disabled whole, it broke that step
    into a graph per layer (the third H200 run: decode 3.7x slower, docs/benchmarks.md)."""
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
    response) in one call for their prompts and one for their responses (:func:`_prefix_attention` instead of SDPA
    where :func:`_explicit_scores` says so). Padding positions output zeros (nothing reads them). Exact: each query
    sees the same keys as under the dense block mask. Given keys from a :class:`SharedPrefixLayer` (decoding):
    attention over each sample's prompt, read once per prompt, and its own keys (:func:`_prefix_attention`)."""
    scale = module.scaling if scaling is None else scaling
    onednn = getattr(module, "onednn_product", False)  # strategy.cpu_matmul: cpu_matmul.use_onednn_linears
    shared = getattr(key, "vlrft_prefix", None)  # keys of a SharedPrefixLayer: decoding n samples per prompt
    if shared is not None and getattr(module, "is_causal", False):
        prefix = shared.prefix_keys, shared.prefix_values, shared.prompt_mask
        return _prefix_attention(query, key, value, *prefix, scale, onednn=onednn)
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
                o, _ = _prefix_attention(own(query), own(key), own(value), pk, pv, None, scale, onednn=onednn)
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


class SharedPrefixLayer(DynamicLayer):
    """One decoder layer's KV cache while ``n`` samples of each prompt decode: the prompt's keys and values once per
    prompt (``[prompts, kv_heads, P, dim]``, left padding masked by ``prompt_mask`` ``[prompts, P]``), each sample's
    own in a buffer allocated once (``room`` tokens, doubled if exceeded) and filled in place, so a decode step
    neither copies the cache (a dynamic cache concatenates it at every step) nor reads each prompt n times (the
    expanded cache of ``batch_repeat_interleave`` does). ``update`` returns the samples' own keys and values, which
    carry this layer as ``vlrft_prefix`` for ``packed_sdpa``; the sequence length it reports counts the prompt."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, prompt_mask: torch.Tensor, n: int, room: int):
        super().__init__()
        # the prompt's keys in float32, the attention's precision, once (not cast again at every decode step); a
        # float32 model's are not copied, a bf16 model's take twice their bytes, once per prompt instead of n times
        self.prefix_keys, self.prefix_values = keys.float(), values.float()
        self.prompt_mask, self.n = prompt_mask.bool(), n
        prompts, heads, _, dim = keys.shape
        self.own_keys = keys.new_empty(prompts * n, heads, max(room, 1), dim)  # the model's dtype
        self.own_values = values.new_empty(prompts * n, heads, max(room, 1), values.shape[-1])
        self.filled = 0
        self.device, self.is_initialized = keys.device, True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        end = self.filled + key_states.shape[-2]
        if end > self.own_keys.shape[-2]:  # more tokens than planned: double the room
            grow = lambda x: torch.cat([x, torch.empty_like(x)], dim=-2)  # noqa: E731
            self.own_keys, self.own_values = grow(self.own_keys), grow(self.own_values)
        self.own_keys[:, :, self.filled : end] = key_states
        self.own_values[:, :, self.filled : end] = value_states
        self.filled = end
        self.keys, self.values = self.own_keys[:, :, :end], self.own_values[:, :, :end]
        keys = self.own_keys[:, :, :end]  # a view of its own: the layer does not hold it (no reference cycle)
        keys.vlrft_prefix = self
        return keys, self.values

    def get_seq_length(self) -> int:
        return self.prefix_keys.shape[-2] + self.filled

    def get_mask_sizes(self, query_length: Any) -> tuple[int, int]:
        q = query_length if isinstance(query_length, int) else int(query_length.shape[0])  # 5.17: cache_position
        return self.get_seq_length() + q, 0

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("SharedPrefixLayer: the samples per prompt are fixed when it is made")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("SharedPrefixLayer: sampling only (no beam search, no contrastive search)")

    reorder_cache = batch_select_indices


def share_prompt_cache(cache: Any, prompt_mask: torch.Tensor, n: int, room: int) -> Any:
    """A prefilled dynamic ``cache`` of one row per prompt (``prompt_mask`` ``[prompts, P]``: its real positions)
    made the cache of ``n`` samples per prompt, each with ``room`` tokens to decode, in place: every layer becomes a
    :class:`SharedPrefixLayer` (the model's text attention must be ``packed_sdpa``: :func:`use_packed_attention`
    says whether it is; any other attention would read the samples' own keys only)."""
    cache.layers = [SharedPrefixLayer(x.keys, x.values, prompt_mask, n, room) for x in cache.layers]
    return cache


def _explicit_scores(query: torch.Tensor, longest: int, dropout: float) -> bool:
    """Whether a block's responses attend through :func:`_prefix_attention` (explicit float32 scores; each prompt's
    keys and values read once for its K responses) rather than SDPA over per-response copies of the prompt's keys
    and values, repeated per query head. On CPU, where it takes two thirds of SDPA's time forward and backward
    (docs/benchmarks.md), for responses no longer than the head dimension D: then what it keeps for the backward
    (the scores and weights, about L(2P + L + 2D) floats per response and query head for responses of L tokens
    after a P-token prompt) is no more than SDPA's copies (2(P + L)D + 2LD). CUDA keeps SDPA's fused kernels."""
    return query.device.type == "cpu" and not dropout and longest <= query.shape[-1]


def _prefix_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    prefix_keys: torch.Tensor,
    prefix_values: torch.Tensor,
    prompt_mask: torch.Tensor | None,
    scale: float,
    onednn: bool = False,
) -> tuple[torch.Tensor, None]:
    """Attention of ``query`` ``[prompts * n, heads, q, dim]`` (n samples per prompt, in prompt order) over its
    prompt's ``prefix_keys`` / ``prefix_values`` ``[prompts, kv_heads, P, dim]`` (shared: one matrix product per
    prompt and KV head for all its samples' queries; ``prompt_mask`` ``[prompts, P]`` its real positions, None: all)
    followed by its own ``key`` / ``value`` ``[prompts * n, kv_heads, t, dim]`` (the last ``q`` of them the queries'
    own, causal): one softmax over both, in float32 (a bf16 model's queries and keys are cast), the output in the
    query's dtype. The same keys and weights as SDPA over every sample's copy of its prompt followed by its own keys.
    Decoding reads a :class:`SharedPrefixLayer`'s prompt (``q`` new tokens); the packed training forward a block's
    responses (``q == t``, the whole response). ``onednn``: the two products over the prompt (one per prompt and KV
    head for all its samples' queries, large in training) by :func:`cpu_matmul.onednn_matmul`
    (``strategy.cpu_matmul``); the samples' own, a small product each, stay batched. Returns ``[B, q, heads, dim]``."""
    pk, pv = prefix_keys, prefix_values
    n = query.shape[0] // pk.shape[0]
    prompts, kv_heads, plen, _ = pk.shape
    batch, heads, q, dim = query.shape
    g, t = heads // kv_heads, key.shape[-2]
    qf = query.float().reshape(prompts, n, kv_heads, g * q, dim)
    # the prompt's scores: [prompts, kv_heads, n * g * q, P], all samples of a prompt in one product
    matmul = onednn_matmul if onednn else torch.matmul
    sp = matmul(qf.transpose(1, 2).reshape(prompts, kv_heads, n * g * q, dim), pk.float().transpose(-1, -2))
    if prompt_mask is not None:
        sp = sp.masked_fill(~prompt_mask[:, None, None, :], float("-inf"))
    sp = sp.view(prompts, kv_heads, n, g * q, plen).transpose(1, 2).reshape(batch, kv_heads, g * q, plen)
    so = qf.reshape(batch, kv_heads, g * q, dim) @ key.float().transpose(-1, -2)  # [B, kv_heads, g * q, t]
    if q > 1:  # query i (the q new tokens are the last q keys) sees its own keys up to t - q + i
        allowed = torch.arange(t, device=key.device)[None] <= torch.arange(t - q, t, device=key.device)[:, None]
        so = so.view(batch, kv_heads, g, q, t).masked_fill(~allowed, float("-inf")).view(batch, kv_heads, g * q, t)
    w = torch.softmax(torch.cat([sp, so], dim=-1) * scale, dim=-1)
    wp, wo = w[..., :plen], w[..., plen:]
    out = wo @ value.float()  # [B, kv_heads, g * q, dim]
    wp = wp.view(prompts, n, kv_heads, g * q, plen).transpose(1, 2).reshape(prompts, kv_heads, n * g * q, plen)
    op = (
        matmul(wp, pv.float())
        .view(prompts, kv_heads, n, g * q, dim)
        .transpose(1, 2)
        .reshape(batch, kv_heads, g * q, dim)
    )
    out = (out + op).view(batch, heads, q, dim).transpose(1, 2).contiguous()
    return out.to(query.dtype), None


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


# transformers hands a vision tower's attention the packed sequences' bounds in one call only where the
# implementation's name contains "flash" (``is_flash_attention_requested``); every other one gets a call per sequence.
# The name says so; SDPA computes it. Only the vision attention modules' own copy of the config carries it (see
# ``use_varlen_vision_attention``): transformers also treats such a name as a flash kernel to load when a model is
# built from a config, so the model's config keeps "sdpa".
VARLEN_SDPA = "vlrft_varlen_sdpa_flash_api"

# Eager inside a compiled block (``strategy.compile_blocks``) where given Python layouts that differ at every step:
# packed rows and a shared prompt cache (``packed_sdpa``'s eager part), a vision tower's sequences (``varlen_sdpa``)
ALL_ATTENTION_FUNCTIONS.register(PACKED_SDPA, packed_sdpa)
ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_SDPA, sdpa_mask)  # generation and plain rows: SDPA's own masks
ALL_ATTENTION_FUNCTIONS.register(VARLEN_SDPA, torch.compiler.disable(varlen_sdpa))


def use_varlen_vision_attention(model: torch.nn.Module) -> bool:
    """A Qwen-VL model whose vision tower attends with SDPA attends through :func:`varlen_sdpa` from now on: each
    vision attention module gets its own copy of the vision config naming it, the model's config (saved, or handed
    to ``from_config``) keeps SDPA, and the text layers keep theirs. The tower gets that copy too, so that it
    computes its sequences' longest length once per forward (two host syncs: whole images and windows) and hands
    it to every block, where each block's attention computed it (a sync per block, and under
    ``strategy.compile_blocks`` a graph break per block). Whether its vision attention does (False for text models,
    other implementations, and towers whose attention modules are not found)."""
    vision = getattr(getattr(model, "config", None), "vision_config", None)
    if vision is None or getattr(vision, "_attn_implementation", None) not in (None, "sdpa"):
        return False
    holders = [m for m in model.modules() if getattr(m, "config", None) is vision]  # the tower and its attention
    attention = [m for m in holders if type(m).__name__.endswith("VisionAttention")]
    if attention:
        own = copy.copy(vision)
        own._attn_implementation = VARLEN_SDPA
        for module in [*attention, *(m for m in holders if hasattr(m, "blocks"))]:
            module.config = own
    return bool(attention)


def use_linear_patch_embedding(model: torch.nn.Module) -> int:
    """A Qwen-VL vision tower's patch embedding computed as the matrix product it is. Its ``Conv3d`` has its kernel as
    its stride, no padding, no dilation, no groups, and is given whole patches (``[patches, channels, temporal, patch,
    patch]``): each goes in whole and one vector comes out, so the convolution is ``F.linear`` of the flattened
    patches with the kernel flattened to ``[embed, channels * temporal * patch * patch]``: the same products, summed
    in the GEMM's order instead of the convolution's (Higham's dot-product bound holds for both;
    tests/test_patch_embedding.py).

    Why: cuDNN's algorithms for this shape are pathological in some versions and dtypes (transformers issue 45750:
    50,000x the linear's time on Blackwell in bf16; SGLang-Omni measured 3.7 s a call on an H100 in bf16; NVIDIA TAO
    replaced it where cuDNN 9.20 lacks the bf16 engine its backward needs); vLLM and SGLang compute it as a linear. On
    a CPU the product is 4-5x faster than the convolution, forward and backward (106 -> 23 ms at the CPU bench's
    images, 3.36 -> 0.76 s at the 3B shape's; docs/benchmarks.md).

    The convolution module stays, with its parameter (``proj.weight``, 5-D, under its name) and its hooks, which
    DeepSpeed ZeRO-3 gathers the weight in: only its forward changes, so checkpoints, the weight stream to vLLM and the
    strategies see the model unchanged (transformers' own ``fusion_config={"patch_embeddings": True}`` renames it).
    Returns the number switched."""
    switched = 0
    for module in model.modules():
        proj = getattr(module, "proj", None)
        if (
            type(module).__name__.endswith("PatchEmbed")
            and isinstance(proj, torch.nn.Conv3d)
            and tuple(proj.stride) == tuple(proj.kernel_size)
            and tuple(proj.padding) == (0, 0, 0)
            and tuple(proj.dilation) == (1, 1, 1)
            and proj.groups == 1
        ):
            proj.forward = types.MethodType(_patch_embedding_forward, proj)
            switched += 1
    return switched


def patch_product(conv: torch.nn.Conv3d, patches: torch.Tensor) -> torch.Tensor:
    """A patch embedding's convolution with its kernel as its stride, on whole patches ``[N, C, T, P, P]``, as the
    matrix product it equals: ``[N, embed, 1, 1, 1]``, as the convolution returns; by oneDNN where the model's linear
    layers compute so (``strategy.cpu_matmul``: ``cpu_matmul.use_onednn_linears`` marks the convolution)."""
    linear = onednn_linear if getattr(conv, "onednn_product", False) else torch.nn.functional.linear
    out = linear(patches.flatten(1), conv.weight.flatten(1), conv.bias)
    return out[:, :, None, None, None]


def _patch_embedding_forward(conv: torch.nn.Conv3d, patches: torch.Tensor) -> torch.Tensor:
    """The switched convolution's forward (:func:`use_linear_patch_embedding`): the product for whole patches, the
    convolution itself for anything else."""
    if tuple(patches.shape[2:]) == tuple(conv.kernel_size):
        return patch_product(conv, patches)
    return type(conv).forward(conv, patches)


def sample_images(batch: dict[str, torch.Tensor], idx: list[int]) -> dict[str, torch.Tensor]:
    """``pixel_values`` / ``image_grid_thw`` / ``images_per_sample`` of samples ``idx`` of a collated batch
    (images are stored per sample, in sample order); {} when none of them has an image."""
    if "pixel_values" not in batch:
        return {}
    grid, per_sample = batch["image_grid_thw"], batch["images_per_sample"].tolist()
    patch_counts = grid.prod(-1).tolist()
    img_start = [0]
    for c in per_sample:
        img_start.append(img_start[-1] + c)
    patch_start = [0]
    for c in patch_counts:
        patch_start.append(patch_start[-1] + c)
    rows, grids = [], []
    for i in idx:
        a, b = img_start[i], img_start[i + 1]
        if b > a:
            rows.append(batch["pixel_values"][patch_start[a] : patch_start[b]])
            grids.append(grid[a:b])
    if not rows:
        return {}
    return {
        "pixel_values": torch.cat(rows),
        "image_grid_thw": torch.cat(grids),
        "images_per_sample": batch["images_per_sample"][idx],
    }


def _rope_owner(model: torch.nn.Module) -> Any:
    """The submodule with Qwen-VL's ``get_rope_index`` (through DeepSpeed/peft wrappers), or None (text Qwen)."""
    for module in model.modules():
        if hasattr(module, "get_rope_index"):
            return module
    return None


def _text_config(model: torch.nn.Module) -> Any:
    """The text model's transformers config, through wrappers (a DeepSpeed engine's own ``config`` is a dict)."""
    for owner in (model, getattr(model, "module", None)):
        config = getattr(owner, "config", None)
        if hasattr(config, "get_text_config"):
            return getattr(config, "text_config", None) or config
    return None


def _attention_kind(model: torch.nn.Module) -> str:
    return getattr(_text_config(model), "_attn_implementation", None) or "sdpa"


def use_packed_attention(model: torch.nn.Module) -> bool:
    """The text layers of an SDPA model attend through ``packed_sdpa`` from now on (SDPA unless given packed rows).
    Whether they do (False for eager or flash attention, which keep their own)."""
    text = _text_config(model)
    if text is not None and _attention_kind(model) == "sdpa":
        text._attn_implementation = PACKED_SDPA
    return _attention_kind(model) == PACKED_SDPA


# attention implementations that take an arbitrary 4-D mask (flash-attention 2 does not: plain rows there)
BLOCK_MASK_ATTENTION = ("sdpa", "eager", PACKED_SDPA)


def shared_forward_applies(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> bool:
    """The batch says which samples share a prompt, the model's attention takes the block mask, and no response
    holds images of its own. Multi-turn responses with text observations pack as any response does (their tokens
    continue the prompt's positions one by one); images that tools returned inside a response would need their
    own m-rope positions and vision features in the packed row, which this packing does not lay out, so such
    batches take the plain path."""
    if "prompt_index" not in batch or _attention_kind(model) not in BLOCK_MASK_ATTENTION:
        return False
    return "response_images" not in batch or not bool(batch["response_images"].any())


def _prompt_positions(owner: Any, ids: torch.Tensor, types: torch.Tensor | None, grid: torch.Tensor | None):
    """The prompt's m-rope positions ``[3, L]`` (1-D text positions repeated where it has no image)."""
    if owner is None or grid is None or types is None:
        return torch.arange(ids.numel()).expand(3, -1)
    pos, _ = owner.get_rope_index(ids[None], mm_token_type_ids=types[None], image_grid_thw=grid)
    return pos[:, 0].cpu()


def pack_groups(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], width: int, device: torch.device
) -> PackedGroups:
    """The packed rows of a collated micro-batch (``data_pipelines.collate.collate_sequences`` with its
    ``prompt_index``): the samples of one prompt, in batch order, share one row. ``width``: response
    positions to read per sample."""
    prompt_index = batch["prompt_index"].tolist()
    prompt_len = batch["prompt_lengths"].tolist()
    resp_len = batch["response_lengths"].tolist()
    n = len(prompt_index)
    r = width
    owner = _rope_owner(model)
    vl = owner is not None
    members: dict[int, list[int]] = {}
    for i, p in enumerate(prompt_index):
        members.setdefault(p, []).append(i)

    rows_ids, rows_pos, rows_seg, images, spans = [], [], [], [], []
    row_of = torch.zeros(n, dtype=torch.long)
    predict_at = torch.zeros((n, r), dtype=torch.long)
    for b, (_, samples) in enumerate(members.items()):
        s0 = samples[0]
        lp = prompt_len[s0]
        ids = [batch["input_ids"][s0, :lp]]
        types = batch["mm_token_type_ids"][s0, :lp] if "mm_token_type_ids" in batch else None
        img = sample_images(batch, [s0])
        images.append(img)
        ppos = _prompt_positions(owner if vl else None, ids[0], types, img.get("image_grid_thw"))
        start = int(ppos.max()) + 1 if lp else 0
        pos, seg = [ppos], [torch.zeros(lp, dtype=torch.long)]
        offset = lp
        for k, i in enumerate(samples, start=1):
            li = resp_len[i]
            ids.append(batch["input_ids"][i, lp : lp + li])
            pos.append((start + torch.arange(li)).expand(3, -1))
            seg.append(torch.full((li,), k, dtype=torch.long))
            row_of[i] = b
            # token 0 is predicted by the prompt's last position, token j > 0 by the response's token j - 1
            # positions past the response's end repeat its last one (junk, masked); an empty response reads the
            # prompt's last position; a micro-batch of empty responses (r = 0) reads none
            at = torch.cat([torch.tensor([lp - 1]), offset + torch.arange(max(r - 1, 0))])[:r]
            predict_at[i] = at.clamp(max=offset + li - 1 if li else lp - 1)
            offset += li
        rows_ids.append(torch.cat(ids))
        rows_pos.append(torch.cat(pos, dim=1))
        rows_seg.append(torch.cat(seg))
        spans.append((lp, [resp_len[i] for i in samples]))

    row_width = max(x.numel() for x in rows_ids)
    nrows = len(rows_ids)
    input_ids = torch.zeros((nrows, row_width), dtype=torch.long)
    position_ids = torch.zeros((3, nrows, row_width), dtype=torch.long)
    seg = torch.full((nrows, row_width), -1, dtype=torch.long)  # -1: padding
    for b in range(nrows):
        w = rows_ids[b].numel()
        input_ids[b, :w] = rows_ids[b]
        position_ids[:, b, :w] = rows_pos[b]
        seg[b, :w] = rows_seg[b]
    q = torch.arange(row_width)
    causal = q[None, :] <= q[:, None]  # [query, key]
    same = (seg[:, None, :] == 0) | (seg[:, None, :] == seg[:, :, None])  # key is prompt, or same response
    allowed = causal[None] & same & (seg[:, None, :] >= 0)
    allowed |= torch.eye(row_width, dtype=torch.bool)[None] & (seg[:, :, None] < 0)  # padding sees itself only
    mask = allowed[:, None]  # [rows, 1, query, key]
    if _attention_kind(model) == "eager":
        dtype = next(model.parameters()).dtype
        mask = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)
    inputs = {
        "input_ids": input_ids.to(device),
        "attention_mask": mask.to(device),
        "position_ids": (position_ids if vl else position_ids[0]).to(device),
    }
    if use_packed_attention(model):  # SDPA models; eager attention reads the dense mask above
        inputs["vlrft_packed"] = _packed_layout(spans, row_width, device)
    with_images = [x for x in images if x]
    if with_images:
        inputs["pixel_values"] = torch.cat([x["pixel_values"] for x in with_images]).to(device)
        inputs["image_grid_thw"] = torch.cat([x["image_grid_thw"] for x in with_images]).to(device)
    first = int(predict_at.min()) if predict_at.numel() else 0
    return PackedGroups(inputs, row_of, predict_at, first)


def _packed_layout(spans: list[tuple[int, list[int]]], width: int, device: torch.device) -> PackedLayout:
    """The layout of rows ``[prompt | r_1 | ... | r_K]`` (one per ``(prompt, response lengths)`` of ``spans``),
    padded to ``width``, for ``packed_sdpa``: rows of the same prompt length, K and longest response form one block."""
    shapes: dict[tuple[int, int, int], list[int]] = {}
    for b, (prompt, lengths) in enumerate(spans):
        shapes.setdefault((prompt, len(lengths), max(lengths, default=0)), []).append(b)
    blocks = []
    for (prompt, n, longest), members in shapes.items():
        rows = torch.tensor(members)
        prompt_at = (rows[:, None] * width + torch.arange(prompt)).flatten().to(device)
        if not n:
            blocks.append(PackedBlock(rows.to(device), prompt, prompt_at, 0, None, None, None, None))
            continue
        length = max(longest, 1)
        j = torch.arange(length)
        gathers, valids, dests = [], [], []
        for g, b in enumerate(members):
            lengths = spans[b][1]
            total = prompt + sum(lengths)
            starts = prompt + torch.tensor([0] + lengths[:-1]).cumsum(0)
            lens = torch.tensor(lengths)
            # response k's token j, or (padding) its last real token; an empty response reads position 0
            at = (starts[:, None] + torch.minimum(j[None], (lens[:, None] - 1).clamp(min=0))).clamp(
                max=max(total - 1, 0)
            )
            real = (j[None] < lens[:, None]).flatten().nonzero().squeeze(1)
            gathers.append(at.flatten())
            valids.append(g * n * length + real)
            dests.append(b * width + at.flatten()[real])
        gather = torch.stack([rows.repeat_interleave(n * length), torch.cat(gathers)])
        causal = j[None, :] <= j[:, None]
        mask = torch.cat([torch.ones(length, prompt, dtype=torch.bool), causal], dim=1)[None, None]
        blocks.append(
            PackedBlock(
                rows.to(device),
                prompt,
                prompt_at,
                n,
                gather.to(device),
                torch.cat(valids).to(device),
                torch.cat(dests).to(device),
                mask.to(device),
            )
        )
    rows = [PackedRow(prompt, prompt + sum(lengths)) for prompt, lengths in spans]
    return PackedLayout(rows, width, blocks)


def shared_prompt_logits(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], width: int, device: torch.device
) -> torch.Tensor:
    """The logits ``[N, R, V]`` that predict each sample's response tokens, from one packed row per prompt
    (only the logits from the first response-predicting position on are computed)."""
    packed = pack_groups(model, batch, width, device)
    keep = packed.inputs["input_ids"].shape[1] - packed.first
    out = model(**packed.inputs, logits_to_keep=keep, use_cache=False)
    row, at = packed.row.to(device), (packed.predict_at - packed.first).to(device)
    return out.logits[row[:, None], at]


def shared_prompt_values(
    critic: torch.nn.Module, batch: dict[str, torch.Tensor], width: int, device: torch.device
) -> torch.Tensor:
    """A critic's per-token values ``[N, R]`` of the states before each response token (value j: the state
    that predicts token j), from one packed row per prompt."""
    packed = pack_groups(critic, batch, width, device)
    values = critic(**packed.inputs, per_token=True)  # [rows, width]
    return values[packed.row.to(device)[:, None], packed.predict_at.to(device)]
