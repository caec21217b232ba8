"""The ``hf`` rollout engine's options (``rollout.hf``), the one place they are resolved, and its registration.

Two modules can generate: the policy module itself (:class:`~vlrft.rollout.hf_engine.HFRolloutEngine`; sharded
policies in lockstep), or an inference copy of it (:class:`~vlrft.rollout.inference_copy.InferenceCopyEngine`), and
either decodes with a dynamic or a static, compiled cache (``vlrft.rollout.static_cache``). :func:`build_hf_engine`
decides which from ``rollout.hf`` and where the policy computes, and hands each engine only its decisions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vlrft.config import ConfigError, option
from vlrft.models.packing import recurrent_layers
from vlrft.rollout.hf_engine import HFRolloutEngine
from vlrft.rollout.inference_copy import InferenceCopyEngine
from vlrft.rollout.registry import DEFAULT_ENGINE, register_engine


@dataclass
class HFEngineConfig:
    """The ``hf`` engine (``rollout.engine=hf``)."""

    inference_copy: str = option(
        "auto",
        "generate with a plain copy of the policy in the rollout dtype, refreshed from the weight stream after each "
        "update and freed during it as sleep_level says (no parameter gather per decode step, no lockstep between "
        "ranks); "
        "auto: on where the policy computes on CUDA or a strategy shards parameters, off on one CPU process (where it "
        "only costs memory)",
        choices=("auto", "on", "off"),
    )
    dtype: str = option(
        "auto",
        "the copy's dtype (auto: bfloat16 where the policy computes on CUDA, the policy's on CPU)",
        choices=("auto", "float32", "bfloat16"),
    )
    sleep_level: int = option(
        1,
        "the inference copy while the policy trains: 0 keep it on the GPU (no transfer, it holds its memory through "
        "the update), 1 move it to page-locked CPU memory and back (on a GPU; buffers made at the first sleep), 2 "
        "drop its weights (any device; the weight stream then re-sends every parameter after the update, frozen ones "
        "too)",
        choices=(0, 1, 2),
    )
    compile: str = option(
        "auto",
        "decode with a static KV cache, each decode step compiled and captured as a CUDA graph (torch.compile "
        "through transformers' generate; CUDA only, eager elsewhere: on makes CPU use the static cache too); auto: on "
        "where the policy computes on CUDA, with the inference copy",
        choices=("auto", "on", "off"),
    )

    # ``device`` below: where the policy computes (the strategy's device), not whether the machine has a GPU: a
    # policy on the CPU of a machine with CUDA gets what a CPU machine gives it (its dtype, no copy, eager decode)

    def copy_dtype(self, policy_dtype: torch.dtype, device: torch.device) -> torch.dtype:
        if self.dtype != "auto":
            return getattr(torch, self.dtype)
        return torch.bfloat16 if device.type == "cuda" else policy_dtype

    def wants_copy(self, sharded: bool, device: torch.device) -> bool:
        """Whether the engine generates with a copy (``sharded``: the strategy shards parameters)."""
        if self.inference_copy != "auto":
            return self.inference_copy == "on"
        return device.type == "cuda" or sharded

    def wants_static_cache(self, copy: bool, device: torch.device) -> bool:
        """Whether an unsharded engine decodes with a static cache (compiled on CUDA by ``generate`` itself);
        ``copy``: it generates with the inference copy (auto never compiles a wrapped training module)."""
        return self.compile == "on" or (self.compile == "auto" and device.type == "cuda" and copy)


def _static_cache_blocked(model: torch.nn.Module, routing_replay: bool) -> str | None:
    """Why the static-cache decode cannot serve ``model`` (then ``compile=auto`` decodes eagerly and ``on`` is refused
    with this reason), or None."""
    recurrent = recurrent_layers(model)
    if recurrent:  # the static cache holds keys and values only, not recurrent states
        return (
            "the static-cache decode holds keys and values only, and this model has recurrent (linear-attention) "
            f"layers {recurrent}"
        )
    if routing_replay:  # the router hooks that record the experts would not run in a captured graph
        return (
            "the compiled static-cache decode does not run the router hooks that rollout.routing_replay=true records "
            "the experts with"
        )
    return None


@register_engine(DEFAULT_ENGINE, "batched generate on the policy itself")  # a config that names no engine
def build_hf_engine(
    cfg: HFEngineConfig,
    model: torch.nn.Module,
    processor,
    *,
    micro_batch_size: int = 16,
    synced: bool = False,
    device: torch.device | None = None,
    routing_replay: bool = False,
    **_,
) -> HFRolloutEngine:
    """The hf engine on ``model`` (the policy) or on a copy of it (``cfg.inference_copy``). ``synced``: ``model``'s
    parameters are sharded over the ranks; ``device``: where the policy computes (by default its parameters'
    device), which the automatic choices follow; ``routing_replay``: each rollout carries the experts its tokens
    were routed to (``Rollout.routing``). Every switch is resolved here: a whole copy on every rank needs no
    lockstep, and a static cache decodes only what does not generate in lockstep."""
    first = next(model.parameters())
    device = device if device is not None else first.device
    copy = cfg.wants_copy(synced, device)
    lockstep = synced and not copy
    static = cfg.wants_static_cache(copy, device) and not lockstep
    why = _static_cache_blocked(model, routing_replay) if static else None
    if why:
        if cfg.compile == "on":
            raise ConfigError(f"rollout.hf.compile=on: {why}; use rollout.hf.compile=auto or off")
        static = False
    common = dict(
        micro_batch_size=micro_batch_size,
        static_cache=static,
        sleep_level=cfg.sleep_level,
        device=device,
        routing_replay=routing_replay,
    )
    if copy:
        return InferenceCopyEngine(model, processor, dtype=cfg.copy_dtype(first.dtype, device), **common)
    return HFRolloutEngine(model, processor, synced=lockstep, **common)
