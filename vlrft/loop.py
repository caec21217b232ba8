"""The one run driver of every trainer (policy, SFT, DPO, scalar reward model, judge); its config sections are in
``vlrft.run_config``.

A trainer is a plug-in (:class:`Trainer`): ``step(i) -> metrics`` does optimizer step ``i`` (its data, its
loss, its collectives), ``evaluate() -> metrics`` measures held-out data, ``state_dict()`` /
``load_state_dict()`` carry what it needs beyond the strategy's weights and optimizer to resume exactly.
Everything around it happens here, once, the same way for all of them::

    with training_run(cfg, "train-sft") as run:        # strategy, run folder and its lock, ranks watched
        path = run.initial_model()                     # model.path, or a tiny random model written once
        trainer = MyTrainer(..., total_steps=run.total_steps(steps_per_episode), guard=run.guard)
        summary = run.fit(trainer, processor)          # resume, loop, eval/save cadence, export, summary

:meth:`Run.fit`: resume from the newest verified checkpoint (logs of redone steps dropped), held-out
evaluation before the first step, then per step: the trainer's step, the non-finite guard's verdict
(``train/nonfinite_skipped``), ``train/lr``, ``time/step``; metrics averaged over ``log_every`` steps to
``metrics.jsonl`` / TensorBoard / wandb (``train/steps_per_s``); evaluation every ``eval_every`` steps and
at the last step (logged as ``eval/<name>``, before that step's progress line, which shows it); checkpoints
every ``save_every`` steps and at the end; the model exported to ``final/`` and ``summary.json`` written.

Lower layer: it imports no trainer, command or reward model.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from data_pipelines.synthetic import synthetic_task
from vlrft import checkpoints
from vlrft.config import ConfigError, input_paths, save_config
from vlrft.errors import Preempted
from vlrft.liveness import watch_ranks
from vlrft.models.tiny import initial_model_path
from vlrft.nonfinite import NonFiniteGuard
from vlrft.outcome import BEST, BestModel, CollapseError, CollapsePolicy, best_json
from vlrft.run_config import resume_changes
from vlrft.run_folder import run_in_folder
from vlrft.strategies import make_strategy, rng_state, seed_everything, set_rng_state
from vlrft.summary import summary_json, write_summary
from vlrft.tracking import Tracker, truncate_run_logs
from vlrft.workers import worker_logs

CHECKPOINTS = "checkpoints"
FINAL = "final"
PREEMPTED = "PREEMPTED"  # written by a run stopped by a preemption signal, removed when the run continues


class Trainer:
    """What a trainer plugs into :meth:`Run.fit` (subclass it and override the four methods)."""

    progress_metric = ("loss", "train/loss")  # (name, metric) shown beside the progress bar
    console_keys: tuple[str, ...] | None = None  # the metrics a console line shows (None: all)
    curve_keys: tuple[str, ...] = ("train/loss",)  # plotted in curves.png

    def step(self, step: int) -> dict[str, float]:
        """Optimizer step ``step`` (0-based) on every rank; returns its metrics, the same on every rank."""
        raise NotImplementedError

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics (names without ``eval/``), the same on every rank; ``{}`` without held-out data."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """What resuming needs beyond the strategies' own state (data position, controllers ...)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` after the strategies' checkpoints are loaded."""

    def extra_strategies(self) -> dict[str, Any]:
        """Other strategies whose checkpoints go with the run's (folder name -> strategy; e.g. a critic)."""
        return {}

    best_metric: str | None = "accuracy"  # the held-out metric best/ follows unless train.best_metric names another

    def collapse_start(self, step: int) -> int | None:
        """After step ``step`` (1-based): the first step of a sustained collapse that holds now, or None (no trainer
        but the policy's detects one: ``vlrft.trainer.collapse``)."""
        return None


class Run:
    """One owned run folder and its strategy; :meth:`fit` drives a :class:`Trainer` in it."""

    def __init__(self, cfg: Any, strategy: Any, command: str, changes: list[tuple[str, Any, Any]] | None = None):
        self.cfg, self.strategy, self.command = cfg, strategy, command
        self.changes = changes or []  # config keys this resumed run changes (allowed: train.resume_changes)
        self.train = cfg.train
        self.out = Path(cfg.train.output_dir)
        self.guard = NonFiniteGuard(self.train.max_nonfinite_steps)  # trainers report into it; the loop counts
        self.tracker: Tracker | None = None
        self.stop_signal: str | None = None  # set by a preemption signal's handler (training_run)
        self.best = BestModel(self.train, None)  # fit() names the trainer's default metric
        self.collapse = CollapsePolicy(self.train)

    # ------------------------------------------------------------------ before the trainer exists
    def initial_model(self, tool_tokens: bool = False) -> str:
        """``model.path``, or a tiny random model written once to ``output_dir/initial-model`` (``tool_tokens``: one
        built for tool use, with Qwen's tool markup tokens)."""
        return initial_model_path(self.cfg.model, self.out, self.strategy, self.cfg.strategy.seed, tool_tokens)

    def total_steps(self, steps_per_episode: int) -> int:
        """``max_steps``, or ``num_episodes`` passes of ``steps_per_episode`` steps when it is 0."""
        return self.train.max_steps or max(1, steps_per_episode) * self.train.num_episodes

    def print(self, text: str) -> None:
        """One console line from rank 0 (beside the progress bar once the loop runs)."""
        if self.tracker is not None:
            self.tracker.print(text)
        elif self.strategy.is_rank0:
            print(text, flush=True)

    # ------------------------------------------------------------------ the loop
    def fit(self, trainer: Trainer, processor: Any, total_steps: int, header: str = "") -> dict[str, Any]:
        """Train ``trainer`` to ``total_steps`` (resuming where a checkpoint says), export and summarise;
        returns the summary (also in ``summary.json``)."""
        s, t, out = self.strategy, self.train, self.out
        self.best = BestModel(t, trainer.best_metric)
        start, history, resumed = self._resume(trainer)
        if s.is_rank0:
            (out / PREEMPTED).unlink(missing_ok=True)  # this run continues the preempted one
        self.tracker = Tracker(
            out, self.cfg, s.is_rank0, start, total_steps, desc=self.command, console_keys=trainer.console_keys
        )
        where = f"resumed from {resumed} at step {start}" if resumed else "from scratch"
        self.print(f"{header}world size {s.world_size}, {where}")
        if self._stopping():  # asked to stop while the run was being built: nothing new to save
            self.tracker.close()
            raise Preempted(f"stopped by {self.stop_signal or 'a signal'} before step {start + 1}; {self._again()}")
        eval_before = self._evaluate(trainer, 0, processor) if start == 0 else None
        eval_after = None
        sums: dict[str, float] = {}
        n_acc, t0 = 0, time.perf_counter()
        step = start
        while step < total_steps:
            t_step = time.perf_counter()
            metrics = trainer.step(step)
            metrics.update(self.guard.end_step(step + 1))  # raises after too many skipped steps in a row
            metrics["train/lr"] = s.lr
            metrics["time/step"] = time.perf_counter() - t_step
            done, last = step + 1, step + 1 == total_steps
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v
            n_acc += 1
            if done % t.log_every == 0 or last:
                row = {k: v / n_acc for k, v in sums.items()}
                row["train/steps_per_s"] = n_acc / max(time.perf_counter() - t0, 1e-9)
                self.tracker.log(row, done)
                history.append({"step": done, **row})
                sums, n_acc, t0 = {}, 0, time.perf_counter()
            if last or (t.eval_every and done % t.eval_every == 0):  # before the progress line, which shows it
                evaluated = self._evaluate(trainer, done, processor)
                if last:
                    eval_after = evaluated
            name, key = trainer.progress_metric
            self.tracker.advance(metrics.get(key, 0.0), name)
            begin = trainer.collapse_start(done) if self.collapse.mode != "warn" else None
            if begin is not None:
                step, history = self._on_collapse(trainer, done, begin)
                sums, n_acc, eval_after = {}, 0, None
                continue
            if not last and t.save_every and done % t.save_every == 0:
                self._save(trainer, done, history)
            if not last and self._stopping():
                self._preempt(trainer, done, total_steps, history)
            step = done
        self._save(trainer, total_steps, history)
        if eval_after is None:  # resumed at the end: no step ran
            eval_after = self._evaluate(trainer, total_steps, processor)
        final = out / FINAL
        summary = {
            "command": self.command,
            "steps": total_steps,
            "output_dir": str(out),
            "final_model": str(final),
            "eval_before": eval_before,
            "eval_after": eval_after,
            "last_metrics": history[-1] if history else {},
            "resumed_from": str(resumed) if resumed else None,
            "best": self._best_record(),
            "rollbacks": self.collapse.rollbacks,
        }
        self._export(final, processor, summary)
        self.tracker.close()
        if s.is_rank0:
            write_summary(out, summary, history, trainer.curve_keys)
        return summary

    def _export(self, final: Path, processor: Any, summary: dict[str, Any]) -> None:
        """The model (and ``summary.json`` beside it) written into ``final.tmp``, its manifest listing every file,
        then renamed into place: a half-written export never replaces a complete one."""

        def after() -> str:
            try:
                kept = json.loads((final / "summary.json").read_text())["steps"]
                kept = f"{final} still holds the model of step {kept}, as its summary.json says"
            except (OSError, ValueError, KeyError, TypeError):
                kept = f"{final} was not written"
            done = checkpoints.checkpoint_dir(self.out / CHECKPOINTS, summary["steps"])
            return f"{kept}; checkpoint {done} is complete: free space and run the same command again to export it"

        self._write_model(final, processor, {"summary.json": summary_json(summary)}, f"final model {final}", after)

    def _write_model(self, folder: Path, processor: Any, notes: dict[str, str], what: str, after: Any) -> None:
        """The model and ``notes`` (file name -> text) into ``folder.tmp`` with a manifest, renamed into place (all
        ranks: a sharded model is gathered)."""
        s, tmp, old = self.strategy, folder.with_name(folder.name + ".tmp"), folder.with_name(folder.name + ".old")
        if s.is_rank0:  # what a write that was cut off left behind
            checkpoints.atomic_dir(folder)
            checkpoints.remove_path(old)
        s.barrier()
        with checkpoints.storage_guard(what, tmp, after):
            s.save_pretrained(tmp, processor)
            if s.is_rank0:
                for name, text in notes.items():
                    (tmp / name).write_text(text)
                checkpoints.write_manifest(tmp, checkpoints.run_id(self.out))
        if s.is_rank0:
            if folder.exists():
                os.replace(folder, old)
            os.replace(tmp, folder)
            checkpoints.remove_path(old)
        s.barrier()

    # ------------------------------------------------------------------ what a run that goes wrong keeps
    def _best_record(self) -> dict[str, Any] | None:
        record = self.best.record()
        return {**record, "path": str(self.out / BEST)} if record else None

    def _offer_best(self, step: int, result: dict[str, float], processor: Any) -> None:
        """``best/`` rewritten when this evaluation (step ``step``) beats the best so far."""
        warning = self.best.missing(result)
        if warning:
            self.print(warning)
        if not self.best.offer(step, result):
            return
        folder = self.out / BEST
        self._write_model(
            folder, processor, {"best.json": best_json(self.best.record())}, f"best model {folder}", lambda: ""
        )

    def _on_collapse(self, trainer: Trainer, done: int, begin: int) -> tuple[int, list[dict[str, float]]]:
        """``train.on_collapse`` (stop or rollback) after step ``done``, the collapse having begun at step ``begin``;
        returns the step to continue from and the metrics history there."""
        c, t = self.collapse, self.train
        best = self._best_record()
        kept = f"best/ holds step {best['step']} ({best['metric']} {best['value']:.4g})" if best else "no best/"
        since = f"step {done}: a sustained answer collapse since step {begin}"
        if c.mode == "stop":
            self.tracker.close()
            raise CollapseError(f"{since}; train.on_collapse=stop ended the run; {kept}")
        if len(c.rollbacks) >= c.max_rollbacks:
            self.tracker.close()
            raise CollapseError(f"{since}, after {len(c.rollbacks)} rollbacks (train.max_rollbacks); {kept}")
        path = c.target(checkpoints.complete_checkpoints(self.out / CHECKPOINTS), begin)
        if path is None:
            self.tracker.close()
            raise CollapseError(
                f"{since}; train.on_collapse=rollback: no complete checkpoint from before it (train.save_every="
                f"{t.save_every}, keep_last={t.keep_last}); {kept}"
            )
        c.rollbacks.append({"at_step": done, "collapse_from": begin, "to_step": checkpoints.checkpoint_step(path)})
        to, history, _ = self._restore(trainer, path)  # the rollbacks are not taken from it: it predates them
        lr = self.cfg.optim.lr * c.lr_scale
        set_base_lr(self.strategy, lr)
        self.print(
            f"{since}: rollback {len(c.rollbacks)} of {c.max_rollbacks} to {path.name}, learning rate x"
            f"{c.factor:g} -> {lr:.3g} (train.on_collapse=rollback)"
        )
        return to, history

    # ------------------------------------------------------------------ preemption
    def _stopping(self) -> bool:
        """Whether any rank was asked to stop (every rank gets the same answer, so all stop after the same step)."""
        asked = self.stop_signal is not None
        if self.strategy.distributed:
            asked = bool(self.strategy.all_reduce(torch.tensor(float(asked)), "max"))
        return asked

    def _preempt(self, trainer: Trainer, done: int, total: int, history: list[dict[str, float]]) -> None:
        self._save(trainer, done, history)  # even with save_every=0
        self.tracker.close()
        where = checkpoints.checkpoint_dir(self.out / CHECKPOINTS, done)
        sig = self.stop_signal or "a signal on another rank"
        if self.strategy.is_rank0:  # what a job script reads to requeue (torchrun's own exit code is not 75)
            note = {"step": done, "total_steps": total, "checkpoint": str(where), "signal": sig}
            (self.out / PREEMPTED).write_text(json.dumps(note) + "\n")
        raise Preempted(f"stopped by {sig} after step {done}/{total}; checkpoint {where} is complete; {self._again()}")

    def _again(self) -> str:
        return "run the same command again to continue (train.resume=auto; exit code 75: requeue)"

    def _evaluate(self, trainer: Trainer, step: int, processor: Any) -> dict[str, float]:
        result = trainer.evaluate()
        self.tracker.log({f"eval/{k}": v for k, v in result.items()}, step)
        self._offer_best(step, result, processor)
        return result

    # ------------------------------------------------------------------ checkpoints
    def _save(self, trainer: Trainer, step: int, history: list[dict[str, float]]) -> None:
        root = self.out / CHECKPOINTS
        if (checkpoints.checkpoint_dir(root, step) / "COMPLETE").is_file():  # a resumed, finished run
            return
        keep = self.train.keep_last
        for folder, strategy in trainer.extra_strategies().items():  # first: a run checkpoint implies theirs
            checkpoints.save_checkpoint(strategy, self.out / folder, step, {"step": step}, keep)
        state = {
            "step": step,
            "rng": rng_state(),
            "nonfinite_skipped": self.guard.skipped,
            "history": history,
            "trainer": trainer.state_dict(),
            "best": self.best.state_dict(),
            "collapse": self.collapse.state_dict(),
        }
        checkpoints.save_checkpoint(self.strategy, root, step, state, keep)

    def _resume(self, trainer: Trainer) -> tuple[int, list[dict[str, float]], Path | None]:
        """(first step to run, the metrics history so far, the checkpoint resumed from)."""
        path = checkpoints.resume_path(self.out / CHECKPOINTS, self.train.resume, log=self.print)
        if path is None:
            return 0, [], None
        step, history, state = self._restore(trainer, path)
        self.best.load_state_dict(state.get("best"))
        self.collapse.load_state_dict(state.get("collapse"))
        return step, history, path

    def _restore(self, trainer: Trainer, path: Path) -> tuple[int, list[dict[str, float]], dict[str, Any]]:
        """The run as checkpoint ``path`` left it: weights, optimizer, RNG, the trainer's state; logs of later steps
        dropped. Returns (its step, the metrics history to it, the checkpoint's run state)."""
        s = self.strategy
        state = s.load_checkpoint(path)
        if any(k.startswith("optim.") for k, _, _ in self.changes):  # allowed (train.resume_changes=allow)
            apply_optim(s, self.cfg.optim)
        for folder, strategy in trainer.extra_strategies().items():
            part = checkpoints.resume_path(self.out, str(self.out / folder / path.name), key=folder)
            strategy.load_checkpoint(part)
        set_rng_state(state["rng"])
        self.guard.skipped = state.get("nonfinite_skipped", 0)
        trainer.load_state_dict(state.get("trainer", {}))
        if s.is_rank0:  # logs written after the checkpoint belong to steps that will be redone
            truncate_run_logs(self.out, state["step"])
        s.barrier()
        return state["step"], list(state.get("history", [])), state


@contextmanager
def training_run(cfg: Any, command: str, preflight: Callable[[Any], Any] | None = None) -> Iterator[Run]:
    """What every trainer wraps its whole run in: ``preflight(cfg)`` (the trainer's checks of its config, model
    folder, data and output folder, before anything heavy), the strategy of ``cfg.strategy`` / ``cfg.optim``, the folder
    ``cfg.train.output_dir`` owned for it (``vlrft.run_folder``, with ``train.resume`` and ``.overwrite``, which never
    clears the config's inputs: :func:`vlrft.config.input_paths`), the
    ranks watched (a lost rank stops the job naming it, ``vlrft.liveness``) and every RNG seeded from
    ``train.seed`` (plus the rank). Yields the :class:`Run`."""
    if preflight is not None:
        preflight(cfg)
    signals = preempt_signals(cfg.train.preempt_signals)
    changes = resume_changes(cfg)  # before anything loads: a refused change costs nothing
    strategy = make_strategy(cfg.strategy, cfg.optim)
    if changes and strategy.is_rank0:
        listed = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in changes)
        print(f"resume: config changed ({listed}); the new values apply from the resumed step", flush=True)
    d = cfg.data
    if strategy.is_rank0 and synthetic_task(d.eval_source) and not synthetic_task(d.train_source):
        print(f"note: training on {d.train_source} but evaluating on {d.eval_source} (data.eval_source)", flush=True)
    t = cfg.train
    run = Run(cfg, strategy, command, changes)
    inputs = input_paths(cfg)  # model, data, critic and reward-model paths: never cleared by train.overwrite
    with run_in_folder(t.output_dir, strategy, resume=t.resume, overwrite=t.overwrite, inputs=inputs):
        with watch_ranks(Path(t.output_dir) / ".liveness", strategy, cfg.strategy.heartbeat_timeout_s):
            with _on_signals(signals, run), worker_logs(Path(t.output_dir) / "logs" / "workers"):
                seed_everything(t.seed + strategy.rank)
                if strategy.is_rank0:
                    Path(t.output_dir).mkdir(parents=True, exist_ok=True)
                    save_config(cfg, t.output_dir)
                yield run


def rescheduled_optimizer(strategy: Any, why: str) -> tuple[torch.optim.Optimizer, Any]:
    """The strategy's torch-native optimizer and its LambdaLR schedule (single, FSDP2), whose settings may change
    mid-run; ``why`` names the setting that asks, in the error for any other."""
    opt, sched = strategy.optimizer, strategy.scheduler
    if not isinstance(opt, torch.optim.Optimizer) or not isinstance(sched, torch.optim.lr_scheduler.LambdaLR):
        raise ConfigError(f"{why} with this strategy ({strategy.name}): its optimizer's settings cannot change mid-run")
    return opt, sched


def set_base_lr(strategy: Any, lr: float) -> None:
    """The schedule's base learning rate set to ``lr`` (the current one follows the schedule from there)."""
    opt, sched = rescheduled_optimizer(strategy, "train.on_collapse=rollback")
    sched.base_lrs = [lr for _ in opt.param_groups]
    for group, factor in zip(opt.param_groups, sched.lr_lambdas):
        group.update(initial_lr=lr, lr=lr * factor(sched.last_epoch))


def apply_optim(strategy: Any, optim: Any) -> None:
    """The learning rate, betas, eps and weight decay of ``optim`` in a resumed optimizer (whose checkpoint carried
    the old ones) and its schedule; torch-native optimizers (single, FSDP2)."""
    opt, _ = rescheduled_optimizer(strategy, "train.resume_changes=allow: optim.* cannot change on resume")
    set_base_lr(strategy, optim.lr)
    for group in opt.param_groups:
        group.update(betas=tuple(optim.betas), eps=optim.eps, weight_decay=optim.weight_decay)


def preempt_signals(names: str) -> list[signal.Signals]:
    """``train.preempt_signals`` (``"SIGTERM,SIGUSR1"``) as signals; an unknown name is a ConfigError."""
    out = []
    for name in [n.strip().upper() for n in names.split(",") if n.strip()]:
        name = name if name.startswith("SIG") else f"SIG{name}"
        if name not in signal.Signals.__members__ or name in ("SIGKILL", "SIGSTOP"):
            raise ConfigError(f"train.preempt_signals={names!r}: {name} is not a signal a run can catch")
        out.append(signal.Signals[name])
    return out


@contextmanager
def _on_signals(signals: list[signal.Signals], run: Run) -> Iterator[None]:
    """While the run lives, ``signals`` ask it to stop after its current step (:meth:`Run.fit`), and so does a first
    Ctrl-C (SIGINT), as SIGTERM does: the run stops with a checkpoint (exit code 75) whatever ``train.save_every``;
    a second Ctrl-C stops it at once (``KeyboardInterrupt``: the steps after the last checkpoint are lost)."""
    if threading.current_thread() is not threading.main_thread():  # handlers only in the main thread
        yield
        return

    def ask(signum: int, frame: Any) -> None:
        run.stop_signal = run.stop_signal or signal.Signals(signum).name

    def ctrl_c(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the next one raises KeyboardInterrupt
        if run.stop_signal is None:
            run.stop_signal = "Ctrl-C (SIGINT)"
            if run.strategy.is_rank0:
                print("\nCtrl-C: stopping after this step with a checkpoint; Ctrl-C again to stop now", flush=True)

    previous = {sig: signal.signal(sig, ask) for sig in signals}
    if signal.SIGINT not in previous and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        previous[signal.SIGINT] = signal.signal(signal.SIGINT, ctrl_c)  # not when SIGINT is ignored (a background job)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
