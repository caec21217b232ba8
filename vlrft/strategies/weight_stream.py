"""The weight stream: a trained model's full parameters, one ``(Hugging Face name, tensor)`` at a time, LoRA merged in.

What a rollout engine with its own copy of the weights loads after each update (``strategy.full_params()``). The
strategy says how its parameters are gathered (its ``_gathered_groups`` and ``_full_tensor``); this module says what
is sent, under which name, and how a LoRA adapter is merged into its base weight (peft's formula).
"""

from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch


def stream_full_params(
    model: torch.nn.Module,
    gathered_groups: Callable[..., Iterator[list[tuple[str, torch.nn.Parameter]]]],
    full_tensor: Callable[[torch.nn.Parameter], torch.Tensor],
    *,
    trainable_only: bool,
    dtype: torch.dtype | None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """``model``'s full parameters under their Hugging Face names, as ``Strategy.full_params`` describes, gathered
    by the strategy's ``gathered_groups(model, sent, dtype)`` (groups of ``(name, parameter)``, the same order on
    every rank) and ``full_tensor`` (one parameter made whole). LoRA is merged into its base weights, the adapters
    are not sent; ``trainable_only`` skips frozen parameters but not LoRA-wrapped base weights; ``dtype`` is what
    the caller casts to (a gather may cast to it; not with LoRA, merged in float32)."""
    lora_layers = {name: m for name, m in model.named_modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")}

    def owner(name: str) -> str:
        return name.rpartition(".")[0].removesuffix(".base_layer")

    def sent(name: str, param: torch.nn.Parameter) -> bool:
        if ".lora_" in name:
            return False
        return not (trainable_only and not param.requires_grad and owner(name) not in lora_layers)

    # a merged LoRA weight is summed in float32, then rounded once by the caller (a casting gather rounds first)
    for group in gathered_groups(model, sent, None if lora_layers else dtype):
        for name, param in group:
            tensor, layer = full_tensor(param), lora_layers.get(owner(name))
            if layer is not None and name.endswith(".base_layer.weight"):
                tensor = tensor + lora_delta(layer, full_tensor).to(tensor.dtype)
            yield hf_name(name), tensor


def lora_delta(layer: torch.nn.Module, full_tensor: Callable[[torch.nn.Parameter], torch.Tensor]) -> torch.Tensor:
    """peft's merge of a Linear LoRA layer: the sum over active adapters of ``scaling * B @ A`` (each adapter weight
    made whole by ``full_tensor``)."""
    delta = None
    for adapter in layer.active_adapters:
        if adapter not in layer.lora_A:
            continue
        a = full_tensor(layer.lora_A[adapter].weight).float()
        b = full_tensor(layer.lora_B[adapter].weight).float()
        term = (b @ a) * layer.scaling[adapter]
        delta = term if delta is None else delta + term
    return delta if delta is not None else torch.zeros(())


def params_by_unit(
    model: torch.nn.Module, sent: Callable[[str, torch.nn.Parameter], bool], units: Iterable[str]
) -> dict[str, list[tuple[str, torch.nn.Parameter]]]:
    """``model``'s parameters that ``sent`` keeps, ``(name, parameter)`` in module order, by the innermost of ``units``
    (module names, which must include ``""``, the model) that holds each: what a sharded strategy gathers together."""
    units = set(units)
    groups: dict[str, list[tuple[str, torch.nn.Parameter]]] = {}
    for name, param in model.named_parameters():
        if sent(name, param):
            unit = name
            while unit not in units:
                unit = unit.rpartition(".")[0]
            groups.setdefault(unit, []).append((name, param))
    return groups


def hf_name(name: str) -> str:
    """A parameter name as the model's own ``state_dict`` (and vLLM) knows it: without peft's wrapping."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")
