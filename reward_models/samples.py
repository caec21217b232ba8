"""What a reward source scores: one :class:`Sample` per response (light: no torch, so that the worker
processes that run user functions import it in milliseconds).

A user reward function (``kind: function``, ``docs/your-task.md``) receives these fields:

- ``id``: the record's id; ``task``: its task label (selects recipes);
- ``prompt``: the user turn's text (with ``<image>`` placeholders where its images go);
- ``messages``: the conversation the policy saw, as chat messages (``{"role": ..., "content": ...}``, the system
  turn first when there is one);
- ``response``: the policy's response text;
- ``answer``: the record's reference answer (None when the record has none);
- ``images``: the record's images (paths, or PIL images once loaded);
- ``metadata``: the record's other fields (``metadata`` in its JSONL line);
- ``extra``: what the trainer measured about the response (``response_length`` in tokens, ...);
- ``trajectory``: in multi-turn rollouts with tools (docs/tools.md), the conversation after the prompt: assistant
  turns (their text, tool calls included) and ``tool`` turns (text and ``{"type": "image", "image": PIL}`` parts),
  the last assistant turn being ``response``; None for a single response.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Sample:
    """One response to one record, as every reward source sees it."""

    id: str
    prompt: str
    response: str
    answer: str | None = None
    images: list[Any] = field(default_factory=list)
    task: str = "default"
    system: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    trajectory: list[dict[str, Any]] | None = None
    videos: list[Any] = field(default_factory=list)  # the record's videos (paths, or frame lists), as read

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The conversation: the system turn (if any), the user turn, then the response as the assistant turn (or
        the trajectory's turns)."""
        turns = [{"role": "system", "content": self.system}] if self.system else []
        after = self.trajectory if self.trajectory is not None else [{"role": "assistant", "content": self.response}]
        return turns + [{"role": "user", "content": self.prompt}, *after]


def samples_of(
    records: list[Any],
    responses: list[str],
    extra: list[dict] | None = None,
    trajectories: list[list[dict] | None] | None = None,
) -> list[Sample]:
    """One :class:`Sample` per (record, response) pair (``records`` are ``PromptRecord`` objects)."""
    return [
        Sample(
            id=r.id,
            prompt=r.prompt,
            response=resp,
            answer=r.answer,
            images=list(r.images),
            task=r.task,
            system=r.system,
            metadata=dict(r.metadata),
            extra=dict(extra[i]) if extra else {},
            trajectory=trajectories[i] if trajectories else None,
            videos=list(getattr(r, "videos", ())),
        )
        for i, (r, resp) in enumerate(zip(records, responses))
    ]
