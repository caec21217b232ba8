"""Checkpoint folders of a run, for every trainer: ``<root>/step-NNNNNN``.

A checkpoint is written into a fresh ``.tmp`` sibling and renamed into place with a ``COMPLETE`` marker
(:func:`atomic_dir`, :func:`commit_dir`; the strategies fill the folder), so a crash at any point leaves
the previous checkpoints intact. Before ``COMPLETE``, ``MANIFEST.json`` lists every file with its size and
sha256 and the run id of the run folder (``RUN.json``, see ``vlrft.run_folder``). ``resume=auto`` takes the
newest complete checkpoint that verifies, falling back to the previous one and saying which and why; an
explicit checkpoint that is incomplete or fails verification is refused (:class:`CheckpointError`). Older
checkpoints of the same run id are pruned to ``keep_last``; another run's checkpoints are never touched.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import resource
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

from vlrft.errors import CheckpointError, StorageError

PREFIX = "step-"
MANIFEST = "MANIFEST.json"
RUN_FILE = "RUN.json"  # in the run folder: the run id (lineage) its checkpoints carry


def run_id(run_dir: str | Path) -> str | None:
    """The run id recorded in ``run_dir/RUN.json`` (None when there is none)."""
    path = Path(run_dir) / RUN_FILE
    try:
        return json.loads(path.read_text()).get("run_id")
    except (OSError, ValueError):
        return None


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(folder: Path, run: str | None) -> None:
    """``MANIFEST.json``: every file of ``folder`` (relative path, size, sha256) and the run id."""
    files = {
        str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": _sha256(p)}
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name not in (MANIFEST, "COMPLETE")
    }
    (folder / MANIFEST).write_text(json.dumps({"run_id": run, "files": files}, indent=1) + "\n")


def manifest_run_id(path: Path) -> str | None:
    try:
        return json.loads((Path(path) / MANIFEST).read_text()).get("run_id")
    except (OSError, ValueError):
        return None


def verify_checkpoint(path: str | Path) -> str | None:
    """Why ``path`` cannot be resumed from (None when it is complete and every file matches its manifest)."""
    path = Path(path)
    if path.name.endswith(".tmp") or not (path / "COMPLETE").is_file():
        return "incomplete: no COMPLETE marker (a save that never finished)"
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except FileNotFoundError:
        return None  # written before manifests existed: complete, not verifiable
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"unreadable {MANIFEST} ({exc})"
    for rel, meta in files.items():
        f = path / rel
        if not f.is_file():
            return f"{rel} is missing"
        if f.stat().st_size != meta["size"]:
            return f"{rel} has {f.stat().st_size} bytes, the manifest says {meta['size']}"
        if _sha256(f) != meta["sha256"]:
            return f"{rel} does not match its sha256 in {MANIFEST}"
    return None


def checkpoint_dir(root: str | Path, step: int) -> Path:
    """The folder of the checkpoint taken after ``step`` optimizer steps."""
    return Path(root) / f"{PREFIX}{step:06d}"


def checkpoint_step(path: str | Path) -> int:
    """The step of a checkpoint folder (the inverse of :func:`checkpoint_dir`)."""
    return int(Path(path).name[len(PREFIX) :])


def remove_path(path: Path) -> None:
    """Delete ``path`` whatever it is (a folder with its contents, a file, a link; nothing when absent)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def atomic_dir(final: Path) -> Path:
    """A fresh temporary sibling of ``final``; :func:`commit_dir` renames it into place."""
    tmp = final.with_name(final.name + ".tmp")
    remove_path(tmp)
    tmp.mkdir(parents=True)
    return tmp


def commit_dir(tmp: Path, final: Path) -> None:
    """Write the manifest, mark ``tmp`` complete and rename it to ``final`` (replacing an older folder of that
    name). The run id is read from the run folder holding the checkpoints folder."""
    write_manifest(tmp, run_id(final.parent.parent))
    (tmp / "COMPLETE").write_text("ok\n")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


# what a refused write is called by the OS (Python's OSError, and the text Rust and C++ writers such as
# safetensors and torch.save put in their own exceptions)
_STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
# torch.save's zip writer loses the errno: it reports a short write as one of these
_TORCH_SHORT_WRITE = ("unexpected pos", "file write failed", "PytorchStreamWriter failed writing")


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, its causes and contexts, and the per-rank failures torch.distributed.checkpoint collects."""
    seen: set[int] = set()
    todo = [exc]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        for failure in (getattr(e, "failures", None) or {}).values():  # dcp's CheckpointException
            todo.append(getattr(failure, "exc", failure) if isinstance(failure, BaseException) else None)


def storage_failure(exc: BaseException) -> str | None:
    """Why a write failed when the storage refused it (full, over quota, over the file-size limit), in words;
    None for any other failure."""
    for e in _causes(exc):
        if isinstance(e, OSError) and e.errno in _STORAGE_ERRNOS:
            return os.strerror(e.errno)
        text = str(e)
        for code in _STORAGE_ERRNOS:
            if os.strerror(code) in text:
                return os.strerror(code)
        if any(m in text for m in _TORCH_SHORT_WRITE):
            return f"a short write ({text.strip().splitlines()[-1][:120]})"
    return None


@contextmanager
def storage_guard(what: str, tmp: Path, after: Callable[[], str]) -> Iterator[None]:
    """Turn a write the storage refused inside the block into one :class:`StorageError` line naming ``what``,
    the reason and the space left, with ``after()`` (what is intact, what to do; asked only on such a failure);
    the half-written ``tmp`` is removed so that its space is free again."""
    try:
        yield
    except Exception as exc:
        why = storage_failure(exc)
        if why is None:
            raise
        try:
            remove_path(tmp)
        except OSError:
            pass
        place = next((p for p in [tmp, *tmp.parents] if p.exists()), Path("."))
        room = f"{shutil.disk_usage(place).free / 2**20:.0f} MiB free on the disk of {place}"
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY:
            room += f", files limited to {limit} bytes by ulimit -f"
        raise StorageError(f"{what}: not written: {why} ({room}); {after()}") from exc


def complete_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoint folders under ``root``, oldest first (half-written ``.tmp`` ones excluded)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [
        (checkpoint_step(p), p)
        for p in root.iterdir()
        if p.name.startswith(PREFIX) and p.name[len(PREFIX) :].isdigit() and (p / "COMPLETE").is_file()
    ]
    return [p for _, p in sorted(found)]


def latest_checkpoint(root: str | Path) -> Path | None:
    ckpts = complete_checkpoints(root)
    return ckpts[-1] if ckpts else None


def prune_checkpoints(root: str | Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` complete checkpoints of this run's lineage (the run id in
    ``RUN.json``); checkpoints of another run id are never deleted. A stale ``.tmp`` folder is replaced by
    the next save to the same step."""
    root = Path(root)
    mine = run_id(root.parent)
    ours = [p for p in complete_checkpoints(root) if manifest_run_id(p) == mine and (p / MANIFEST).is_file()]
    for p in ours[: -max(1, keep_last)]:
        shutil.rmtree(p, ignore_errors=True)


def resume_path(
    root: str | Path, resume: str, key: str = "train.resume", log: Callable[[str], None] = print
) -> Path | None:
    """The checkpoint to resume from: ``never`` -> None; ``auto`` -> the newest complete checkpoint under
    ``root`` that verifies (None when there is none; a damaged newer one is skipped and ``log`` says which
    and why); anything else a checkpoint folder that must be complete and verify (else CheckpointError)."""
    if resume == "never":
        return None
    if resume == "auto":
        found = complete_checkpoints(root)
        for path in reversed(found):
            reason = verify_checkpoint(path)
            if reason is None:
                return path
            log(f"resume: skipping checkpoint {path}: {reason}")
        if found:
            raise CheckpointError(
                f"{key}=auto: no checkpoint under {root} verifies (each is listed above); "
                "set train.resume=never with train.overwrite=true to start again"
            )
        return None
    path = Path(resume)
    if not path.is_dir():
        raise CheckpointError(f"{key}={resume}: no such checkpoint folder")
    reason = verify_checkpoint(path)
    if reason is not None:
        raise CheckpointError(
            f"{key}={resume}: cannot resume from this checkpoint: {reason}; "
            "name a complete step-NNNNNN folder, or use train.resume=auto"
        )
    return path


def save_checkpoint(strategy: Any, root: str | Path, step: int, client_state: dict[str, Any], keep_last: int) -> Path:
    """The strategy's checkpoint of ``step`` under ``root`` (all ranks), then older ones pruned (rank 0)."""
    path = checkpoint_dir(root, step)

    def after() -> str:
        previous = latest_checkpoint(root)
        kept = f"the last complete checkpoint, {previous}, is intact" if previous else "no earlier checkpoint exists"
        return f"{kept}; free space (or lower train.keep_last) and run the same command again"

    with storage_guard(f"checkpoint {path}", path.with_name(path.name + ".tmp"), after):
        strategy.save_checkpoint(path, client_state)
    if strategy.is_rank0:
        prune_checkpoints(root, keep_last)
    strategy.barrier()
    return path
