"""Metrics of training runs (rank 0): ``metrics.jsonl``, TensorBoard, wandb (offline unless
configured), a tqdm progress bar with ETA and a compact console line per step. Shared by
``vlrft train-policy`` and ``vlrft train-reward-model``.

When stderr is not a terminal (a scheduler's log file), there is no bar: one plain line with the step,
ETA and the main metrics goes to stderr at the first and last step and every ``logging.log_every_s``
seconds in between, instead of carriage-return frames and a line per step."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from vlrft.config import option


@dataclass
class LoggingConfig:
    """Where metrics go (rank 0 only)."""

    tensorboard: bool = option(True, "write TensorBoard event files under output_dir/tensorboard")
    wandb: str = option(
        "offline",
        "wandb mode (offline: files under output_dir/wandb, sync later)",
        choices=("offline", "online", "disabled"),
    )
    wandb_project: str = option("vlrft", "wandb project")
    progress_bar: bool = option(True, "tqdm progress bar with ETA (plain lines when stderr is not a terminal)")
    log_every_s: float = option(
        30.0, "stderr not a terminal: seconds between plain progress lines (first and last step always)", ge=0
    )


class Tracker:
    """``log(metrics, step)`` to every sink; ``console_keys`` limit the console line (exact names, or
    prefixes ending in ``/`` or ``@``)."""

    def __init__(
        self,
        out_dir: Path,
        cfg: Any,
        active: bool,
        start_step: int,
        total_steps: int,
        desc: str = "train",
        console_keys: tuple[str, ...] | None = None,
    ):
        self.active = active
        self.console_keys = console_keys
        self.out = Path(out_dir)
        self.tb = self.wandb = self.bar = None
        self.plain = False
        if not active:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        log = cfg.logging
        if log.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.out / "tensorboard"))
        if log.wandb != "disabled":
            os.environ.setdefault("WANDB_SILENT", "true")  # no banner and run summary on the console
            import wandb

            self.exit_hooks = sys.exit, sys.excepthook  # wandb replaces both and never puts them back
            self.wandb = wandb.init(
                project=log.wandb_project,
                mode=log.wandb,
                dir=str(self.out),
                config=dataclasses.asdict(cfg),
                resume="allow",
            )
        if log.progress_bar and not sys.stderr.isatty():
            self.plain, self.desc, self.every = True, desc, log.log_every_s
            self.start = self.done = start_step
            self.total, self.t0, self.last_line, self.shown = total_steps, time.monotonic(), None, {}
        elif log.progress_bar:
            self.bar = tqdm(total=total_steps, initial=start_step, desc=desc, file=sys.stderr, dynamic_ncols=True)

    def print(self, text: str) -> None:
        if self.active:
            (self.bar.write if self.bar else print)(text)

    def advance(self, value: float, name: str = "loss") -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix({name: f"{value:.4f}"})
        if self.plain:
            self.done += 1
            now = time.monotonic()
            due = self.last_line is None or now - self.last_line >= self.every or self.done >= self.total
            if due:
                self.last_line = now
                sys.stderr.write(self.progress_line(now, {name: value, **self.shown}) + "\n")
                sys.stderr.flush()

    def progress_line(self, now: float, metrics: dict[str, float]) -> str:
        """``DESC step N/TOTAL (P%), elapsed H:MM:SS, ETA H:MM:SS: k=v, ...`` (plain progress line)."""
        elapsed = now - self.t0
        eta = elapsed / max(1, self.done - self.start) * max(0, self.total - self.done)
        pct = 100 * self.done / max(1, self.total)
        clock = lambda t: f"{int(t) // 3600}:{int(t) % 3600 // 60:02d}:{int(t) % 60:02d}"  # noqa: E731
        values = ", ".join(f"{k}={v:.4g}" for k, v in metrics.items())
        where = f"{self.desc} step {self.done}/{self.total} ({pct:.0f}%)"
        return f"{where}, elapsed {clock(elapsed)}, ETA {clock(eta)}: {values}"

    def log(self, metrics: dict[str, float], step: int) -> None:
        if not self.active or not metrics:
            return
        with open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                self.tb.add_scalar(k, v, step)
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        shown = {
            k: v
            for k, v in metrics.items()
            if self.console_keys is None
            or any(k == c or (c.endswith(("/", "@")) and k.startswith(c)) for c in self.console_keys)
        }
        if self.plain:  # shown on the next plain progress line
            self.shown.update(shown)
        elif shown:
            self.print(f"step {step}: " + ", ".join(f"{k}={v:.4g}" for k, v in shown.items()))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()
            sys.exit, sys.excepthook = self.exit_hooks  # later code (user code, a next run) meets Python's own


def append_jsonl(path: Path, row: dict) -> None:
    """Append one JSON row to a ``.jsonl`` log."""
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


RUN_LOGS = ("metrics.jsonl", "samples.jsonl", "data_order.jsonl")


def _rows(path: Path) -> list[tuple[str, dict]]:
    """The JSON rows of a ``.jsonl`` log; a line that is not JSON (a write torn by a kill) is dropped."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append((line, row))
    return rows


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Keep the rows of steps <= ``last_step`` (rows are JSON objects with a ``step``): on resume, the rows
    of steps after the checkpoint belong to steps that will be redone. Torn lines are dropped."""
    if not path.is_file():
        return
    keep = [line for line, row in _rows(path) if row.get("step", 0) <= last_step]
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    tmp.replace(path)


def truncate_run_logs(out_dir: Path, last_step: int) -> None:
    """:func:`truncate_jsonl` on every JSONL log of a run folder (on resume, rank 0)."""
    for name in RUN_LOGS:
        truncate_jsonl(Path(out_dir) / name, last_step)


def image_refs(images: list[Any]) -> list[str]:
    """How a log names a record's images: the path, or the PIL image's file name, or its type and size."""
    refs = []
    for im in images:
        if isinstance(im, (str, Path)):
            refs.append(str(im))
        else:
            refs.append(getattr(im, "filename", "") or f"<{type(im).__name__} {getattr(im, 'size', '')}>")
    return refs


def video_refs(videos: list[Any]) -> list[str]:
    """How a log names a record's videos: the file's path, or a frame list's first frame and its length."""
    return [
        f"{image_refs(v[:1])[0]} (+{len(v) - 1} frames)" if isinstance(v, (list, tuple)) else str(v) for v in videos
    ]
