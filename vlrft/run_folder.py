"""Run-folder ownership: one writer per run folder, one run (lineage) per folder.

:func:`run_in_folder` owns the folder for every trainer (``vlrft.loop.training_run`` wraps each run in it)::

    with run_in_folder(out, strategy, resume=cfg.train.resume, overwrite=cfg.train.overwrite, inputs=inputs):
        ...  # build, train, checkpoint, export

On entry (rank 0 decides, every rank gets the same verdict):
- ``LOCK`` (pid, host, boot id, process start time: ``vlrft.processes``) is created exclusively and touched
  every :data:`HEARTBEAT_S` while the run lasts. A live holder refuses the run with :class:`RunFolderError`
  naming the folder and the holder. A stale lock is taken over with a line saying why: on this host its
  process is gone (its pid dead, reused by another process, or the host restarted); from another host (a
  folder shared by the nodes of a cluster) its heartbeat is older than :data:`STALE_S`.
- A fresh run (``resume=never``, or ``auto`` with no complete checkpoint) into a folder that holds another
  run's outputs is refused unless ``overwrite`` (which clears the folder first), so logs are never mixed.
  One exception, so that the same command can simply be run again: ``resume=auto`` in a run folder whose
  run stopped before its first checkpoint (``RUN.json``, no checkpoint, no ``final/``) starts that run again
  (a new run id; its logs emptied), saying so.
- ``overwrite`` clears only a vlrft run folder (one with ``RUN.json``), never the current directory or one of its
  parents, nor a folder holding one of the run's inputs (model, data, config files: ``inputs``); this is decided
  before the lock is written, so a refused folder is left exactly as it was (:func:`check_clearable`). Even then it
  removes only what a run writes (:data:`RUN_OUTPUTS`): a file of the user's beside them (notes) is left, and
  counted in the line that says the folder was cleared.
- The filesystem root and the home folder itself are never a run folder (:func:`check_output_dir`, in every
  trainer's preflight, and :func:`check_clearable`): a run writes a dozen names into its folder, and clearing one
  could not tell them from the user's. The current directory may hold a run (``train.output_dir=.`` in an empty
  folder), though never cleared.
- ``RUN.json`` holds the run id: a fresh run gets a new one, a resumed run keeps it. Checkpoints carry it
  in their manifest and pruning deletes only checkpoints of this run id.
On exit (normal, exception, Ctrl-C) the lock is released; after a SIGKILL it is taken over by the next run.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import threading
import time
import uuid
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Iterator, Sequence

from vlrft import checkpoints
from vlrft.config import ConfigError
from vlrft.errors import RunFolderError
from vlrft.processes import gone, identity
from vlrft.tracking import truncate_run_logs

LOCK = "LOCK"
# the trial folder :func:`_writable_above` makes and removes at once; on a multi-rank run another rank's trial may
# be in the run folder while rank 0 lists it, so it is never counted as an output
WRITE_CHECK = ".vlrft-write-check-"


# what a run writes at the top of its folder (vlrft.loop, vlrft.tracking, vlrft.liveness, vlrft.models.tiny, the
# policy trainer's logs and critic): train.overwrite removes these and leaves anything else
RUN_OUTPUTS = frozenset(
    {
        checkpoints.RUN_FILE,
        LOCK,
        "PREEMPTED",
        ".liveness",
        "config.yaml",
        "metrics.jsonl",
        "samples.jsonl",
        "data_order.jsonl",
        "metrics.tmp",
        "samples.tmp",
        "data_order.tmp",
        "summary.json",
        "curves.png",
        "tensorboard",
        "wandb",
        "initial-model",
        "checkpoints",
        "critic_checkpoints",
        "final",
        "final.tmp",
        "final.old",
    }
)

HEARTBEAT_S = 15.0  # the lock holder touches LOCK this often
STALE_S = 120.0  # a lock from another host whose heartbeat is older than this is taken over


def _holder_gone(holder: dict, path: Path) -> str | None:
    """Why the lock's holder no longer runs (None while it may): on this host, its process (pid, boot and start
    time: :func:`vlrft.processes.gone`); on another host, a heartbeat older than :data:`STALE_S`."""
    if holder.get("host") == socket.gethostname():
        return gone(holder)
    age = time.time() - path.stat().st_mtime
    return f"no heartbeat for {age:.0f} s" if age > STALE_S else None


def acquire_lock(out: Path, log=print) -> dict:
    """Take ``out/LOCK`` for this process (taking over a stale one: its holder gone, its pid reused, or another
    host's heartbeat older than :data:`STALE_S`); returns what was written."""
    out.mkdir(parents=True, exist_ok=True)
    me = identity()
    path = out / LOCK
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            try:
                holder = json.loads(path.read_text())
                why = _holder_gone(holder, path) if holder else None
            except (OSError, ValueError):
                holder, why = {}, None
            if not holder and path.exists() and time.time() - path.stat().st_mtime < 5:  # being written right now
                time.sleep(0.2)
                continue
            if holder and why is None:
                beat = (
                    ""
                    if holder.get("host") == me["host"]
                    else (
                        f", heartbeat {time.time() - path.stat().st_mtime:.0f} s ago (taken over after {STALE_S:g} s)"
                    )
                )
                raise RunFolderError(
                    f"{out}: in use by pid {holder.get('pid')} on {holder.get('host')} since "
                    f"{holder.get('started')} ({path}{beat}); wait for that run to end or choose another "
                    "train.output_dir"
                )
            log(
                f"{out}: taking over the lock of pid {holder.get('pid')} on {holder.get('host')} "
                f"({why or 'unreadable'})"
            )
            path.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(me) + "\n")
        return me
    raise RunFolderError(f"{out}: could not take {path}; remove it if no run uses this folder")


def release_lock(out: Path) -> None:
    path = Path(out) / LOCK
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


@contextmanager
def heartbeat(out: Path, interval_s: float = HEARTBEAT_S) -> Iterator[None]:
    """Touch ``out/LOCK`` every ``interval_s`` while the block runs: a run on another host sharing the folder
    sees the holder alive (:data:`STALE_S`)."""
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(interval_s):
            try:
                os.utime(Path(out) / LOCK)
            except OSError:
                pass

    thread = threading.Thread(target=beat, name="vlrft-lock-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=1)


def _outputs(out: Path) -> list[str]:
    if not out.is_dir():
        return []
    return sorted(p.name for p in out.iterdir() if p.name != LOCK and not p.name.startswith(WRITE_CHECK))


def resuming(out: Path, resume: str) -> bool:
    """Whether a run into ``out`` with ``train.resume=resume`` continues a checkpoint (rather than starting fresh)."""
    return resume not in ("never", "auto") or (
        resume == "auto" and checkpoints.latest_checkpoint(out / "checkpoints") is not None
    )


def _places(path: Path) -> set[Path]:
    """``path`` as written (made absolute) and with its links resolved: either may lie inside a folder."""
    path = path.expanduser()
    return {Path(os.path.abspath(path)), path.resolve()}


def _input_place(value: str) -> Path | None:
    """The file or folder an input value names, if it exists (``file.py:fn`` names ``file.py``; a hub id or
    ``synthetic:TASK`` names nothing on disk)."""
    for candidate in (value, value.rsplit(":", 1)[0]):
        if candidate and Path(candidate).expanduser().exists():
            return Path(candidate)
    return None


def _named(key: str, path: str | Path) -> str:
    """How an error names a path option: ``train.output_dir=PATH`` (a config key), ``--out PATH`` (a flag)."""
    return f"{key} {path}" if key.startswith("-") else f"{key}={path}"


def never_a_run_folder(path: str | Path, key: str) -> None:
    """Raise a :class:`ConfigError` when ``path`` is the filesystem root or the home folder itself: a run writes a
    dozen names into its folder, among the system's or the user's own files there."""
    places = _places(Path(path))
    try:
        home = _places(Path.home())
    except RuntimeError:  # no home folder known
        home = set()
    if any(p == Path(p.anchor) for p in places):
        what = "the filesystem root"
    elif home & places:
        what = f"your home folder ({Path.home()})"
    else:
        return
    raise ConfigError(
        f"{_named(key, path)}: is {what}, never an output folder: vlrft writes its outputs (RUN.json, checkpoints, "
        f"final, metrics.jsonl, ...) into it beside what is there; give {key} a folder of its own, e.g. runs/NAME"
    )


def check_output_dir(path: str | Path, key: str, final: str | None = None) -> None:
    """``path`` can hold a run's outputs (a training run folder, an evaluation's ``--out``), checked before anything
    loads: a folder (or one that can be made: the nearest existing folder above it is no file, and a folder can be
    made in it: tried, not guessed from permission bits, which root and read-only filesystems defeat), neither the
    filesystem root nor the home folder, and no file where the folder ``final`` (the final model) goes."""
    out = Path(path).expanduser()
    where = _named(key, path)
    never_a_run_folder(path, key)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{where}: is a file, not a folder")
    if final is not None and (out / final).exists() and not (out / final).is_dir():
        raise ConfigError(
            f"{where}: {out / final} is a file, but the final model is written into a folder of that name; "
            f"remove or rename it, or choose another {key}"
        )
    _writable_above(out, where, key)


def check_output_file(path: str | Path, key: str) -> None:
    """``path`` can be written as a file when a command ends (``eval-reward-model --out``), checked before it starts:
    not a folder, and its folder exists or can be made, writable (as :func:`check_output_dir`)."""
    where = _named(key, path)
    file = Path(path).expanduser()
    if file.is_dir():
        raise ConfigError(f"{where}: is a folder; {key} names the file to write")
    _writable_above(file.absolute().parent, where, key)


def _writable_above(out: Path, where: str, key: str) -> None:
    """The nearest existing folder at or above ``out`` is a folder in which a folder can be made (tried: permission
    bits say nothing for root or on a read-only filesystem; the trial folder is removed at once)."""
    existing = next(p for p in (out, *out.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"{where}: {existing} is a file, so nothing can be written under it; choose another {key}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=WRITE_CHECK, dir=existing))
    except OSError as exc:
        raise ConfigError(
            f"{where}: {existing} is not writable ({exc.strerror or exc}); choose another {key}"
        ) from None


def _clear_refusal(out: Path, inputs: Sequence[tuple[str, str]], found: list[str]) -> tuple[str, str] | None:
    """Why ``train.overwrite`` may not clear ``out`` (the current directory or a parent of it, a folder holding one
    of ``inputs``, a folder without ``RUN.json``): (the reason in a few words, the whole one-line message), or
    ``None`` when it may."""
    rule = "train.overwrite=true clears only a run folder of its own"
    places = _places(out)
    here = Path.cwd()
    for cwd in _places(here):
        if cwd in places or places & set(cwd.parents):
            what = "the current directory" if cwd in places else f"a parent of the current directory ({here})"
            return f"it is {what}", (
                f"train.output_dir={out}: is {what}; {rule}, never the current directory or one above it; "
                "choose another train.output_dir (is a shell variable unset?)"
            )
    for key, value in inputs:
        path = _input_place(value)
        if path is None:
            continue
        for place in _places(path):
            if place in places or places & set(place.parents):
                return f"it holds {key}={value}", (
                    f"train.output_dir={out}: holds {key}={value}; {rule}, never a folder holding the run's "
                    "model, data or config; choose another train.output_dir"
                )
    if not (out / checkpoints.RUN_FILE).is_file():
        return f"no {checkpoints.RUN_FILE}: not a vlrft run folder", (
            f"train.output_dir={out}: holds {_listed(found)} but no {checkpoints.RUN_FILE}: it does not look like a "
            f"vlrft run folder, and {rule}; empty it yourself or choose another train.output_dir"
        )
    return None


def _listed(names: list[str]) -> str:
    return ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")


def check_clearable(out: Path, resume: str, overwrite: bool, inputs: Sequence[tuple[str, str]] = ()) -> None:
    """Raise when ``out`` can never hold a run (the filesystem root, the home folder: a ``ConfigError``), or a
    :class:`RunFolderError` when this run would clear ``out`` (``overwrite``, a fresh run, outputs there) and ``out``
    is the current directory or one of its parents, holds (is or contains) one of ``inputs`` (``(config key or
    "config file", path)`` pairs), or is not a vlrft run folder (no ``RUN.json``)."""
    out = Path(out)
    never_a_run_folder(out, "train.output_dir")
    found = _outputs(out)
    if not overwrite or not found or resuming(out, resume):
        return
    refusal = _clear_refusal(out, inputs, found)
    if refusal is not None:
        raise RunFolderError(refusal[1])


def restartable(out: Path, resume: str) -> bool:
    """``resume=auto`` into a vlrft run folder whose run stopped before its first checkpoint: no checkpoint
    (complete or not) and no ``final/``; nothing there is worth keeping, so the same command starts it again."""
    return (
        resume == "auto"
        and (out / checkpoints.RUN_FILE).is_file()
        and not (out / "final").exists()
        and not any((out / "checkpoints").glob(checkpoints.PREFIX + "*"))
    )


def claim(out: Path, resume: str, overwrite: bool, log=print, inputs: Sequence[tuple[str, str]] = ()) -> str:
    """Decide whether this run may write into ``out`` (lock already held; :func:`check_clearable` already
    passed); returns the run id. ``overwrite`` removes only :data:`RUN_OUTPUTS`, counting what it leaves."""
    if resuming(out, resume):
        run = checkpoints.run_id(out)
        if run is None:  # a folder written before run ids: its checkpoints stay untouched by pruning
            run = uuid.uuid4().hex[:12]
            (out / checkpoints.RUN_FILE).write_text(json.dumps({"run_id": run, "resumed": True}) + "\n")
        return run
    found = _outputs(out)
    if found and not overwrite and restartable(out, resume):
        truncate_run_logs(out, -1)  # every row: its step 0 evaluation is made again
        log(f"{out}: the run here stopped before its first checkpoint; starting it again from step 0")
        found = []
    if found and not overwrite:
        cont = (
            "use train.resume=auto to continue it, "
            if resume == "never" and checkpoints.latest_checkpoint(out / "checkpoints") is not None
            else ""
        )
        why = (
            "no complete checkpoint to continue from (train.resume=auto)"
            if resume == "auto"
            else f"this run starts fresh (train.resume={resume})"
        )
        refusal = _clear_refusal(out, inputs, found)
        if refusal is not None:  # train.overwrite would be refused too: offer only what works
            raise RunFolderError(
                f"{out}: holds {_listed(found)} and {why}; choose another train.output_dir (train.overwrite=true "
                f"would not clear it: {refusal[0]})"
            )
        raise RunFolderError(
            f"{out}: holds another run's outputs ({_listed(found)}) and "
            f"{why}; {cont}use train.overwrite=true to clear it, or another train.output_dir"
        )
    cleared = [name for name in found if name in RUN_OUTPUTS]
    left = [name for name in found if name not in RUN_OUTPUTS]
    for name in cleared:
        checkpoints.remove_path(out / name)
    if found:
        kept = f"; left {len(left)} not written by a vlrft run: {_listed(left)}" if left else ""
        log(f"{out}: cleared the previous run's outputs (train.overwrite=true){kept}")
    run = uuid.uuid4().hex[:12]
    meta = {"run_id": run, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": socket.gethostname()}
    (out / checkpoints.RUN_FILE).write_text(json.dumps(meta) + "\n")
    return run


@contextmanager
def run_in_folder(
    out: str | Path,
    strategy: Any,
    *,
    resume: str,
    overwrite: bool,
    inputs: Sequence[tuple[str, str]] = (),
    log=print,
) -> Iterator[str]:
    """Own ``out`` for the duration of the run (see the module docstring); yields the run id. ``inputs``:
    ``(config key, path)`` of what the run reads, which ``overwrite`` never clears."""
    out = Path(out)
    verdict: tuple[str | None, str | None] = (None, None)
    if strategy.is_rank0:
        try:
            check_clearable(out, resume, overwrite, inputs)  # before LOCK: a refused folder stays as it was
            acquire_lock(out, log)
            try:
                verdict = (claim(out, resume, overwrite, log, inputs), None)
            except RunFolderError:
                release_lock(out)
                raise
        except (RunFolderError, ConfigError) as exc:  # every rank gets the verdict: none waits for rank 0 alone
            verdict = (None, str(exc))
    run, error = strategy.all_gather_object(verdict)[0]
    if error is not None:
        raise RunFolderError(error)
    try:
        with heartbeat(out) if strategy.is_rank0 else nullcontext():
            yield run
    finally:
        if strategy.is_rank0:
            release_lock(out)
