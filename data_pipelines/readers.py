"""``read_records``: prompt records, preference pairs or judgment records from any supported source.

Sources: JSONL, JSON, Parquet, CSV, a folder of such files (hub layouts), a ``datasets`` folder saved
with ``save_to_disk``, or a hub dataset id (through ``datasets.load_dataset``; used only when no such
local path exists, and offline only cached datasets load). Bad records raise a
:class:`~data_pipelines.errors.DataError` naming source, row, field and reason
(``on_bad_record="error"``), or are skipped and counted per reason in a :class:`SkipReport`
(``on_bad_record="skip"``), whose summary is logged at the end of the pass.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from PIL import Image

from data_pipelines.collate import encode_prompt
from data_pipelines.errors import DataError
from data_pipelines.images import (
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_PIXELS,
    DEFAULT_MIN_PIXELS,
    IMAGE_FACTOR,
    load_image,
)
from data_pipelines.records import (
    IMAGE_PLACEHOLDER,
    VIDEO_PLACEHOLDER,
    JudgmentRecord,
    PreferencePair,
    PromptRecord,
    unread_fields,
)
from data_pipelines.sources import open_rows
from data_pipelines.video import checked_video, counting_videos

logger = logging.getLogger("data_pipelines")

Record = PromptRecord | PreferencePair | JudgmentRecord
RECORD_TYPES = {"prompt": PromptRecord, "preference": PreferencePair, "judgment": JudgmentRecord}
# Required text fields per kind; each must be a non-empty string.
REQUIRED = {"prompt": ("prompt",), "preference": ("prompt", "chosen", "rejected"), "judgment": ("prompt", "target")}
# Column names read as a field when the field's own column is absent (an explicit column_map wins).
ALIASES = {"problem": "prompt", "question": "prompt", "image": "images", "video": "videos"}
ON_BAD_RECORD = ("error", "skip")


@dataclass
class SkipReport:
    """What one pass read, kept and skipped (per reason, with the first message of each reason)."""

    source: str = ""
    read: int = 0
    kept: int = 0
    counts: Counter = field(default_factory=Counter)
    first: dict[str, str] = field(default_factory=dict)
    unread: Counter = field(default_factory=Counter)  # a field vlrft does not read -> records that have it
    unread_records: int = 0  # records with at least one such field

    def unread_line(self) -> str | None:
        """One line counting the records that carry fields vlrft does not read (per field), or None."""
        if not self.unread_records:
            return None
        fields = ", ".join(f"{name} ({n})" for name, n in sorted(self.unread.items()))
        have = "record has" if self.unread_records == 1 else "records have"
        return (
            f"{self.source}: {self.unread_records} {have} fields vlrft does not read: {fields}; they are kept in "
            "the records' metadata only"
        )

    def add(self, err: DataError) -> None:
        self.counts[err.category] += 1
        self.first.setdefault(err.category, str(err))

    @property
    def skipped(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        head = f"{self.source}: read {self.read} records, kept {self.kept}, skipped {self.skipped}"
        lines = [head] + [f"  {n} x {cat} (first: {self.first[cat]})" for cat, n in self.counts.most_common()]
        return "\n".join(lines)


def read_records(
    source: str | Path,
    kind: str = "prompt",
    *,
    column_map: dict[str, str] | None = None,
    split: str | None = None,
    on_bad_record: str = "error",
    image_root: str | Path | None = None,
    load_images: bool = True,
    min_pixels: int | None = DEFAULT_MIN_PIXELS,
    max_pixels: int | None = DEFAULT_MAX_PIXELS,
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS,
    image_factor: int = IMAGE_FACTOR,
    config_name: str | None = None,
    limit: int | None = None,
    check: Callable[[Record], None] | None = None,
    unique_ids: bool = False,
) -> tuple[list[Record], SkipReport]:
    """Read ``kind`` records from ``source``; returns the records and the pass's :class:`SkipReport`.

    ``column_map`` maps source columns to record fields (``{"problem": "prompt"}``); unmapped columns
    that are not fields go to ``metadata``. Relative image paths start at ``image_root`` (default: the
    source file's folder), as do relative video paths; every video is checked by its header and kept as its
    absolute path (never decoded here: frames are decoded when a prompt is encoded). With ``load_images`` each
    image becomes an RGB ``PIL.Image`` resized within ``min_pixels``/``max_pixels`` with sides multiples of
    ``image_factor`` (28; 32 for Qwen3-VL; see
    :func:`~data_pipelines.images.load_image`, and ``image_bounds(processor)`` for a model's values);
    without it, images stay as found. ``limit`` stops after that many records kept. ``check(record)``
    is the caller's own rule for each record (e.g. "a verifier needs ``answer``"): the ``DataError`` it
    raises is located and raised or counted like any other. With ``unique_ids`` a record whose id an earlier
    record has is a bad record too (named with both locations).
    """
    if kind not in RECORD_TYPES:
        raise ValueError(f"kind must be one of {sorted(RECORD_TYPES)}, got {kind!r}")
    if on_bad_record not in ON_BAD_RECORD:
        raise ValueError(f"on_bad_record must be one of {ON_BAD_RECORD}, got {on_bad_record!r}")
    rows, label, base_dir = open_rows(source, split=split, config_name=config_name)
    image_kwargs = dict(
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        max_image_pixels=max_image_pixels,
        base_dir=image_root if image_root is not None else base_dir,
        factor=image_factor,
    )
    stem = Path(str(source)).stem or "record"
    unread = unread_fields(RECORD_TYPES[kind])
    seen: Counter = Counter()  # unread field -> rows that give it
    seen_rows = 0

    def make(row: dict[str, Any], row_no: int, index: int) -> Record:
        nonlocal seen_rows
        given = {(column_map or {}).get(col, col) for col, value in row.items() if value is not None} & unread
        seen.update(given)
        seen_rows += bool(given)
        record = record_from_row(
            row,
            kind,
            column_map=column_map,
            default_id=f"{stem}-{row_no}",
            image_kwargs=image_kwargs if load_images else None,
            video_dir=image_kwargs["base_dir"] or "",
        )
        if check is not None:
            check(record)
        return record

    records, report = collect(rows, label, make, on_bad_record=on_bad_record, limit=limit, unique_ids=unique_ids)
    report.unread, report.unread_records = seen, seen_rows
    line = report.unread_line()
    if line is not None and line not in _WARNED:  # once per process: preflight and the run read the same file
        _WARNED.add(line)
        logger.warning("%s", line)
    return records, report


_WARNED: set[str] = set()  # unread-field lines already logged


def collect(
    rows: Any,
    label: str,
    make: Any,
    *,
    on_bad_record: str = "error",
    limit: int | None = None,
    unique_ids: bool = False,
) -> tuple[list[Any], SkipReport]:
    """One pass over ``(row_no, dict | DataError)`` rows: ``make(row, row_no, index)`` each into a record.

    A ``DataError`` (yielded or raised by ``make``) gets the row's location, then is raised or counted. With
    ``unique_ids`` a record whose ``id`` a kept record already has is one too, naming where that record is.
    """
    if on_bad_record not in ON_BAD_RECORD:
        raise ValueError(f"on_bad_record must be one of {ON_BAD_RECORD}, got {on_bad_record!r}")
    report = SkipReport(source=label)
    records: list[Any] = []
    first_row: dict[str, int | str] = {}  # id -> the row of the record kept with it
    for row_no, row in rows:
        report.read += 1
        try:
            if isinstance(row, DataError):
                raise row
            record = make(row, row_no, report.read - 1)
            if unique_ids:
                if record.id in first_row:
                    raise DataError(
                        f"id {record.id!r} is also the id of {label}:{first_row[record.id]}; ids must be unique "
                        "(results are kept by id): give each record its own",
                        category="duplicate id",
                        field="id",
                    )
                first_row[record.id] = row_no
            records.append(record)
        except DataError as err:
            err.located(source=label, row=row_no)
            if on_bad_record == "error":
                raise
            report.add(err)
        if limit is not None and len(records) >= limit:
            break
    report.kept = len(records)
    (logger.warning if report.skipped else logger.info)("%s", report.summary())
    return records, report


def required_text(value: Any, name: str) -> str:
    """A required text field: missing, non-text and blank values are located ``DataError``s."""
    if value is None:
        raise DataError("missing field", category="missing field", field=name)
    if not isinstance(value, str):
        raise DataError(f"wrong type: want text, got {type(value).__name__}", category="wrong type", field=name)
    if not value.strip():
        raise DataError(f"empty {name}", category=f"empty {name}", field=name)
    return value


def record_from_row(
    row: dict[str, Any],
    kind: str = "prompt",
    *,
    column_map: dict[str, str] | None = None,
    default_id: str = "record",
    image_kwargs: dict[str, Any] | None = None,
    video_dir: str | Path | None = None,
) -> Record:
    """One record from one row's dict, checked; loads its images when ``image_kwargs`` is given; with ``video_dir``
    (the folder relative video paths start at; ``""``: the working folder) its videos are checked by their headers
    and kept as absolute paths (:func:`~data_pipelines.video.checked_video`; frames are decoded when encoded)."""
    cls = RECORD_TYPES[kind]
    known = set(cls.__dataclass_fields__)
    column_map = column_map or {}
    values: dict[str, Any] = {}
    for col, value in row.items():
        name = column_map.get(col, col)
        if name in values:
            raise DataError(f"two columns give field {name!r}", category="duplicate field", field=str(col))
        values[name] = value
    for alias, name in ALIASES.items():
        if name not in values and alias in values and alias not in column_map:
            values[name] = values.pop(alias)
    # Conversational rows (TRL's format): a `messages` column, or `prompt` itself a list of messages.
    chat_field = "prompt" if isinstance(values.get("prompt"), list) else "messages" if "prompt" not in values else None
    if chat_field in values:
        values["prompt"], system, inline = _from_messages(values.pop(chat_field), chat_field)
        if system is not None and values.get("system") is None:
            values["system"] = system
        for name, found in inline.items():
            if found and values.get(name) is None:
                values[name] = found

    fields: dict[str, Any] = {}
    for name in REQUIRED[kind]:
        fields[name] = required_text(values.pop(name, None), name)
    fields["id"] = _text(values.pop("id", None), "id", numbers=True) or default_id
    fields["images"] = _image_list(values.pop("images", None))
    fields["videos"] = video_list(values.pop("videos", None))
    fields["task"] = _text(values.pop("task", None), "task") or "default"
    fields["system"] = _text(values.pop("system", None), "system")
    if kind == "prompt":
        fields["answer"] = _text(values.pop("answer", None), "answer", numbers=True)
    if kind == "preference":
        fields["tie"] = _bool(values.pop("tie", None), "tie")
        fields["margin"] = _float(values.pop("margin", None), "margin")
    metadata = values.pop("metadata", None)
    if isinstance(metadata, str):
        try:
            metadata = json.loads(metadata)
        except json.JSONDecodeError:
            pass
    if metadata is not None and not isinstance(metadata, dict):
        raise DataError(
            f"wrong type: want an object, got {type(metadata).__name__}", category="wrong type", field="metadata"
        )
    fields["metadata"] = {**{k: v for k, v in values.items() if k not in known and v is not None}, **(metadata or {})}

    for placeholder, name in ((IMAGE_PLACEHOLDER, "images"), (VIDEO_PLACEHOLDER, "videos")):
        n_slots = fields["prompt"].count(placeholder)
        if n_slots and n_slots != len(fields[name]):
            raise DataError(
                f"prompt has {n_slots} {placeholder} placeholders but the record has {len(fields[name])} {name}",
                category="placeholder mismatch",
                field="prompt",
            )
    if image_kwargs is not None:
        loaded = []
        for i, img in enumerate(fields["images"]):
            try:
                loaded.append(load_image(img, **image_kwargs))
            except DataError as err:
                raise err.located(field=f"images[{i}]")
        fields["images"] = loaded
    if video_dir is not None:
        checked = []
        for i, video in enumerate(fields["videos"]):
            try:
                checked.append(checked_video(video, base_dir=video_dir or None))
            except DataError as err:
                raise err.located(field=f"videos[{i}]")
        fields["videos"] = checked
    return cls(**fields)


def _text(value: Any, name: str, *, numbers: bool = False) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if numbers and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise DataError(f"wrong type: want text, got {type(value).__name__}", category="wrong type", field=name)


def _bool(value: Any, name: str) -> bool:
    if value is None:
        return False
    if isinstance(value, bool) or value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "0", "1", "yes", "no"):
        return value.strip().lower() in ("true", "1", "yes")
    raise DataError(f"wrong type: want true/false, got {value!r}", category="wrong type", field=name)


def _float(value: Any, name: str) -> float:
    if value is None:
        return 0.0
    try:
        if isinstance(value, bool):
            raise TypeError
        out = float(value)
    except (TypeError, ValueError):
        raise DataError(f"wrong type: want a number, got {value!r}", category="wrong type", field=name) from None
    if out != out or out in (float("inf"), float("-inf")):
        raise DataError(f"not a finite number: {value!r}", category="wrong type", field=name)
    return out


_IMAGE_TYPES = (str, Path, bytes, bytearray, dict, Image.Image)


def _media_items(value: Any, name: str) -> list[Any]:
    """A record's ``images`` or ``videos`` value as a list: one item, a list, or a JSON list in a CSV cell."""
    if value is None:
        return []
    if isinstance(value, str) and value.lstrip().startswith("["):  # CSV cells hold a JSON list
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise DataError(f"{name} cell is not a JSON list ({exc.msg})", category="wrong type", field=name) from None
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _image_list(value: Any) -> list[Any]:
    items = _media_items(value, "images")
    for i, item in enumerate(items):
        if not isinstance(item, _IMAGE_TYPES):
            raise DataError(
                f"wrong type for an image: {type(item).__name__}", category="wrong type", field=f"images[{i}]"
            )
    return items


def video_list(value: Any) -> list[Any]:
    """A record's ``videos``: each a path (text) or a list of frame images (one video); a JSON list in a CSV cell."""
    items = _media_items(value, "videos")
    for i, item in enumerate(items):
        frames = isinstance(item, (list, tuple)) and item and all(isinstance(f, _IMAGE_TYPES) for f in item)
        if not isinstance(item, (str, Path)) and not frames:
            raise DataError(
                f"wrong type for a video: {type(item).__name__} (want a file path or a list of frame images)",
                category="wrong type",
                field=f"videos[{i}]",
            )
    return items


def _from_messages(messages: Any, name: str) -> tuple[str, str | None, dict[str, list[Any]]]:
    """A chat messages list (optional system turn, one user turn) as prompt text with placeholders, the
    system text and the media given inline (``{"type": "image", "image": ...}``, ``{"type": "video", "video": ...}``)
    as ``{"images": [...], "videos": [...]}``."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise DataError("wrong type: want a list of {role, content} messages", category="wrong type", field=name)
    system, inline = None, {"images": [], "videos": []}
    if messages and messages[0].get("role") == "system":
        system = _content_text(messages[0].get("content"), name, inline)
        messages = messages[1:]
    if len(messages) != 1 or messages[0].get("role") != "user":
        raise DataError("want one user message (after an optional system message)", category="wrong type", field=name)
    return _content_text(messages[0].get("content"), name, inline), system, inline


def _content_text(content: Any, name: str, inline: dict[str, list[Any]]) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image":
                parts.append(IMAGE_PLACEHOLDER)
                if part.get("image") is not None:
                    inline["images"].append(part["image"])
            elif kind == "video":
                parts.append(VIDEO_PLACEHOLDER)
                if part.get("video") is not None:
                    inline["videos"].append(part["video"])
            elif kind == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            else:
                raise DataError(f"unknown content part {part!r:.80}", category="wrong type", field=name)
        return "".join(parts)
    raise DataError(f"wrong type for content: {type(content).__name__}", category="wrong type", field=name)


def prompt_length(
    record: Record,
    processor_or_tokenizer: Any,
    *,
    system_prompt: str | None = None,
    prompt_template: str | None = None,
    images: bool = True,
    tools: list[dict[str, Any]] | None = None,
) -> int:
    """Tokens of the record's prompt as :func:`~data_pipelines.collate.encode_prompt` encodes it for
    generation (chat template, generation prompt, image and video tokens and the ``tools`` listed included; a video's
    tokens from its header, no frame decoded). With ``images=False`` its images are left out (none is read): a lower
    bound, exact for a record without images."""

    if not images:
        record = replace(record, images=[], prompt=record.prompt.replace(IMAGE_PLACEHOLDER, ""))
    if record.images and getattr(processor_or_tokenizer, "image_processor", None) is None:
        raise ValueError("records with images need the model's processor (not its tokenizer) to count image tokens")
    with counting_videos(processor_or_tokenizer):  # video tokens from the headers: no frame decoded
        encoded = encode_prompt(
            processor_or_tokenizer, record, system_prompt=system_prompt, prompt_template=prompt_template, tools=tools
        )
    return encoded.input_ids.numel()


def filter_by_prompt_length(
    records: list[Record],
    processor_or_tokenizer: Any,
    max_prompt_length: int,
    on_bad_record: str = "error",
    report: SkipReport | None = None,
    *,
    system_prompt: str | None = None,
    prompt_template: str | None = None,
    images: bool = True,
    limit_name: str = "max_prompt_length",
    tools: list[dict[str, Any]] | None = None,
) -> list[Record]:
    """Records whose prompt fits in ``max_prompt_length`` tokens; longer ones raise or are counted as skips.

    Prompts are never truncated (a cut could fall inside a run of image tokens). With ``images=False``
    prompts are counted without their images (:func:`prompt_length`), so no image is read. ``limit_name``
    is how messages name the limit.
    """
    if on_bad_record not in ON_BAD_RECORD:
        raise ValueError(f"on_bad_record must be one of {ON_BAD_RECORD}, got {on_bad_record!r}")
    report = report if report is not None else SkipReport(source="filter_by_prompt_length")
    kept = []
    for rec in records:
        n = prompt_length(
            rec,
            processor_or_tokenizer,
            system_prompt=system_prompt,
            prompt_template=prompt_template,
            images=images,
            tools=tools,
        )
        if n <= max_prompt_length:
            kept.append(rec)
            continue
        counted = "image tokens included" if images else f"not counting its {len(rec.images)} image(s)"
        if rec.videos:
            counted += f", {len(rec.videos)} video(s) included"
        err = DataError(
            f"prompt has {n} tokens{f' ({counted})' if rec.images or rec.videos or images else ''} > {limit_name} "
            f"{max_prompt_length}",
            category="prompt too long",
            source=f"record {rec.id!r}",
            field="prompt",
        )
        if on_bad_record == "error":
            raise err
        report.add(err)
    if report.read == 0:  # a fresh report; one from read_records already counts these records
        report.read, report.kept = len(records), len(kept)
    else:
        report.kept -= len(records) - len(kept)
    if len(kept) < len(records):
        logger.warning("%s", report.summary())
    return kept
