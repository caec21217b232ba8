"""The one supervised training loop: SFT, DPO and the reward models (scalar RM, generative judge SFT).

Each trainer says what a batch is and what its loss is (a :class:`SupervisedTask`); this loop does the
rest, the same way for all of them and for every strategy (single, FSDP2, DeepSpeed):

- data order: a pure function of (seed, step) (:func:`batch_indices`), so a checkpoint needs only the
  strategy's state, the step and the RNG states to resume exactly (``resume=auto``);
- micro-batches: each rank splits its records into micro-batches; the loss of each is its SUM over units
  (target tokens, pairs ...) divided by the units of the whole step on all ranks (:func:`train_step`),
  so gradient accumulation and data parallelism give the gradient of one big batch;
- clipping and the optimizer step by the strategy; checkpoints through ``vlrft.checkpoints``;
- metrics through ``vlrft.tracking.Tracker``; held-out evaluation before and after training (and every
  ``eval_every`` steps); the final model exported in Hugging Face format.

Lower layer (``vlrft``): it imports no trainer, command or reward model, so ``reward_models`` uses it too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import torch

from vlrft import checkpoints
from vlrft.config import save_config
from vlrft.nonfinite import NonFiniteGuard
from vlrft.sampling import REWARD_ORDER_STRIDE, seeded_permutation
from vlrft.strategies import rng_state, set_rng_state
from vlrft.tracking import Tracker, truncate_run_logs


@dataclass
class LoopSettings:
    """What the loop needs from a trainer's config (each trainer maps its own keys onto these)."""

    output_dir: str
    max_steps: int
    batch_size: int  # records per step per process
    micro_batch_size: int = 0  # records per forward (0: the whole batch)
    seed: int = 0
    group_size: int = 1  # records kept together in one batch (a prompt's right and wrong candidate)
    log_every: int = 10
    eval_every: int = 0  # held-out evaluation every N steps besides before and after (0: never)
    save_every: int = 0
    keep_last: int = 2
    resume: str = "auto"
    max_nonfinite_steps: int = 5  # consecutive skipped (NaN/inf) steps before the run stops
    export_dir: str = "final"  # under output_dir: the Hugging Face model
    desc: str = "train"
    eval_before: bool = True
    console_keys: tuple[str, ...] | None = None


class SupervisedTask(Protocol):
    """What a trainer plugs into the loop."""

    def encode(self, records: list[Any]) -> dict[str, torch.Tensor]:
        """One micro-batch of records as tensors."""

    def units(self, batch: dict[str, torch.Tensor]) -> float:
        """How many loss units the batch holds (target tokens, pairs ...): the loss's denominator."""

    def loss(self, module: Any, batch: dict[str, torch.Tensor], total_units: float) -> tuple[torch.Tensor, dict]:
        """``(sum of the batch's per-unit losses / total_units, metrics)``; metrics are means over the batch."""


def batch_indices(
    n: int, step: int, batch_size: int, rank: int, world: int, seed: int, group_size: int = 1
) -> list[int]:
    """This rank's record indices at ``step``: consecutive slices of per-epoch permutations.

    With ``group_size`` g > 1, groups of g consecutive records (e.g. a prompt's right and wrong
    candidate) are permuted as units and stay next to each other (``batch_size`` should be a multiple of g).
    """
    n_groups = n // group_size
    global_bs = batch_size * world
    start = step * global_bs + rank * batch_size
    orders: dict[int, list[int]] = {}
    out = []
    for pos in range(start, start + batch_size):
        epoch, i = divmod(pos, n_groups * group_size)
        if epoch not in orders:
            orders[epoch] = seeded_permutation(n_groups, seed, epoch, stride=REWARD_ORDER_STRIDE)
        group, offset = divmod(i, group_size)
        out.append(orders[epoch][group] * group_size + offset)
    return out


def micro_batches(records: list[Any], size: int, group_size: int = 1) -> list[list[Any]]:
    """``records`` in consecutive chunks of ``size`` (0: one chunk), never splitting a group."""
    if size <= 0 or size >= len(records):
        return [records]
    size = max(group_size, size - size % group_size)
    return [records[i : i + size] for i in range(0, len(records), size)]


def train_step(strategy: Any, task: SupervisedTask, records: list[Any], settings: LoopSettings) -> dict[str, float]:
    """One optimizer step on this rank's ``records``: encode micro-batches, count the step's units over
    all ranks, accumulate ``loss * world_size`` (strategies average gradients over ranks), clip and step.

    Returns the step's metrics: ``loss`` (the exact global loss), ``grad_norm`` and the task's metrics
    averaged over micro-batches and ranks. Everything of one update is in this function (a guard on the
    update, e.g. against non-finite values, goes here).
    """
    batches = [task.encode(chunk) for chunk in micro_batches(records, settings.micro_batch_size, settings.group_size)]
    local = torch.tensor([float(task.units(b)) for b in batches], dtype=torch.float64).sum()
    total = float(strategy.all_reduce(local, op="sum"))
    module = strategy.train_module
    loss_sum = 0.0
    sums: dict[str, float] = {}
    for i, batch in enumerate(batches):
        loss, metrics = task.loss(module, batch, total)
        strategy.backward(loss * strategy.world_size, last_micro_batch=i == len(batches) - 1)
        loss_sum += float(loss.detach())
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + float(v) / len(batches)
    grad_norm = strategy.step()
    keys = sorted(sums)
    means = strategy.all_reduce(torch.tensor([sums[k] for k in keys], dtype=torch.float64), op="mean").tolist()
    out = dict(zip(keys, means))
    out["loss"] = float(strategy.all_reduce(torch.tensor(loss_sum, dtype=torch.float64), op="sum"))
    out["grad_norm"] = float(grad_norm)
    return out


def _save(strategy: Any, root: Path, step: int, keep_last: int, skipped: int) -> None:
    if not (checkpoints.checkpoint_dir(root, step) / "COMPLETE").is_file():  # a resumed finished run
        state = {"step": step, "rng": rng_state(), "nonfinite_skipped": skipped}
        checkpoints.save_checkpoint(strategy, root, step, state, keep_last)


def fit(
    strategy: Any,
    task: SupervisedTask,
    train: list[Any],
    settings: LoopSettings,
    cfg: Any,
    *,
    evaluate: Callable[[], dict[str, float]] | None = None,
    processor: Any = None,
    header: str = "",  # the first words of the start line (default: the record count)
) -> dict[str, Any]:
    """Train on ``train`` for ``settings.max_steps`` steps; returns ``steps``, ``eval_before``,
    ``eval_after``, ``last_train`` and ``resumed_from``.

    ``strategy`` must hold the prepared model. ``cfg`` is the run's resolved config (written to
    ``config.yaml``, given to the tracker). ``evaluate()`` runs on every rank and returns held-out
    metrics (logged under their own names). The model is exported to ``output_dir/export_dir``.
    """
    out = Path(settings.output_dir)
    ckpt_root = out / "checkpoints"
    start = 0
    resume = checkpoints.resume_path(ckpt_root, settings.resume, log=print if strategy.is_rank0 else (lambda _: None))
    guard = NonFiniteGuard(settings.max_nonfinite_steps)  # a NaN/inf step is skipped by the strategy, counted here
    if resume is not None:
        client = strategy.load_checkpoint(resume)
        start = client["step"]
        set_rng_state(client["rng"])
        guard.skipped = client.get("nonfinite_skipped", 0)
        if strategy.is_rank0:  # rows after the checkpoint belong to steps that will be redone
            truncate_run_logs(out, start)
    tracker = Tracker(
        out,
        cfg,
        strategy.is_rank0,
        start,
        settings.max_steps,
        desc=settings.desc,
        console_keys=settings.console_keys,
    )
    if strategy.is_rank0:
        save_config(cfg, out)
        tracker.print(
            f"{header or f'{len(train)} training records, '}world size {strategy.world_size}, "
            + (f"resumed from {resume}" if resume else "from scratch")
        )
    eval_before: dict[str, float] = {}
    if evaluate is not None and start == 0 and settings.eval_before:
        eval_before = evaluate()
        tracker.log(eval_before, 0)
    strategy.train_module.train()
    last: dict[str, float] = {}
    sums: dict[str, float] = {}
    n_acc, t0 = 0, time.time()
    for step in range(start, settings.max_steps):
        idx = batch_indices(
            len(train),
            step,
            settings.batch_size,
            strategy.rank,
            strategy.world_size,
            settings.seed,
            settings.group_size,
        )
        metrics = train_step(strategy, task, [train[i] for i in idx], settings)
        guard.observe(strategy)
        counted = guard.end_step(step + 1)  # {"train/nonfinite_skipped": run total}; raises after N in a row
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + v
        n_acc += 1
        done = step + 1
        tracker.advance(metrics["loss"])
        if done % settings.log_every == 0 or done == settings.max_steps:
            last = {f"train/{k}": v / n_acc for k, v in sorted(sums.items())}
            last["train/lr"] = strategy.lr
            last.update(counted)
            last["train/steps_per_s"] = n_acc / max(time.time() - t0, 1e-9)
            tracker.log(last, done)
            sums, n_acc, t0 = {}, 0, time.time()
        if evaluate is not None and settings.eval_every and done % settings.eval_every == 0:
            if done != settings.max_steps:
                tracker.log(evaluate(), done)
                strategy.train_module.train()
        if settings.save_every and done % settings.save_every == 0 and done != settings.max_steps:
            _save(strategy, ckpt_root, done, settings.keep_last, guard.skipped)
    eval_after = evaluate() if evaluate is not None else {}
    tracker.log(eval_after, settings.max_steps)
    _save(strategy, ckpt_root, settings.max_steps, settings.keep_last, guard.skipped)
    strategy.save_pretrained(out / settings.export_dir, processor)
    tracker.close()
    return {
        "steps": settings.max_steps,
        "eval_before": eval_before,
        "eval_after": eval_after,
        "last_train": last,
        "resumed_from": str(resume) if resume else None,
    }
