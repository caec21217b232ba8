"""Mixture-of-experts policies (Qwen3.5-MoE, Qwen3-VL-MoE): where their routers are, one hook point on them, the
router's load-balancing loss and the expert-load metrics of the policy update (issue 60).

The sparse MoE block of both architectures (transformers' ``Qwen3_5MoeSparseMoeBlock``,
``Qwen3VLMoeTextSparseMoeBlock``) holds a router ``gate`` and its ``experts``. The block flattens its input
``[B, S, H]`` row-major to ``[B * S, H]``; the router maps it to ``(router_logits [B*S, E], weights [B*S, k],
experts [B*S, k])``: softmax over the logits in float32, the k most probable experts, their probabilities
renormalised to sum to 1; the experts add up their outputs with these weights (Qwen3.5-MoE adds a gated shared
expert). There is no capacity factor: every token reaches its k experts and none is dropped or overflows, so no
dropped-token metric exists to log.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from vlrft.config import ConfigError
from vlrft.models.attention_functions import _text_config


def moe_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The sparse MoE blocks of ``model`` (a module with a router ``gate`` and ``experts``), in layer order."""
    return [
        m for m in model.modules() if isinstance(getattr(m, "gate", None), torch.nn.Module) and hasattr(m, "experts")
    ]


def is_moe(model: torch.nn.Module) -> bool:
    """The model's text config names experts (``num_experts`` > 0)."""
    return (getattr(_text_config(model), "num_experts", None) or 0) > 0


def arch_name(model: torch.nn.Module) -> str:
    """The model's ``model_type`` (through a DeepSpeed engine), else its class name: what a one-line error names."""
    owner = getattr(model, "module", model)
    return getattr(getattr(owner, "config", None), "model_type", None) or type(owner).__name__


def router_aux_coef(model: torch.nn.Module, configured: float | None) -> float:
    """The weight of the router's load-balancing loss in the policy update: ``algorithm.router_aux_coef`` when set,
    else the model config's ``router_aux_loss_coef`` (0 for a dense model). Set > 0 on a dense model: ConfigError."""
    if not is_moe(model):
        if configured:
            raise ConfigError(
                f"algorithm.router_aux_coef={configured}: the policy ({arch_name(model)}) is not a mixture-of-experts "
                "model, it has no router to balance; leave it unset or 0"
            )
        return 0.0
    return float(getattr(_text_config(model), "router_aux_loss_coef", 0.0) if configured is None else configured)


@dataclass
class RouterCall:
    """One call of one MoE layer's router: the block's ``shape`` (rows, positions) and, per token of the block's
    flattened input (row-major), the router's logits ``[rows * positions, E]`` (None where not kept) and the experts
    it routed the token to ``[rows * positions, k]``."""

    layer: int  # the block's index among :func:`moe_blocks`
    shape: tuple[int, int]
    logits: torch.Tensor | None
    experts: torch.Tensor


RouterHook = Callable[[int, tuple[int, int], tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...] | None]


@contextmanager
def on_routing(model: torch.nn.Module, hook: RouterHook) -> Iterator[None]:
    """Within the block, ``hook(layer, shape, output)`` runs after every call of every MoE layer's router (``shape``:
    the block's input rows and positions; ``output``: the router's ``(logits, weights, experts)``); what it returns
    (not None) replaces the router's output. Hooks entered earlier run first and later ones see their output."""
    handles = []
    for layer, block in enumerate(moe_blocks(model)):
        shape: list[tuple[int, int]] = []

        def remember(_module: Any, args: tuple, kwargs: dict, shape: list = shape) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            shape[:] = [tuple(hidden.shape[:2])]

        def after(_module: Any, _args: tuple, output: tuple, layer: int = layer, shape: list = shape):
            return hook(layer, shape[0], output)

        handles.append(block.register_forward_pre_hook(remember, with_kwargs=True))
        handles.append(block.gate.register_forward_hook(after))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextmanager
def capture_routing(model: torch.nn.Module, *, logits: bool = True) -> Iterator[list[RouterCall]]:
    """The router calls of the forwards run within the block, in call order (``logits``: keep the router logits,
    with their autograd graph, for :func:`load_balancing_loss`; else only the experts, as int16: a rollout's routing
    is kept for every token it generates)."""
    calls: list[RouterCall] = []

    def keep(layer: int, shape: tuple[int, int], output: tuple[torch.Tensor, ...]) -> None:
        experts = output[2].detach()
        calls.append(
            RouterCall(layer, shape, output[0], experts) if logits else RouterCall(layer, shape, None, experts.short())
        )

    with on_routing(model, keep):
        yield calls


def load_balancing_loss(
    router_logits: Sequence[torch.Tensor],
    experts: Sequence[torch.Tensor],
    num_experts: int,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """The Switch Transformer's auxiliary load-balancing loss (Fedus et al. 2021, arXiv 2101.03961, eq. 4-6) with
    top-k routing, pooled over layers as transformers' ``load_balancing_loss_func`` pools it:

        loss = E * sum_i f_i * P_i,
        f_i = (1 / (L T)) sum_l sum_t 1[i in experts_l(t)]   (routed token slots of expert i, sums to k),
        P_i = (1 / (L T)) sum_l sum_t softmax(router_logits_l(t))_i   (mean router probability of expert i),

    over the L layers' ``router_logits`` ``[T, E]`` and the ``experts`` ``[T, k]`` each routed every token to, the
    T tokens where ``mask`` ``[T]`` is 1 (all when None). Perfect balance gives k (f_i = k / E, P_i = 1 / E); the
    gradient reaches the routers through P alone (f counts). No token: 0."""
    weight = None if mask is None else mask.reshape(-1).float()
    f = torch.zeros(num_experts, device=router_logits[0].device)
    p = torch.zeros(num_experts, device=router_logits[0].device)
    rows = 0.0
    for logits, chosen in zip(router_logits, experts, strict=True):
        probs = torch.softmax(logits.float(), dim=-1)
        w = torch.ones(probs.shape[0], device=probs.device) if weight is None else weight.to(probs.device)
        slots = w[:, None].expand(chosen.shape).reshape(-1)
        f = f + torch.zeros_like(f).index_add_(0, chosen.reshape(-1).long(), slots)
        p = p + (probs * w[:, None]).sum(0)
        rows = rows + w.sum()
    rows = torch.as_tensor(rows).clamp(min=1.0)
    return num_experts * (f / rows * (p / rows)).sum()


def expert_load(experts: torch.Tensor, num_experts: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Each expert's share ``[E]`` of the routed token slots of one layer: ``experts`` ``[T, k]`` the experts each
    token went to, counted where ``mask`` ``[T]`` is 1; the shares sum to 1 (all 0 when no token is counted)."""
    w = torch.ones(experts.shape[0]) if mask is None else mask.reshape(-1).float().cpu()
    counts = torch.zeros(num_experts, dtype=torch.float64)
    counts.index_add_(0, experts.reshape(-1).long().cpu(), w[:, None].expand(experts.shape).reshape(-1).double())
    return counts / counts.sum().clamp(min=1.0)


def expert_load_entropy(load: torch.Tensor) -> torch.Tensor:
    """The mean over layers of the entropy of each layer's expert load ``load`` ``[L, E]`` (:func:`expert_load`),
    normalised by log E: H_l = -sum_i s_li log s_li / log E (0 log 0 = 0), 1 = every expert got an equal share,
    0 = one expert got all (the load-balance measure of Switch Transformer's analysis, Fedus et al. 2021)."""
    terms = torch.where(load > 0, load * load.clamp(min=1e-300).log(), torch.zeros_like(load))
    return (-terms.sum(-1) / math.log(load.shape[-1])).mean()


def max_expert_share(load: torch.Tensor) -> torch.Tensor:
    """The mean over layers of the largest share any one expert got, ``load`` ``[L, E]`` (1 / E when balanced)."""
    return load.max(-1).values.mean()
