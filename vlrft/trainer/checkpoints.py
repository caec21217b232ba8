"""Checkpoint folders of a run: ``checkpoints/step-NNNNNN`` written atomically (a ``.tmp`` sibling
renamed into place, with a ``COMPLETE`` marker), the newest complete one found for ``resume=auto``,
older ones pruned to ``keep_last``."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

_STEP = re.compile(r"^step-(\d+)$")


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoint folders under ``root``, oldest first (half-written ``.tmp`` ones excluded)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP.match(p.name)) and (p / "COMPLETE").is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | Path) -> Path | None:
    ckpts = complete_checkpoints(root)
    return ckpts[-1] if ckpts else None


def prune_checkpoints(root: str | Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` complete checkpoints, and stale ``.tmp`` folders."""
    root = Path(root)
    for p in complete_checkpoints(root)[: -max(1, keep_last)]:
        shutil.rmtree(p, ignore_errors=True)
