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

The block mask is a dense 4-D boolean mask, which SDPA (CPU and GPU) and eager attention take; on a GPU
a block-sparse kernel (flex attention's ``BlockMask``, or flash-attention varlen with the prompt as a
shared prefix) would skip the masked blocks instead of computing them; neither is wired here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class PackedGroups:
    """A micro-batch laid out as one packed row per unique prompt."""

    inputs: dict[str, torch.Tensor]  # model kwargs: input_ids, attention_mask (4-D), position_ids, images
    row: torch.Tensor  # [N] the packed row of each sample
    predict_at: torch.Tensor  # [N, R] position (in the row) whose output predicts response token j
    first: int  # the smallest position any sample reads: outputs before it are not needed


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


def _attention_kind(model: torch.nn.Module) -> str:
    config = getattr(model, "config", None) or getattr(getattr(model, "module", None), "config", None)
    text = getattr(config, "text_config", None) or config
    return getattr(text, "_attn_implementation", None) or getattr(config, "_attn_implementation", "sdpa")


# attention implementations that take an arbitrary 4-D mask (flash-attention 2 does not: plain rows there)
BLOCK_MASK_ATTENTION = ("sdpa", "eager")


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

    rows_ids, rows_pos, rows_seg, images = [], [], [], []
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
            predict_at[i] = torch.cat([torch.tensor([lp - 1]), offset + torch.arange(r - 1)]).clamp(
                max=offset + max(li, 1) - 1
            )
            offset += li
        rows_ids.append(torch.cat(ids))
        rows_pos.append(torch.cat(pos, dim=1))
        rows_seg.append(torch.cat(seg))

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
    with_images = [x for x in images if x]
    if with_images:
        inputs["pixel_values"] = torch.cat([x["pixel_values"] for x in with_images]).to(device)
        inputs["image_grid_thw"] = torch.cat([x["image_grid_thw"] for x in with_images]).to(device)
    first = int(predict_at.min()) if n else 0
    return PackedGroups(inputs, row_of, predict_at, first)


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
