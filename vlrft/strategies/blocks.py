"""The transformer blocks of a Qwen(-VL) model, and their forwards rewritten in place for ``strategy.compile_blocks``
(torch.compile per block) and ``strategy.gradient_checkpointing`` (checkpointed inside the forward)."""

from __future__ import annotations

import functools
import inspect
import types
from typing import Any

import torch
import torch.utils.checkpoint

# the transformer blocks of a Qwen(-VL) model, by class name: what FSDP2 shards one by one, what
# ``strategy.compile_blocks`` compiles and ``strategy.gradient_checkpointing`` checkpoints
BLOCK_CLASS_SUFFIXES = ("DecoderLayer", "VisionBlock")


def transformer_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of ``model`` (decoder layers and vision blocks), in module order."""
    return [m for m in model.modules() if type(m).__name__.endswith(BLOCK_CLASS_SUFFIXES)]


def own_block_forwards(model: torch.nn.Module, compile: bool, checkpoint: bool) -> int:
    """Each transformer block's forward replaced, in place, by :func:`_block_forward`: the block's own forward
    (transformers' checkpointing wrapper removed: :func:`_own_forward`), compiled with torch.compile (inductor)
    where ``compile`` (``strategy.compile_blocks``), and checkpointed inside the forward where ``checkpoint``
    (``strategy.gradient_checkpointing``, enabled through transformers first, whose own checkpointing of the block
    is then off). The module, its parameters' names and the hooks FSDP2 or DeepSpeed put on it stay as they are and
    run around it. Returns the number of blocks.

    Checkpointing inside the forward, whatever the transformers release: transformers < 5.2x checkpoints a block
    around its ``__call__``, so the backward's recompute runs FSDP2's pre-forward hook again, which on torch < 2.13
    returns the inputs uncast in that state. The recompute then saw the vision tower's float32 rotary tables where
    the forward had FSDP2's bf16 casts: silently other activations in eager blocks, a CheckpointError in compiled
    ones (the third H200 run: torch 2.11, transformers 5.17). Transformers >= 5.2x checkpoints inside the forward,
    as here.

    Compiled blocks: a decoder layer called with a KV cache (decoding) runs its eager forward (a cache is a Python
    object that changes at every token); the attention functions vlrft registers run their packed-layout parts
    eagerly (``torch.compiler.disable``: Python data, different at every step). One compiled function per block
    class, with dynamic shapes, which takes the block as an argument (dynamo reads its parameters as inputs), so all
    blocks of a class share its graphs and a copied model calls its own blocks; the checkpoint goes around the
    compiled forward (inside a compiled function dynamo would trace it as one graph, which the eager attention
    breaks, and then run the whole block eagerly: measured, no graph compiled at all), and the recompute runs it
    compiled."""
    blocks = transformer_blocks(model)
    for block in blocks:
        block.vlrft_compiled = compile
        block.vlrft_checkpoint = None
        if checkpoint:  # what transformers' enabling set (use_reentrant=False here), else the same
            fallback = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
            block.vlrft_checkpoint = getattr(block, "_gradient_checkpointing_func", fallback)
            block.gradient_checkpointing = False  # transformers' own, around __call__ (< 5.2x) or in forward
        block.forward = types.MethodType(_block_forward, block)
    return len(blocks)


# per block class: its own forward (transformers' checkpointing wrapper removed) and, once asked for, compiled
_OWN_FORWARDS: dict[type, list[Any]] = {}


def _block_forward(block: torch.nn.Module, *args, **kwargs):
    """A block's forward as :func:`own_block_forwards` sets it (compiled, checkpointed, or both)."""
    own = _OWN_FORWARDS.get(type(block))  # FSDP2's subclass of the block's class (``fully_shard``) has its own
    if own is None:
        own = _OWN_FORWARDS[type(block)] = [_own_forward(type(block).forward), None]
    if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
        return own[0](block, *args, **kwargs)  # decoding: eager, not checkpointed (a replay would write the cache)
    if block.vlrft_compiled:
        if own[1] is None:
            own[1] = torch.compile(own[0], dynamic=True)
        call = own[1]
    else:
        call = own[0]
    if block.vlrft_checkpoint is not None and block.training and torch.is_grad_enabled():
        return block.vlrft_checkpoint(functools.partial(call, block, **kwargs), *args)
    return call(block, *args, **kwargs)


def _own_forward(forward: Any) -> Any:
    """A block class's forward without transformers' activation checkpointing wrapper (``forward_with_checkpointing``,
    which transformers >= 5.2x puts around every layer class's forward, once per subclass such as FSDP2's; earlier
    releases checkpoint in ``__call__`` instead, which ``block.gradient_checkpointing = False`` turns off). Other
    wrappers (decorators) stay."""
    return inspect.unwrap(
        forward, stop=lambda f: getattr(f, "__code__", None) is None or f.__code__.co_name != _HF_CKPT
    )


_HF_CKPT = "forward_with_checkpointing"  # transformers.modeling_layers.GradientCheckpointingLayer's wrapper
