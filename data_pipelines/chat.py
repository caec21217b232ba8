"""Chat records for supervised fine-tuning and preference optimisation: encoding with assistant-only labels.

A :class:`ChatRecord` is a conversation: an optional system turn, then user and assistant turns, single or
multi-turn, each with zero or more images (``{"type": "image"}`` parts, or ``<image>`` placeholders in a
string content filled from the record's ``images`` in order). :func:`encode_chat` renders it with the
processor's own chat template (images processed once) and returns the token ids with ``labels`` equal to
the ids on the assistant turns' tokens (their content and closing ``<|im_end|>``) and ``-100`` everywhere
else: the system and user turns, the images and each assistant header are context, not targets.
The assistant spans are found by rendering each conversation prefix with the template's own generation
prompt, so the masking is exactly what the template produces (proven token by token in
tests/test_data_chat.py). Text-only conversations and text-only models take the same path.

Records from files: JSONL/JSON/Parquet/CSV rows with ``messages`` (TRL's conversational format) and optional
``images``; or a prompt row with ``prompt``/``images`` and a ``response`` (or ``answer``) column, read as a
one-turn conversation (:func:`read_chat_records`). Preference pairs become two conversations
(:func:`pair_conversations`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from data_pipelines.collate import (
    EncodedPrompt,
    cat_media,
    image_outputs,
    processor_image_kwargs,
    tokenizer_of,
    types_of,
    video_outputs,
)
from data_pipelines.errors import DataError
from data_pipelines.formatting import build_messages, user_content
from data_pipelines.images import load_image
from data_pipelines.readers import collect, required_text, video_list
from data_pipelines.records import IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, PreferencePair, PromptRecord
from data_pipelines.sources import open_rows
from data_pipelines.templates import render
from data_pipelines.video import checked_video, counting_videos

IGNORE_INDEX = -100
ROLES = ("system", "user", "assistant", "tool")


@dataclass
class ChatRecord:
    """A conversation for SFT: ``messages`` in the Qwen-VL chat format (``content`` a list of
    ``{"type": "text", "text"}`` / ``{"type": "image", "image"}`` parts), at least one assistant turn."""

    id: str
    messages: list[dict[str, Any]]
    task: str = "default"
    answer: str | None = None  # the reference answer, when the conversation has one (held-out evaluation)
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def images(self) -> list[Any]:
        return [c["image"] for m in self.messages for c in m["content"] if c.get("type") == "image"]

    @property
    def videos(self) -> list[Any]:
        return [c["video"] for m in self.messages for c in m["content"] if c.get("type") == "video"]


@dataclass
class EncodedChat(EncodedPrompt):
    """An encoded conversation: :class:`~data_pipelines.collate.EncodedPrompt` fields plus ``labels`` [L]."""

    labels: torch.Tensor | None = None

    @property
    def num_target_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())


def chat_from_prompt(
    record: PromptRecord, response: str, *, system_prompt: str | None = None, prompt_template: str | None = None
) -> ChatRecord:
    """A one-turn conversation: the prompt record's user turn (images inline, ``prompt_template`` applied as
    in generation) answered by ``response``."""
    messages = build_messages(record, system_prompt=system_prompt, prompt_template=prompt_template, response=response)
    return ChatRecord(record.id, messages, task=record.task, answer=record.answer, metadata=dict(record.metadata))


def pair_conversations(
    pair: PreferencePair, *, system_prompt: str | None = None, prompt_template: str | None = None
) -> tuple[ChatRecord, ChatRecord]:
    """The (chosen, rejected) conversations of a preference pair (same prompt, same images)."""
    prompt = PromptRecord(
        pair.id, pair.prompt, list(pair.images), task=pair.task, system=pair.system, videos=list(pair.videos)
    )
    kw = {"system_prompt": system_prompt, "prompt_template": prompt_template}
    return chat_from_prompt(prompt, pair.chosen, **kw), chat_from_prompt(prompt, pair.rejected, **kw)


def normalise_messages(
    messages: Any, images: list[Any], image_kwargs: dict[str, Any] | None = None, videos: list[Any] = ()
) -> list[dict]:
    """Messages as the chat template wants them (content lists, PIL images, checked video paths), checked.

    String contents may hold ``<image>`` and ``<video>`` placeholders, filled from ``images`` and ``videos`` in
    order across turns; ``{"type": "image"}`` / ``{"type": "video"}`` parts without their item take the next one
    too. Videos are checked by their headers (relative paths start at ``image_kwargs["base_dir"]``). Raises
    :class:`~data_pipelines.errors.DataError` naming the message for a bad role, content or item count.
    """
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise DataError("want a non-empty list of {role, content} messages", category="wrong type", field="messages")
    base_dir = (image_kwargs or {}).get("base_dir")
    pools = {"image": list(images), "video": list(videos)}
    marks = {"image": IMAGE_PLACEHOLDER, "video": VIDEO_PLACEHOLDER}

    def take(kind: str, n: int, where: str) -> list[Any]:
        if n > len(pools[kind]):
            raise DataError(
                f"{n} {marks[kind]} placeholder(s) but only {len(pools[kind])} {kind}(s) left",
                category="placeholder mismatch",
                field=where,
            )
        taken, pools[kind] = pools[kind][:n], pools[kind][n:]
        return taken

    def item(kind: str, src: Any, where: str) -> Any:
        if kind == "image":
            return src if isinstance(src, Image.Image) else load_image(src, **(image_kwargs or {}))
        try:
            return checked_video(src, base_dir=base_dir)
        except DataError as err:
            raise err.located(field=where)

    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            raise DataError(f"role {role!r} is not one of {', '.join(ROLES)}", category="bad role", field=where)
        if role == "system" and i:
            raise DataError("a system message must come first", category="bad role", field=where)
        if isinstance(content, str):
            counts = {kind: content.count(mark) for kind, mark in marks.items()}
            if any(counts.values()):
                taken = {kind: take(kind, n, where) for kind, n in counts.items()}
                vids = [item("video", v, where) for v in taken["video"]]
                parts = user_content(content, taken["image"], image_kwargs, vids)
            else:
                parts = [{"type": "text", "text": content}]
        elif isinstance(content, list):
            parts = []
            for part in content:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text" and isinstance(part.get("text"), str):
                    parts.append({"type": "text", "text": part["text"]})
                elif kind in marks:
                    if part.get(kind) is None and not pools[kind]:
                        raise DataError(f"an {kind} part without an {kind}", category=f"missing {kind}", field=where)
                    src = part[kind] if part.get(kind) is not None else pools[kind].pop(0)
                    parts.append({"type": kind, kind: item(kind, src, where)})
                else:
                    raise DataError(f"unknown content part {part!r:.80}", category="wrong type", field=where)
        else:
            raise DataError(f"content must be text or a list of parts, got {type(content).__name__}", field=where)
        out.append({"role": role, "content": parts})
    for kind, left in pools.items():
        if left:
            raise DataError(f"{len(left)} {kind}(s) not referenced by any message", category="placeholder mismatch")
    if not any(m["role"] == "assistant" for m in out):
        raise DataError("no assistant turn to learn from", category="no assistant turn", field="messages")
    return out


def encode_chat(
    processor: Any, record: ChatRecord, max_length: int | None = None, tools: list[dict[str, Any]] | None = None
) -> EncodedChat:
    """Token ids, images and assistant-only ``labels`` of one conversation (see the module docstring); ``tools``:
    the schemas listed in its system turn (tool trajectories: ``role: tool`` turns are context, like user turns).

    Raises :class:`~data_pipelines.errors.DataError` naming the record when the template's rendering of
    a prefix is not a prefix of the whole (a template that rewrites earlier turns), when the model is
    text-only but the record has images, or when it is longer than ``max_length`` tokens (never cut: a
    cut would drop targets or split an image's tokens).
    """
    text_only = getattr(processor, "image_processor", None) is None
    for name in ("images", "videos"):
        if text_only and getattr(record, name):
            n = len(getattr(record, name))
            raise DataError(f"{n} {name[:-1]}(s) but the model is text-only", field="messages").located(
                source=record.id
            )
    enc = render(processor, record.messages, tools=tools, add_generation_prompt=False, tokenize=True)
    ids = enc["input_ids"][0].long()
    if max_length is not None and ids.numel() > max_length:
        raise DataError(
            f"{ids.numel()} tokens is longer than max_length={max_length}; raise it or filter long records",
            category="too long",
        ).located(source=record.id)
    labels = torch.full_like(ids, IGNORE_INDEX)
    end_id = tokenizer_of(processor).convert_tokens_to_ids("<|im_end|>")
    for i, m in enumerate(record.messages):
        if m["role"] != "assistant":
            continue
        with counting_videos(processor):  # only the prefix's ids are read: its videos are counted, not decoded
            prefix = render(processor, record.messages[:i], tools=tools, add_generation_prompt=True, tokenize=True)
        prefix = prefix["input_ids"][0]
        start = prefix.numel()
        if start > ids.numel() or not torch.equal(ids[:start], prefix.long()):
            raise DataError(
                f"the chat template's rendering of turns 0..{i - 1} is not a prefix of the conversation",
                category="template mismatch",
                field=f"messages[{i}]",
            ).located(source=record.id)
        ends = (ids[start:] == end_id).nonzero()
        stop = start + int(ends[0]) + 1 if ends.numel() else ids.numel()
        labels[start:stop] = ids[start:stop]
    media = video_outputs(enc)
    return EncodedChat(
        ids, *image_outputs(enc), record.images, types_of(enc), videos=record.videos, **media, labels=labels
    )


def collate_chats(chats: list[EncodedChat], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded training batch: ``input_ids``, ``attention_mask``, ``labels`` (-100 on padding), the
    conversations' images in batch order and ``mm_token_type_ids`` (as ``collate_sequences`` carries it)."""
    width = max(c.input_ids.numel() for c in chats)
    n = len(chats)
    ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    attn = torch.zeros((n, width), dtype=torch.long)
    labels = torch.full((n, width), IGNORE_INDEX, dtype=torch.long)
    types = torch.zeros((n, width), dtype=torch.long)
    for i, c in enumerate(chats):
        k = c.input_ids.numel()
        ids[i, :k], attn[i, :k], labels[i, :k] = c.input_ids, 1, c.labels
        if c.mm_token_type_ids is not None:
            types[i, :k] = c.mm_token_type_ids
    out = {"input_ids": ids, "attention_mask": attn, "labels": labels, **cat_media(chats)}
    if any(c.mm_token_type_ids is not None for c in chats):
        out["mm_token_type_ids"] = types
    return out


def chat_record_from_row(row: dict[str, Any], default_id: str, image_kwargs: dict[str, Any] | None) -> ChatRecord:
    """One row: ``messages`` (+ optional ``images``, ``videos``), or ``prompt`` + ``response``/``answer`` (+ ``images``,
    ``videos``, ``system``)."""
    images = row.get("images", row.get("image")) or []
    images = images if isinstance(images, list) else [images]
    videos = video_list(row.get("videos", row.get("video")))
    rid = str(row.get("id") or default_id)
    if "messages" in row:
        messages = row["messages"]
    else:
        prompt = required_text(row.get("prompt"), "prompt")
        response = required_text(row.get("response", row.get("answer")), "response")
        messages = ([{"role": "system", "content": row["system"]}] if row.get("system") else []) + [
            {
                "role": "user",
                "content": (IMAGE_PLACEHOLDER * len(images) if IMAGE_PLACEHOLDER not in prompt else "")
                + (VIDEO_PLACEHOLDER * len(videos) if VIDEO_PLACEHOLDER not in prompt else "")
                + prompt,
            },
            {"role": "assistant", "content": response},
        ]
    known = {"id", "messages", "images", "image", "videos", "video", "prompt", "response", "system", "task", "answer"}
    return ChatRecord(
        rid,
        normalise_messages(messages, images, image_kwargs, videos),
        task=str(row.get("task") or "default"),
        answer=None if row.get("answer") is None else str(row["answer"]),
        metadata={k: v for k, v in row.items() if k not in known},
    )


def read_chat_records(
    source: str | Path, *, on_bad_record: str = "error", processor: Any = None, limit: int | None = None
) -> tuple[list[ChatRecord], Any]:
    """Chat records from a file, folder or ``datasets`` folder (see :func:`chat_record_from_row`); images are
    loaded relative to the source and sized by ``processor``'s own bounds. Returns (records, SkipReport)."""
    rows, label, base_dir = open_rows(source)
    kwargs = {**(processor_image_kwargs(processor) if processor is not None else {}), "base_dir": base_dir}
    stem = Path(str(source)).stem or "chat"
    return collect(
        rows,
        label,
        lambda row, row_no, index: chat_record_from_row(row, f"{stem}-{row_no}", kwargs),
        on_bad_record=on_bad_record,
        limit=limit,
    )
