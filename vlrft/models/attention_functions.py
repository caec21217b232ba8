"""The project's attention implementations in transformers: their names, the one call that registers them, and the
switches that select them on a model.

A model's layers attend through the function its config names (``_attn_implementation``), looked up in
transformers' ``AttentionInterface``. :func:`register_attention_functions` registers ours there; the switches
(:func:`use_packed_attention` for the text layers, :func:`use_varlen_vision_attention` for a vision tower) call it
before they name one of ours, so every model that names them finds them. Nothing is registered on import.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from vlrft.models.packed_attention import packed_sdpa
from vlrft.models.vision_attention import varlen_sdpa

# the attention implementation of a packed model's text layers: SDPA, computing only the pairs a packed row allows
PACKED_SDPA = "vlrft_packed_sdpa"

# transformers hands a vision tower's attention the packed sequences' bounds in one call only where the
# implementation's name contains "flash" (``is_flash_attention_requested``); every other one gets a call per sequence.
# The name says so; SDPA computes it. Only the vision attention modules' own copy of the config carries it (see
# ``use_varlen_vision_attention``): transformers also treats such a name as a flash kernel to load when a model is
# built from a config, so the model's config keeps "sdpa".
VARLEN_SDPA = "vlrft_varlen_sdpa_flash_api"


def register_attention_functions() -> None:
    """Register ``packed_sdpa`` as :data:`PACKED_SDPA` (with SDPA's own masks for generation and plain rows) and
    ``varlen_sdpa`` as :data:`VARLEN_SDPA` in transformers' attention interfaces. Idempotent: a name already
    registered is left as it is. Called by the switches below; call it before building a model from a config that
    names one of them.

    Both run eagerly inside a compiled block (``strategy.compile_blocks``) where given Python layouts that differ at
    every step: packed rows and a shared prompt cache (``packed_sdpa``'s eager part), a vision tower's sequences
    (``varlen_sdpa``, compiler-disabled whole)."""
    if PACKED_SDPA not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(PACKED_SDPA, packed_sdpa)
    if PACKED_SDPA not in ALL_MASK_ATTENTION_FUNCTIONS:
        ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_SDPA, sdpa_mask)
    if VARLEN_SDPA not in ALL_ATTENTION_FUNCTIONS:
        ALL_ATTENTION_FUNCTIONS.register(VARLEN_SDPA, torch.compiler.disable(varlen_sdpa))


def _text_config(model: torch.nn.Module) -> Any:
    """The text model's transformers config, through wrappers (a DeepSpeed engine's own ``config`` is a dict)."""
    for owner in (model, getattr(model, "module", None)):
        config = getattr(owner, "config", None)
        if hasattr(config, "get_text_config"):
            return getattr(config, "text_config", None) or config
    return None


def attention_kind(model: torch.nn.Module) -> str:
    """The attention implementation a model's text layers name (``sdpa`` when unset)."""
    return getattr(_text_config(model), "_attn_implementation", None) or "sdpa"


def use_packed_attention(model: torch.nn.Module) -> bool:
    """The text layers of an SDPA model attend through ``packed_sdpa`` from now on (SDPA unless given packed rows).
    Whether they do (False for eager or flash attention, which keep their own)."""
    register_attention_functions()
    text = _text_config(model)
    if text is not None and attention_kind(model) == "sdpa":
        text._attn_implementation = PACKED_SDPA
    return attention_kind(model) == PACKED_SDPA


def use_varlen_vision_attention(model: torch.nn.Module) -> bool:
    """A Qwen-VL model whose vision tower attends with SDPA attends through ``varlen_sdpa`` from now on: each
    vision attention module gets its own copy of the vision config naming it, the model's config (saved, or handed
    to ``from_config``) keeps SDPA, and the text layers keep theirs. The tower gets that copy too, so that it
    computes its sequences' longest length once per forward (two host syncs: whole images and windows) and hands
    it to every block, where each block's attention computed it (a sync per block, and under
    ``strategy.compile_blocks`` a graph break per block). Whether its vision attention does (False for text models,
    other implementations, and towers whose attention modules are not found)."""
    register_attention_functions()
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
