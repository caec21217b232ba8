"""Collation for Qwen-VL (and text-only Qwen) policies.

A prompt is encoded ONCE (chat template, image preprocessing) into an :class:`EncodedPrompt`; the n
samples of its group refer to it by index and share its image tensors. Two batch layouts:

- :func:`collate_prompts`: left-padded prompt batches for generation;
- :func:`collate_sequences`: right-padded prompt+response batches for training, with the attention
  mask, the action (response) mask, and each sample's ``pixel_values`` / ``image_grid_thw`` in batch
  order. Qwen-VL's multimodal rope position ids are computed by the model from ``input_ids``,
  ``image_grid_thw``, ``mm_token_type_ids`` and the attention mask, so padding on either side gives each
  sample the positions it has alone (checked against the model in tests/test_collate.py).

``mm_token_type_ids`` (1 on image tokens) travels with every batch: transformers 5's Qwen-VL models
compute the 3-D (m-rope) positions of image tokens only when it is given, and silently fall back to
1-D text positions otherwise, which is not how the model was pretrained (nor what vLLM computes).

A text-only sample is a sample with no images: it goes through the same functions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from data_pipelines.formatting import build_messages
from data_pipelines.images import image_bounds
from data_pipelines.templates import render


@dataclass(frozen=True)
class Modality:
    """One kind of visual input as the model takes it: its pixel rows, its grid rows (one per item), the batch
    key counting each sample's items, and per-item values that travel with the grid (Qwen2.5-VL's seconds per
    temporal grid)."""

    pixels: str
    grid: str
    per_sample: str
    token: str  # the placeholder token the processor repeats for each item's features
    per_item: tuple[str, ...] = ()


IMAGES = Modality("pixel_values", "image_grid_thw", "images_per_sample", "<|image_pad|>")
VIDEOS = Modality(
    "pixel_values_videos", "video_grid_thw", "videos_per_sample", "<|video_pad|>", ("second_per_grid_ts",)
)
MODALITIES = (IMAGES, VIDEOS)


@dataclass
class EncodedPrompt:
    """One prompt after chat formatting and image (and video) preprocessing."""

    input_ids: torch.Tensor  # [L] int64, no padding
    pixel_values: torch.Tensor | None = None  # [patches, dim] for all of the prompt's images
    image_grid_thw: torch.Tensor | None = None  # [images, 3]
    # the images exactly as the processor received them, in prompt order: what an engine with its own
    # preprocessing (vLLM's ``multi_modal_data``) is given; its processor then yields ``image_grid_thw``
    images: list[Any] = field(default_factory=list)
    # [L] int64, 1 on image tokens (the processor's own marks; None for a text-only tokenizer)
    mm_token_type_ids: torch.Tensor | None = None
    # the chat messages rendered (images as PIL parts), where a multi-turn rollout continues the conversation
    messages: list[dict[str, Any]] | None = None
    pixel_values_videos: torch.Tensor | None = None  # [patches, dim] for all of the prompt's videos
    video_grid_thw: torch.Tensor | None = None  # [videos, 3]
    second_per_grid_ts: torch.Tensor | None = None  # [videos] (Qwen2.5-VL's processor; None for the others)
    videos: list[Any] = field(default_factory=list)  # the videos as given (paths or frame lists), in prompt order

    @property
    def num_images(self) -> int:
        return 0 if self.image_grid_thw is None else int(self.image_grid_thw.shape[0])

    @property
    def num_videos(self) -> int:
        return 0 if self.video_grid_thw is None else int(self.video_grid_thw.shape[0])


def tokenizer_of(processor: Any) -> Any:
    """The tokenizer inside a processor (or the tokenizer itself for text-only models)."""
    return getattr(processor, "tokenizer", processor)


def processor_image_kwargs(processor: Any) -> dict[str, int]:
    """``load_image`` bounds from a Qwen-VL processor's own ``min_pixels``/``max_pixels``/patch factor, so
    images are sized for the model at hand ({} for a text-only tokenizer)."""
    if getattr(processor, "image_processor", None) is None:
        return {}
    bounds = image_bounds(processor)
    return {"min_pixels": bounds["min_pixels"], "max_pixels": bounds["max_pixels"], "factor": bounds["image_factor"]}


def image_outputs(enc: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(pixel_values, image_grid_thw)`` of one processor output (``None, None`` without images)."""
    pixel_values = enc.get("pixel_values")
    if pixel_values is not None and pixel_values.numel() == 0:
        pixel_values = None
    return pixel_values, (enc.get("image_grid_thw") if pixel_values is not None else None)


def video_outputs(enc: Any) -> dict[str, torch.Tensor]:
    """The video fields of one processor output as :class:`EncodedPrompt` keywords ({} without videos)."""
    pixels = enc.get("pixel_values_videos")
    if pixels is None or pixels.shape[0] == 0:
        return {}
    out = {"pixel_values_videos": pixels, "video_grid_thw": enc["video_grid_thw"]}
    if enc.get("second_per_grid_ts") is not None:
        out["second_per_grid_ts"] = torch.as_tensor(enc["second_per_grid_ts"], dtype=torch.float32).reshape(-1)
    return out


def types_of(enc: Any) -> torch.Tensor | None:
    """The processor's ``mm_token_type_ids`` of its one sequence ([L] int64; None for a text tokenizer)."""
    types = enc.get("mm_token_type_ids")
    return types[0].long() if types is not None else None


def encode_prompt(
    processor: Any,
    record: Any,
    *,
    system_prompt: str | None = None,
    prompt_template: str | None = None,
    image_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> EncodedPrompt:
    """Chat-format and preprocess one prompt record (images included) for generation. Images are loaded
    with ``image_kwargs`` (default: the processor's own bounds, :func:`processor_image_kwargs`); ``tools``: the
    schemas of the tools the policy may call, listed in the system turn (``data_pipelines.templates.render``)."""
    text_only = getattr(processor, "image_processor", None) is None
    for name in ("images", "videos"):
        if text_only and getattr(record, name, ()):
            n = len(getattr(record, name))
            raise ValueError(f"record {record.id!r} has {n} {name[:-1]}(s) but the model is text-only")
    if image_kwargs is None:
        image_kwargs = processor_image_kwargs(processor)
    messages = build_messages(
        record, system_prompt=system_prompt, prompt_template=prompt_template, image_kwargs=image_kwargs
    )
    images = [c["image"] for m in messages for c in m["content"] if c.get("type") == "image"]
    videos = [c["video"] for m in messages for c in m["content"] if c.get("type") == "video"]
    enc = render(processor, messages, tools=tools, add_generation_prompt=True, tokenize=True)
    return EncodedPrompt(
        enc["input_ids"][0].long(),
        *image_outputs(enc),
        images=images,
        mm_token_type_ids=types_of(enc),
        messages=messages,
        videos=videos,
        **video_outputs(enc),
    )


def cat_media(pieces: list[EncodedPrompt]) -> dict[str, torch.Tensor]:
    """The pieces' images and videos joined in order, by model keyword ({} when none has any)."""
    out = {}
    for m in MODALITIES:
        have = [p for p in pieces if getattr(p, m.pixels) is not None]
        if have:
            out[m.pixels] = torch.cat([getattr(p, m.pixels) for p in have])
            out[m.grid] = torch.cat([getattr(p, m.grid) for p in have])
            for key in m.per_item:
                if any(getattr(p, key) is not None for p in have):
                    out[key] = torch.cat([getattr(p, key) for p in have])
    return out


def collate_prompts(prompts: list[EncodedPrompt], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Left-padded prompt batch for generation (``input_ids``, ``attention_mask``, images)."""
    width = max(p.input_ids.numel() for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        n = p.input_ids.numel()
        ids[i, width - n :] = p.input_ids
        mask[i, width - n :] = 1
    out = {"input_ids": ids, "attention_mask": mask, **cat_media(prompts)}
    if any(p.mm_token_type_ids is not None for p in prompts):
        types = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            if p.mm_token_type_ids is not None:
                types[i, width - p.input_ids.numel() :] = p.mm_token_type_ids
        out["mm_token_type_ids"] = types
    return out


def collate_sequences(
    prompts: list[EncodedPrompt],
    prompt_index: list[int],
    responses: list[torch.Tensor | EncodedPrompt],
    pad_token_id: int,
) -> dict[str, torch.Tensor]:
    """Right-padded training batch of prompt + response for samples ``i`` of prompt ``prompt_index[i]``.

    A response is its token ids, or an :class:`EncodedPrompt` when it holds images of its own (a multi-turn
    trajectory whose tools returned images: its ids, their pixels and image marks). Returns ``input_ids``,
    ``attention_mask``, ``action_mask`` (1 on response tokens, aligned with ``input_ids``), ``prompt_index`` [N],
    ``prompt_lengths`` [N], ``response_lengths`` [N], ``images_per_sample`` [N] (prompt and response images),
    ``videos_per_sample`` [N] (the prompt's), ``response_images`` [N] and the samples' images (``pixel_values``,
    ``image_grid_thw`` in sample order: each sample's prompt images then its response's) and videos
    (``pixel_values_videos``, ``video_grid_thw``, Qwen2.5-VL's ``second_per_grid_ts``), with ``mm_token_type_ids``.
    """
    if len(prompt_index) != len(responses):
        raise ValueError(f"{len(prompt_index)} prompt indices for {len(responses)} responses")
    pieces = [r if isinstance(r, EncodedPrompt) else EncodedPrompt(r) for r in responses]
    lengths = [prompts[j].input_ids.numel() + r.input_ids.numel() for j, r in zip(prompt_index, pieces)]
    width = max(lengths)
    n = len(responses)
    ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    action = torch.zeros((n, width), dtype=torch.long)
    for i, (j, r) in enumerate(zip(prompt_index, pieces)):
        p = prompts[j].input_ids
        ids[i, : p.numel()] = p
        ids[i, p.numel() : lengths[i]] = r.input_ids
        attn[i, : lengths[i]] = 1
        action[i, p.numel() : lengths[i]] = 1
    out = {
        "input_ids": ids,
        "attention_mask": attn,
        "action_mask": action,
        "prompt_index": torch.tensor(prompt_index, dtype=torch.long),  # samples of one prompt share it
        "prompt_lengths": torch.tensor([prompts[j].input_ids.numel() for j in prompt_index]),
        "response_lengths": torch.tensor([r.input_ids.numel() for r in pieces]),
        "images_per_sample": torch.tensor([prompts[j].num_images + r.num_images for j, r in zip(prompt_index, pieces)]),
        "videos_per_sample": torch.tensor([prompts[j].num_videos for j in prompt_index]),
        "response_images": torch.tensor([r.num_images for r in pieces]),
        **cat_media([x for j, r in zip(prompt_index, pieces) for x in (prompts[j], r)]),
    }
    marked = [prompts[j].mm_token_type_ids is not None for j in prompt_index] + [
        r.mm_token_type_ids is not None for r in pieces
    ]
    if any(marked):
        types = torch.zeros((n, width), dtype=torch.long)  # text tokens (0) unless marked
        for i, (j, r) in enumerate(zip(prompt_index, pieces)):
            k = prompts[j].input_ids.numel()
            if prompts[j].mm_token_type_ids is not None:
                types[i, :k] = prompts[j].mm_token_type_ids
            if r.mm_token_type_ids is not None:
                types[i, k : lengths[i]] = r.mm_token_type_ids
        out["mm_token_type_ids"] = types
    return out


# mm_token_type_ids: transformers 5's Qwen-VL models need it for the m-rope positions of image and video tokens.
MODEL_INPUT_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids") + tuple(
    key for m in MODALITIES for key in (m.pixels, m.grid, *m.per_item)
)


def model_inputs(batch: dict[str, torch.Tensor], device: torch.device | str | None = None) -> dict[str, torch.Tensor]:
    """The keys of ``batch`` that a Qwen(-VL) forward (policy, judge or reward-model backbone) takes,
    moved to ``device``."""
    return {k: (v.to(device) if device is not None else v) for k, v in batch.items() if k in MODEL_INPUT_KEYS}
