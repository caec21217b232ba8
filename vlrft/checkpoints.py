"""Checkpoint folders of a run, for every trainer: ``<root>/step-NNNNNN``.

A checkpoint is written into a fresh ``.tmp`` sibling and renamed into place with a ``COMPLETE`` marker
(:func:`atomic_dir`, :func:`commit_dir`; the strategies fill the folder), so a crash at any point leaves
the previous checkpoints intact. ``resume=auto`` takes the newest complete one; older ones are pruned
to ``keep_last``.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

PREFIX = "step-"


def checkpoint_dir(root: str | Path, step: int) -> Path:
    """The folder of the checkpoint taken after ``step`` optimizer steps."""
    return Path(root) / f"{PREFIX}{step:06d}"


def atomic_dir(final: Path) -> Path:
    """A fresh temporary sibling of ``final``; :func:`commit_dir` renames it into place."""
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit_dir(tmp: Path, final: Path) -> None:
    """Mark ``tmp`` complete and rename it to ``final`` (replacing an older folder of that name)."""
    (tmp / "COMPLETE").write_text("ok\n")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoint folders under ``root``, oldest first (half-written ``.tmp`` ones excluded)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [
        (int(p.name[len(PREFIX) :]), p)
        for p in root.iterdir()
        if p.name.startswith(PREFIX) and p.name[len(PREFIX) :].isdigit() and (p / "COMPLETE").is_file()
    ]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | Path) -> Path | None:
    ckpts = complete_checkpoints(root)
    return ckpts[-1] if ckpts else None


def prune_checkpoints(root: str | Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` complete checkpoints (a stale ``.tmp`` folder is replaced by
    the next save to the same step)."""
    for p in complete_checkpoints(root)[: -max(1, keep_last)]:
        shutil.rmtree(p, ignore_errors=True)


def resume_path(root: str | Path, resume: str, key: str = "train.resume") -> Path | None:
    """The checkpoint to resume from: ``never`` -> None, ``auto`` -> the newest complete one under ``root``
    (None when there is none), anything else a checkpoint folder that must be complete."""
    if resume == "never":
        return None
    if resume == "auto":
        return latest_checkpoint(root)
    path = Path(resume)
    if not (path / "COMPLETE").is_file():
        raise FileNotFoundError(f"{key}={resume}: not a complete checkpoint folder (no COMPLETE marker)")
    return path


def save_checkpoint(strategy: Any, root: str | Path, step: int, client_state: dict[str, Any], keep_last: int) -> Path:
    """The strategy's checkpoint of ``step`` under ``root`` (all ranks), then older ones pruned (rank 0)."""
    path = checkpoint_dir(root, step)
    strategy.save_checkpoint(path, client_state)
    if strategy.is_rank0:
        prune_checkpoints(root, keep_last)
    strategy.barrier()
    return path
