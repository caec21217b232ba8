"""Checkpoint folders of a run: ``checkpoints/<prefix>N`` written atomically (a ``.tmp`` sibling
renamed into place, with a ``COMPLETE`` marker), the newest complete one found for ``resume=auto``,
older ones pruned to ``keep_last``. Shared by the policy trainer (``step-NNNNNN``) and the reward-model
trainer (``step_NNNNNNNN``)."""

from __future__ import annotations

import shutil
from pathlib import Path

PREFIX = "step-"


def complete_checkpoints(root: str | Path, prefix: str = PREFIX) -> list[Path]:
    """Complete checkpoint folders under ``root``, oldest first (half-written ``.tmp`` ones excluded)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [
        (int(p.name[len(prefix) :]), p)
        for p in root.iterdir()
        if p.name.startswith(prefix) and p.name[len(prefix) :].isdigit() and (p / "COMPLETE").is_file()
    ]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | Path, prefix: str = PREFIX) -> Path | None:
    ckpts = complete_checkpoints(root, prefix)
    return ckpts[-1] if ckpts else None


def prune_checkpoints(root: str | Path, keep_last: int, prefix: str = PREFIX) -> None:
    """Delete all but the newest ``keep_last`` complete checkpoints (a stale ``.tmp`` folder is replaced by
    the next save to the same step)."""
    for p in complete_checkpoints(root, prefix)[: -max(1, keep_last)]:
        shutil.rmtree(p, ignore_errors=True)
