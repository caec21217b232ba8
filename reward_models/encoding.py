"""Tokenising (prompt, response) conversations for reward models with the processor's chat template.

A conversation is the record's user turn (with its images inline, optional system prompt) followed by
the response as the assistant turn. Text-only records and text-only models (a tokenizer instead of a
processor) take the same path. Batches are right-padded; the text ends with the assistant turn's
``<|im_end|>`` (the template's trailing newline is dropped) so that the last non-padding token closes
the response.
"""

from __future__ import annotations

from typing import Any

import torch

from data_pipelines.collate import processor_image_kwargs, tokenizer_of
from data_pipelines.formatting import build_messages, text_only_messages
from data_pipelines.images import load_image
from data_pipelines.records import PromptRecord, VideoPart, split_media


def load_images(images: list[Any], processor: Any) -> list[Any]:
    """Records' images as RGB PIL images sized by the processor's own pixel bounds (paths, bytes, data
    URIs or PIL objects); videos (``VideoPart``, :func:`~data_pipelines.records.media`) are kept as they are."""

    kwargs = processor_image_kwargs(processor)
    return [im if isinstance(im, VideoPart) else load_image(im, **kwargs) for im in images]


def conversation(prompt: str, images: list[Any], response: str | None, system: str | None = None) -> list[dict]:
    """Chat messages: optional system turn, the user turn with ``images`` inline (at the ``<image>``
    placeholders, else first; videos given as ``VideoPart`` at the ``<video>`` ones) and, when ``response`` is
    given, the response as the assistant turn."""

    pictures, videos = split_media(list(images))
    record = PromptRecord(id="", prompt=prompt, images=pictures, system=system, videos=videos)
    return build_messages(record, response=response)


def _is_processor(processor: Any) -> bool:
    return hasattr(processor, "image_processor")


def render(processor: Any, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """Chat-template text of ``messages`` (a finished assistant turn loses the template's trailing newline)."""
    if not _is_processor(processor):
        messages = text_only_messages(messages)
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    if not add_generation_prompt and text.endswith("<|im_end|>\n"):
        text = text[:-1]
    return text


def tokenize_texts(processor: Any, texts: list[str], images: list[list[Any]], padding_side: str = "right") -> dict:
    """Tokenise rendered chat texts (one image list per text) into a padded batch of tensors."""
    tok = tokenizer_of(processor)
    old_side = tok.padding_side
    tok.padding_side = padding_side
    try:
        flat, videos = split_media([im for ims in images for im in ims])
        if _is_processor(processor):
            batch = processor(text=texts, images=flat or None, videos=videos or None, padding=True, return_tensors="pt")
        else:
            if flat or videos:
                raise ValueError("a text-only model (tokenizer, no image processor) was given images or videos")
            batch = tok(texts, padding=True, return_tensors="pt", add_special_tokens=False)
    finally:
        tok.padding_side = old_side
    return dict(batch)


def encode_responses(
    processor: Any,
    items: list[tuple[str, list[Any], str, str | None]],
    max_length: int | None = None,
    ids: list[str] | None = None,
) -> dict:
    """Right-padded batch of ``(prompt, images, response, system)`` conversations.

    Raises ``ValueError`` naming the record when a conversation is longer than ``max_length`` tokens
    (never truncated: a cut would drop the response or split image tokens).
    """
    texts, images = [], []
    for prompt, ims, response, system in items:
        loaded = load_images(ims, processor)
        texts.append(render(processor, conversation(prompt, loaded, response, system)))
        images.append(loaded)
    batch = tokenize_texts(processor, texts, images)
    _check_length(batch, max_length, ids)
    return batch


def _check_length(batch: dict, max_length: int | None, ids: list[str] | None) -> None:
    if max_length is None:
        return
    lengths = batch["attention_mask"].sum(1)
    for i, n in enumerate(lengths.tolist()):
        if n > max_length:
            who = f"record {ids[i]!r}" if ids else f"sample {i}"
            raise ValueError(
                f"{who}: {n} tokens is longer than max_length={max_length}; raise max_length or filter long records"
            )


def encode_sft(
    processor: Any,
    items: list[tuple[str, list[Any], str, str | None]],
    max_length: int | None = None,
    ids: list[str] | None = None,
) -> dict:
    """Right-padded SFT batch of ``(prompt, images, target, system)`` with ``labels``.

    Labels are ``-100`` everywhere except the assistant target tokens and its closing ``<|im_end|>``
    (the loss is on the judge's answer only).
    """
    full_texts, prompt_texts, images = [], [], []
    for prompt, ims, target, system in items:
        loaded = load_images(ims, processor)
        full_texts.append(render(processor, conversation(prompt, loaded, target, system)))
        prompt_texts.append(render(processor, conversation(prompt, loaded, None, system), add_generation_prompt=True))
        images.append(loaded)
    batch = tokenize_texts(processor, full_texts, images)
    prompts = tokenize_texts(processor, prompt_texts, images)
    _check_length(batch, max_length, ids)
    labels = torch.full_like(batch["input_ids"], -100)
    full_len = batch["attention_mask"].sum(1).tolist()
    prompt_len = prompts["attention_mask"].sum(1).tolist()
    for i, (nf, np_) in enumerate(zip(full_len, prompt_len)):
        if not torch.equal(batch["input_ids"][i, :np_], prompts["input_ids"][i, :np_]) or nf <= np_:
            who = f"record {ids[i]!r}" if ids else f"sample {i}"
            raise ValueError(f"{who}: the prompt's tokens are not a prefix of prompt+target's tokens")
        labels[i, np_:nf] = batch["input_ids"][i, np_:nf]
    batch["labels"] = labels
    batch["verdict_mask"] = verdict_mask(tokenizer_of(processor), labels)
    return batch


def verdict_mask(tokenizer: Any, labels: torch.Tensor) -> torch.Tensor:
    """True at target tokens that write the content of the target's last ``<answer>...</answer>`` tag."""
    mask = torch.zeros_like(labels, dtype=torch.bool)
    for i in range(labels.shape[0]):
        pos = (labels[i] != -100).nonzero().flatten().tolist()
        ids = labels[i, pos].tolist()
        text = tokenizer.decode(ids)
        start, end = text.rfind("<answer>"), text.rfind("</answer>")
        if start < 0 or end < start:
            continue
        start += len("<answer>")
        for k in range(len(ids)):  # token k spans [len(decode(ids[:k])), len(decode(ids[:k+1])))
            lo, hi = len(tokenizer.decode(ids[:k])), len(tokenizer.decode(ids[: k + 1]))
            if hi > start and lo < end:
                mask[i, pos[k]] = True
    return mask
