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

Attention over the packed rows: ``vlrft.models.packed_attention`` (the layout built here, :func:`_packed_layout`,
tells it which pairs to compute); the text layers are switched to it the first time a model is packed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import torch

from data_pipelines.collate import MODALITIES, MODEL_INPUT_KEYS
from vlrft.models.attention_functions import PACKED_SDPA, _text_config, attention_kind, use_packed_attention
from vlrft.models.packed_attention import PackedBlock, PackedLayout, PackedRow
from vlrft.models.prefix_decoding import CACHE, carry_cache


@dataclass
class PackedGroups:
    """A micro-batch laid out as one packed row per unique prompt."""

    inputs: dict[str, torch.Tensor]  # model kwargs: input_ids, attention_mask (4-D), position_ids, images
    row: torch.Tensor  # [N] the packed row of each sample
    predict_at: torch.Tensor  # [N, R] position (in the row) whose output predicts response token j
    first: int  # the smallest position any sample reads: outputs before it are not needed


def sample_images(batch: dict[str, torch.Tensor], idx: list[int]) -> dict[str, torch.Tensor]:
    """The images and videos of samples ``idx`` of a collated batch (each modality's pixels, grid rows, per-item
    values and per-sample counts, stored per sample in sample order); a modality none of them has is left out."""
    out: dict[str, torch.Tensor] = {}
    for m in MODALITIES:
        if m.pixels not in batch:
            continue
        grid, per_sample = batch[m.grid], batch[m.per_sample].tolist()
        item_start = [0, *itertools.accumulate(per_sample)]
        patch_start = [0, *itertools.accumulate(grid.prod(-1).tolist())]
        items = [k for i in idx for k in range(item_start[i], item_start[i + 1])]
        if not items:
            continue
        out[m.pixels] = torch.cat([batch[m.pixels][patch_start[k] : patch_start[k + 1]] for k in items])
        out[m.grid] = grid[items]
        out.update({key: batch[key][items] for key in m.per_item if key in batch})
        out[m.per_sample] = batch[m.per_sample][idx]
    return out


def _rope_owner(model: torch.nn.Module) -> Any:
    """The submodule with Qwen-VL's ``get_rope_index`` (through DeepSpeed/peft wrappers), or None (text Qwen)."""
    for module in model.modules():
        if hasattr(module, "get_rope_index"):
            return module
    return None


# attention implementations that take an arbitrary 4-D mask (flash-attention 2 does not: plain rows there)
BLOCK_MASK_ATTENTION = ("sdpa", "eager", PACKED_SDPA)


# text layer types (a config's ``layer_types``) that carry a recurrent state along the sequence instead of attending
# over keys and values (Qwen3.5's Gated DeltaNet; transformers' convolution and state-space hybrids)
RECURRENT_LAYER_TYPES = frozenset({"linear_attention", "conv", "mamba", "hybrid", "hybrid_sliding"})


def recurrent_layers(model: torch.nn.Module) -> list[int]:
    """The indices of the text layers that the model's config names recurrent (:data:`RECURRENT_LAYER_TYPES`)."""
    types = getattr(_text_config(model), "layer_types", None) or ()
    return [i for i, t in enumerate(types) if t in RECURRENT_LAYER_TYPES]


def shared_forward_kind(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> str | None:
    """How the group-shared forward computes ``batch``: ``"packed"`` (one row ``[prompt | r_1 | r_2 | ...]`` per
    prompt under a block mask: :func:`shared_prompt_logits`), ``"cached"`` (a model with recurrent layers,
    :func:`recurrent_layers`, whose state a packed row would carry from r_1 into r_2, which no mask stops: each
    prompt's forward once, its cache carried into each of its samples' continuation: :func:`cached_prompt_logits`),
    or None (the plain rows).

    None where the batch does not say which samples share a prompt; where a response holds images of its own (images
    that tools returned inside a response would need their own m-rope positions and vision features, which neither
    lays out; multi-turn responses with text observations are computed as any response is); where the batch carries
    the rollout's experts (``batch["routing"]``, rollout routing replay: they are replayed in the plain rows'
    layout); "packed" where the model's attention takes no block mask (flash-attention 2); "cached" where the blocks
    are checkpointed (``strategy.gradient_checkpointing``) in a forward with gradients (a block called with a cache is
    not checkpointed, ``vlrft.strategies.blocks``: the memory the user asked to save would be spent)."""
    if "prompt_index" not in batch or "routing" in batch:
        return None
    if "response_images" in batch and bool(batch["response_images"].any()):
        return None
    if recurrent_layers(model):
        checkpointed = any(getattr(m, "vlrft_checkpoint", None) is not None for m in model.modules())
        return None if checkpointed and model.training and torch.is_grad_enabled() else "cached"
    return "packed" if attention_kind(model) in BLOCK_MASK_ATTENTION else None


def shared_forward_applies(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> bool:
    """Whether the group-shared forward computes ``batch`` (:func:`shared_forward_kind`, either way)."""
    return shared_forward_kind(model, batch) is not None


def _prompt_positions(owner: Any, ids: torch.Tensor, types: torch.Tensor | None, media: dict[str, torch.Tensor]):
    """The prompt's m-rope positions ``[3, L]`` (1-D text positions repeated where it has no image nor video);
    ``media``: its images and videos (:func:`sample_images`)."""
    keys = {key for m in MODALITIES for key in (m.grid, *m.per_item)}  # what get_rope_index reads of them
    grids = {k: v for k, v in media.items() if k in keys}
    if owner is None or not grids or types is None:
        return torch.arange(ids.numel()).expand(3, -1)
    pos, _ = owner.get_rope_index(ids[None], mm_token_type_ids=types[None], **grids)
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
        ppos = _prompt_positions(owner if vl else None, ids[0], types, img)
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
    if attention_kind(model) == "eager":
        dtype = next(model.parameters()).dtype
        mask = torch.zeros(mask.shape, dtype=dtype).masked_fill(~mask, torch.finfo(dtype).min)
    inputs = {
        "input_ids": input_ids.to(device),
        "attention_mask": mask.to(device),
        "position_ids": (position_ids if vl else position_ids[0]).to(device),
    }
    if use_packed_attention(model):  # SDPA models; eager attention reads the dense mask above
        inputs["vlrft_packed"] = _packed_layout(spans, row_width, device)
    for m in MODALITIES:
        for key in (m.pixels, m.grid, *m.per_item):
            have = [x[key] for x in images if key in x]
            if have:
                inputs[key] = torch.cat(have).to(device)
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
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    width: int,
    device: torch.device,
    token_masks: list | None = None,
) -> torch.Tensor:
    """The logits ``[N, R, V]`` that predict each sample's response tokens, from one packed row per prompt
    (only the logits from the first response-predicting position on are computed). ``token_masks``: as in
    ``experience.response_logits``, the packed rows' response positions (their ``response_mask``)."""
    packed = pack_groups(model, batch, width, device)
    if token_masks is not None:
        rows = packed.inputs["input_ids"].shape
        mask = torch.zeros(rows)
        lengths = batch["response_lengths"].tolist()
        offsets: dict[int, int] = {}  # the next response's start in each row
        sampled = batch["response_mask"].float()
        for i, b in enumerate(packed.row.tolist()):
            start = offsets.get(b, int(batch["prompt_lengths"][i]))
            mask[b, start : start + lengths[i]] = sampled[i, : lengths[i]]
            offsets[b] = start + lengths[i]
        token_masks.append(mask)
    keep = packed.inputs["input_ids"].shape[1] - packed.first
    out = model(**packed.inputs, logits_to_keep=keep, use_cache=False)
    row, at = packed.row.to(device), (packed.predict_at - packed.first).to(device)
    return out.logits[row[:, None], at]


def cached_prompt_logits(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    width: int,
    device: torch.device,
    token_masks: list | None = None,
) -> torch.Tensor:
    """The logits ``[N, R, V]`` that predict each sample's response tokens, for a model with recurrent layers: the
    micro-batch's prompts in one forward (left-padded, their images with them; a left-padded linear-attention row is
    exact: its padding enters as zeros, so its state stays zero until the first real token), whose cache (the
    attention layers' keys and values, the linear-attention layers' convolution window and recurrent state) is
    carried to each sample (``prefix_decoding.carry_cache``, gradients through it) and continued by one forward of
    the right-padded responses at the positions they have after their prompt. Two forwards, each prompt computed
    once; the prompt's last position predicts token 0, response token j - 1 predicts token j."""
    prompt_index = batch["prompt_index"].tolist()
    prompt_len = batch["prompt_lengths"].tolist()
    resp_len = batch["response_lengths"].tolist()
    owner = _rope_owner(model)
    firsts: dict[int, int] = {}
    for i, p in enumerate(prompt_index):
        firsts.setdefault(p, i)
    rows = list(firsts.values())  # the first sample of each prompt: its prompt's row
    row_list = [rows.index(firsts[p]) for p in prompt_index]  # each sample's prompt row
    row_of = torch.tensor(row_list, device=device)
    longest = max(prompt_len[s] for s in rows)
    ids = torch.zeros((len(rows), longest), dtype=torch.long)
    types = torch.zeros_like(ids)
    mask = torch.zeros_like(ids)
    positions = torch.zeros((3, len(rows), longest), dtype=torch.long)
    images = sample_images(batch, rows)
    starts = []
    for b, s0 in enumerate(rows):
        lp = prompt_len[s0]
        ids[b, longest - lp :] = batch["input_ids"][s0, :lp]
        mask[b, longest - lp :] = 1
        row_types = batch["mm_token_type_ids"][s0, :lp] if "mm_token_type_ids" in batch else None
        if row_types is not None:
            types[b, longest - lp :] = row_types
        ppos = _prompt_positions(owner, ids[b, longest - lp :], row_types, sample_images(batch, [s0]))
        positions[:, b, longest - lp :] = ppos
        starts.append(int(ppos.max()) + 1 if lp else 0)
    vl = owner is not None
    prompt = {
        "input_ids": ids.to(device),
        "attention_mask": mask.to(device),
        "position_ids": (positions if vl else positions[0]).to(device),
        **{k: v.to(device) for k, v in images.items() if k in MODEL_INPUT_KEYS},
    }
    if "mm_token_type_ids" in batch:
        prompt["mm_token_type_ids"] = types.to(device)
    out = model(**prompt, use_cache=True, logits_to_keep=1)
    first = out.logits[:, -1][row_of]  # [N, V]: the prompt's last position predicts response token 0
    if token_masks is not None:
        token_masks.append(torch.zeros(ids.shape))  # no response token in the prompts' forward
    # response tokens 0 .. width - 2 predict tokens 1 .. width - 1; the last one too where the router's loss is taken
    # over every response token (token_masks), its logits dropped
    r = width - 1 if token_masks is None else width
    if r <= 0:
        return first[:, None][:, :width]
    cache = carry_cache(getattr(out, CACHE), row_of)
    n = len(prompt_index)
    cont = torch.zeros((n, r), dtype=torch.long)
    cont_mask = torch.zeros_like(cont)
    cont_pos = torch.zeros((n, r), dtype=torch.long)
    for i in range(n):
        lp, li = prompt_len[i], min(resp_len[i], r)
        cont[i, :li] = batch["input_ids"][i, lp : lp + li]
        cont_mask[i, :li] = 1
        cont_pos[i] = starts[row_list[i]] + torch.arange(r)
    attention = torch.cat([mask.to(device)[row_of], cont_mask.to(device)], dim=1)
    pos = cont_pos.to(device)
    rest = model(
        input_ids=cont.to(device),
        attention_mask=attention,
        position_ids=pos.expand(3, -1, -1) if vl else pos,
        use_cache=True,
        **{CACHE: cache},
    ).logits  # [N, r, V]
    if token_masks is not None:  # the tokens the policy sampled (not a tool's observation)
        sampled = batch["response_mask"][:, :r].float()
        token_masks.append(cont_mask.float() * torch.nn.functional.pad(sampled, (0, r - sampled.shape[1])))
    return torch.cat([first[:, None], rest[:, : width - 1]], dim=1)


def shared_prompt_values(
    critic: torch.nn.Module, batch: dict[str, torch.Tensor], width: int, device: torch.device
) -> torch.Tensor:
    """A critic's per-token values ``[N, R]`` of the states before each response token (value j: the state
    that predicts token j), from one packed row per prompt."""
    packed = pack_groups(critic, batch, width, device)
    values = critic(**packed.inputs, per_token=True)  # [rows, width]
    return values[packed.row.to(device)[:, None], packed.predict_at.to(device)]
