"""Attention over a prompt held once for its n samples: the KV cache that decoding shares (the ``hf`` engine's
``prefill_once``), and the attention over such a prompt followed by each sample's own keys, which decoding and the
packed training forward's short responses (``packed_attention._explicit_scores``) both compute.

While n samples of each prompt decode, the prompt's keys and values are held once per prompt
(:class:`SharedPrefixLayer`, made from a prefilled cache by :func:`share_prompt_cache`) and read once per prompt at
each step (:func:`prefix_attention`, reached through the text attention ``packed_sdpa``), instead of n copies that a
dynamic cache concatenates at every step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
from transformers.cache_utils import DynamicLayer, LinearAttentionLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

# the name of a causal LM's cache, as a forward's keyword and its output's field: later transformers 5 releases
# renamed ``past_key_values`` to ``cache``; the old name still works there but warns on every call (a FutureWarning
# and a log line), so the cache goes by the name it has
CACHE = "cache" if "cache" in {f.name for f in dataclasses.fields(CausalLMOutputWithPast)} else "past_key_values"


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
    :class:`SharedPrefixLayer` (the model's text attention must be ``packed_sdpa``:
    ``attention_functions.use_packed_attention`` says whether it is; any other attention would read the samples' own
    keys only).

    Declined for a cache that holds a recurrent layer (the model's config names linear-attention layers, e.g.
    Qwen3.5's Gated DeltaNet, whose cache layers hold a convolution window and a recurrent state, not keys and values
    per position): the cache is expanded to one copy per sample instead (:func:`repeat_cache`), which is exact (the
    prompt is still prefilled once)."""
    if any(not isinstance(x, DynamicLayer) for x in cache.layers):
        return repeat_cache(cache, n)
    cache.layers = [SharedPrefixLayer(x.keys, x.values, prompt_mask, n, room) for x in cache.layers]
    return cache


def repeat_cache(cache: Any, n: int) -> Any:
    """A prefilled cache of one row per prompt made the cache of its ``n`` samples (each row repeated ``n`` times,
    in place): ``Cache.batch_repeat_interleave``, which transformers (5.24) leaves undefined for linear-attention
    layers (their convolution and recurrent states are repeated here)."""
    for layer in cache.layers:
        if isinstance(layer, DynamicLayer):
            layer.batch_repeat_interleave(n)
            continue
        for states in (layer.conv_states, layer.recurrent_states):
            for i, state in states.items():
                if state is not None:
                    states[i] = state.repeat_interleave(n, dim=0)
    return cache


class CarriedStateLayer(LinearAttentionLayer):
    """A linear-attention layer's cache (a convolution window and a recurrent state per row) that a training forward
    continues from, with gradients: each update assigns the new state instead of copying it into the old one in
    place (transformers' :class:`LinearAttentionLayer` copies, for a static address; the gated delta rule saved the
    old state for its backward, so the copy would fail the backward), and it reports that it records the past, so
    the layer takes its multi-token convolution path (which reads the state, never writes it in place) for a
    continuation of one token too."""

    def __init__(self, conv: torch.Tensor, recurrent: torch.Tensor | None, kernel: int):
        super().__init__()
        self.conv_states[0], self.recurrent_states[0] = conv, recurrent
        self.conv_kernel_size[0] = kernel
        self.is_conv_states_initialized[0] = self.has_previous_state[0] = True
        self.is_recurrent_states_initialized[0] = recurrent is not None
        self.dtype, self.device = conv.dtype, conv.device
        self.record_past = True

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, **kwargs: Any) -> torch.Tensor:
        full = torch.cat([self.conv_states[state_idx], conv_states], dim=-1)
        self.conv_states[state_idx] = full[..., -self.conv_kernel_size[state_idx] :]
        return full

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs: Any) -> torch.Tensor:
        self.recurrent_states[state_idx] = recurrent_states
        return recurrent_states


def carry_cache(cache: Any, index: torch.Tensor) -> Any:
    """A prompt forward's ``cache`` (one row per prompt) made, in place, the cache that the continuations of samples
    ``index`` (each sample's prompt row) start from, gradients through it to the prompt forward: attention layers'
    keys and values selected per sample (``DynamicLayer``), linear-attention layers' states selected per sample into
    :class:`CarriedStateLayer`. A cache layer of another kind: ValueError naming it."""
    layers = []
    for layer in cache.layers:
        if type(layer) is DynamicLayer:
            layer.keys, layer.values = layer.keys.index_select(0, index), layer.values.index_select(0, index)
            layers.append(layer)
        elif type(layer) is LinearAttentionLayer and layer.number_of_states == 1 and layer.has_previous_state[0]:
            recurrent = layer.recurrent_states[0]
            layers.append(
                CarriedStateLayer(
                    layer.conv_states[0].index_select(0, index),
                    recurrent.index_select(0, index) if recurrent is not None else None,
                    layer.conv_kernel_size[0],
                )
            )
        else:
            raise ValueError(
                f"the group-shared forward cannot carry a prompt's cache layer of kind {type(layer).__name__} into its "
                "samples; set train.shared_prompt_forward=false"
            )
    cache.layers = layers
    return cache


def prefix_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    prefix_keys: torch.Tensor,
    prefix_values: torch.Tensor,
    prompt_mask: torch.Tensor | None,
    scale: float,
    matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.matmul,
) -> tuple[torch.Tensor, None]:
    """Attention of ``query`` ``[prompts * n, heads, q, dim]`` (n samples per prompt, in prompt order) over its
    prompt's ``prefix_keys`` / ``prefix_values`` ``[prompts, kv_heads, P, dim]`` (shared: one matrix product per
    prompt and KV head for all its samples' queries; ``prompt_mask`` ``[prompts, P]`` its real positions, None: all)
    followed by its own ``key`` / ``value`` ``[prompts * n, kv_heads, t, dim]`` (the last ``q`` of them the queries'
    own, causal): one softmax over both, in float32 (a bf16 model's queries and keys are cast), the output in the
    query's dtype. The same keys and weights as SDPA over every sample's copy of its prompt followed by its own keys.
    Decoding reads a :class:`SharedPrefixLayer`'s prompt (``q`` new tokens); the packed training forward a block's
    responses (``q == t``, the whole response). ``matmul``: what computes the two products over the prompt (one per
    prompt and KV head for all its samples' queries, large in training; the attention module's ``prompt_matmul``
    where the strategy set one); the samples' own, a small product each, stay batched ``torch.matmul``. Returns
    ``[B, q, heads, dim]``."""
    pk, pv = prefix_keys, prefix_values
    n = query.shape[0] // pk.shape[0]
    prompts, kv_heads, plen, _ = pk.shape
    batch, heads, q, dim = query.shape
    g, t = heads // kv_heads, key.shape[-2]
    qf = query.float().reshape(prompts, n, kv_heads, g * q, dim)
    # the prompt's scores: [prompts, kv_heads, n * g * q, P], all samples of a prompt in one product
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
