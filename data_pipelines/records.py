"""The three kinds of records vlrft reads.

A record's text may carry ``<image>`` placeholders where its images go and ``<video>`` placeholders where its
videos go (each kind's count must equal the number of its items); a kind without placeholders comes before the
text (images, then videos). A text-only record has ``images == videos == []`` and goes through the same code
paths as a vision-language one.

``images`` holds whatever the reader found (path, bytes, data URI, PIL image) until
``data_pipelines.images`` loads them into RGB ``PIL.Image`` objects. ``videos`` holds one entry per video: a video
file's path (made absolute by the reader), or a list of frame images taken as one video; frames are decoded only
when the prompt is encoded (``data_pipelines.video``), one batch at a time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"


@dataclass
class PromptRecord:
    """A prompt for RL rollouts and evaluation."""

    id: str
    prompt: str  # the user turn's text, with optional <image> placeholders
    images: list[Any] = field(default_factory=list)
    answer: str | None = None  # reference answer the rule verifiers check against
    task: str = "default"  # selects the verifiers / reward recipe
    system: str | None = None  # optional system prompt
    metadata: dict[str, Any] = field(default_factory=dict)
    videos: list[Any] = field(default_factory=list)  # video paths (or frame lists), <video> placeholders


@dataclass
class PreferencePair:
    """A preference pair for scalar reward models: ``chosen`` is preferred to ``rejected``."""

    id: str
    prompt: str
    chosen: str
    rejected: str
    images: list[Any] = field(default_factory=list)
    tie: bool = False  # the two responses are equally good
    margin: float = 0.0  # optional Bradley-Terry margin (how much better chosen is)
    task: str = "default"
    system: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    videos: list[Any] = field(default_factory=list)  # video paths (or frame lists), <video> placeholders


@dataclass
class JudgmentRecord:
    """A supervised record for generative reward models (judges): the judge should answer ``target``."""

    id: str
    prompt: str
    target: str
    images: list[Any] = field(default_factory=list)
    task: str = "default"
    system: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    videos: list[Any] = field(default_factory=list)  # video paths (or frame lists), <video> placeholders


@dataclass(frozen=True)
class VideoPart:
    """A video among a record's media in one list (:func:`media`): the path or frame list as the record keeps it."""

    src: Any


def media(record: Any) -> list[Any]:
    """A record's images, then its videos as :class:`VideoPart`: the one list the reward models' encoders take (each
    kind still goes to its own placeholders: ``split_media``)."""
    return [*record.images, *(VideoPart(v) for v in getattr(record, "videos", ()))]


def split_media(items: list[Any]) -> tuple[list[Any], list[Any]]:
    """``(images, videos)`` of a :func:`media` list."""
    return [x for x in items if not isinstance(x, VideoPart)], [x.src for x in items if isinstance(x, VideoPart)]


# media a record may carry that vlrft does not read
UNREAD_MEDIA = ("audio", "audios")


def unread_fields(cls: type) -> frozenset[str]:
    """Row fields a reader of ``cls`` records does not read although they look like record fields: the other
    record kinds' own fields (``chosen`` in a prompt file: a preference file given as prompts?) and
    :data:`UNREAD_MEDIA`. Such a value is kept in ``metadata`` only, and the reader counts it in one warning."""
    kinds = (PromptRecord, PreferencePair, JudgmentRecord)
    others = {name for kind in kinds for name in kind.__dataclass_fields__} - set(cls.__dataclass_fields__)
    return frozenset(others | set(UNREAD_MEDIA))
