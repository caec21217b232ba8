"""What training asks of a model before a strategy places and wraps it: training mode, LoRA (peft), the frozen vision
tower, gradient checkpointing and compiled blocks (``strategy.*``); and what any model computing on the strategy's
device takes, trained or not: the kernels of its CPU products (``strategy.cpu_matmul``)."""

from __future__ import annotations

import torch

from vlrft.models.cpu_matmul import use_onednn_linears
from vlrft.strategies.blocks import own_block_forwards
from vlrft.strategies.config import StrategyConfig


def adapt_for_training(model: torch.nn.Module, cfg: StrategyConfig) -> torch.nn.Module:
    """Training mode, LoRA, freezing and gradient checkpointing, before any wrapping; returns the model (peft's
    wrapper with LoRA).

    ``from_pretrained`` returns a model in eval mode, and transformers recomputes activations only
    in training mode: without ``train()`` gradient checkpointing was silently off (seen on a GPU
    as the memory of a run with it on)."""
    model.train()
    if cfg.lora_rank > 0:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(
                r=cfg.lora_rank,
                lora_alpha=cfg.lora_alpha,
                target_modules=[m.strip() for m in cfg.lora_target_modules.split(",") if m.strip()],
                lora_dropout=0.0,
            ),
        )
    if cfg.freeze_vision_tower:  # after LoRA: peft also puts trainable adapters on the tower's MLPs
        for name, p in model.named_parameters():
            if ".visual." in f".{name}" or name.startswith("visual") or "vision_tower" in name:
                p.requires_grad_(False)
    if cfg.gradient_checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if hasattr(model, "enable_input_require_grads"):
            model.enable_input_require_grads()
        if hasattr(model, "config"):
            model.config.use_cache = False
    if cfg.compile_blocks or cfg.gradient_checkpointing:
        own_block_forwards(model, cfg.compile_blocks, cfg.gradient_checkpointing)
    return model


def adapt_for_device(model: torch.nn.Module, cfg: StrategyConfig, device: str | torch.device) -> torch.nn.Module:
    """``model`` made to compute on ``device`` as the strategy ``cfg`` computes its models there (the policy, a
    reference or reward model, ``vlrft eval``'s): on a CPU, its float32 products by oneDNN where ``cfg.cpu_matmul``
    says so (``vlrft.models.cpu_matmul``, the one place that path lives). Returns the model, changed in place."""
    if torch.device(device).type == "cpu" and cfg.onednn:
        use_onednn_linears(model)
    return model
