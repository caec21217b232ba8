"""Figures of scripts/gpu_check.py: parameter counts by part, device copy bandwidth, the peak bf16 rate of
the GPU at hand, and the model FLOPs of one update (the numerator of actor MFU)."""

from __future__ import annotations

import time

import torch
from transformers import AutoModelForImageTextToText

# dense bf16 peak of the SXM parts (TFLOP/s); PCIe cards are not listed (their peak is lower)
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "B200": 2250.0}


def param_counts(config) -> dict[str, int]:
    """Parameters by part, counted on the meta device (no memory)."""
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    parts = {"decoder": 0, "embed": 0, "lm_head": 0, "vision": 0, "other": 0}
    seen = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        if ".layers." in name:
            parts["decoder"] += p.numel()
        elif "embed_tokens" in name:
            parts["embed"] += p.numel()
        elif "lm_head" in name:
            parts["lm_head"] += p.numel()
        elif "visual" in name:
            parts["vision"] += p.numel()
        else:
            parts["other"] += p.numel()
    parts["tied"] = int(bool(config.get_text_config().tie_word_embeddings))
    parts["total"] = sum(v for k, v in parts.items() if k != "tied")
    return parts


def copy_bandwidth(gib: float = 4.0, iters: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read and written."""
    if not torch.cuda.is_available():
        return float("nan")
    n = int(gib * 2**30) // 2
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        b.copy_(a)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    del a, b
    torch.cuda.empty_cache()
    return 2 * n * 2 * iters / dt


def peak_tflops(override: float) -> float:
    if override:
        return override
    if not torch.cuda.is_available():
        return float("nan")
    name = torch.cuda.get_device_name()
    for key, value in PEAK_BF16_TFLOPS.items():
        if key in name and "PCIe" not in name:
            return value
    return float("nan")


def update_flops(config, counts: dict, upd: dict) -> dict[str, float]:
    """Model FLOPs of one update (forward + backward, no recompute): 6 x params x tokens for the decoder,
    the vision tower (per patch) and the LM head (per logit row computed), plus causal attention."""
    text, vision = config.get_text_config(), config.vision_config
    heads_dim = text.num_attention_heads * (text.hidden_size // text.num_attention_heads)
    dense = 6 * counts["decoder"] * upd["seq_tokens"]
    attn = 6 * text.num_hidden_layers * heads_dim * sum(L * L for L in upd["seq_lengths"])  # causal: half of 12
    head_params = counts["lm_head"] or counts["embed"]
    head = 6 * head_params * upd["logit_rows"]
    vis_dense = 6 * (counts["vision"]) * upd["image_patches"]
    # vision attention: full blocks over every image's patches, windowed blocks over windows
    vh, depth = vision.hidden_size, vision.depth
    full_blocks = len(getattr(vision, "fullatt_block_indexes", []) or [])
    win = (getattr(vision, "window_size", 112) // vision.patch_size) ** 2
    vis_attn = 0
    for t, h, w in upd["image_grids"]:
        p = t * h * w
        vis_attn += 12 * vh * (full_blocks * p * p + (depth - full_blocks) * p * min(p, win))
    return {
        "decoder": dense,
        "attention": attn,
        "lm_head": head,
        "vision": vis_dense + vis_attn,
        "total": dense + attn + head + vis_dense + vis_attn,
    }
