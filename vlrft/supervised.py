"""The supervised trainer: SFT, DPO and the reward models (scalar RM, generative judge SFT).

Each trainer says what a batch is and what its loss is (a :class:`SupervisedTask`); :class:`SupervisedTrainer`
does one optimizer step of it the same way for all of them and for every strategy (single, FSDP2,
DeepSpeed), and plugs into the one run driver (``vlrft.loop``: resume, cadence, checkpoints, export):

- data order: a pure function of (seed, step) (:func:`batch_indices`), so a checkpoint needs only the
  strategy's state, the step and the RNG states to resume exactly;
- micro-batches: each rank splits its records into micro-batches (a record count, or a token budget:
  ``vlrft.micro_batching``); the loss of each is its SUM over units (target tokens, pairs ...) divided by
  the units of the whole step on all ranks (:func:`train_step`), so gradient accumulation and data
  parallelism give the gradient of one big batch;
- clipping and the optimizer step by the strategy; the non-finite guard reads its verdict.

Lower layer (``vlrft``): it imports no trainer, command or reward model, so ``reward_models`` uses it too.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch

from vlrft.loop import Trainer
from vlrft.micro_batching import PAD, plan_micro_batches
from vlrft.nonfinite import NonFiniteGuard
from vlrft.sampling import REWARD_ORDER_STRIDE, seeded_permutation


class SupervisedTask(Protocol):
    """What a trainer plugs into the loop."""

    def encode(self, records: list[Any]) -> dict[str, torch.Tensor]:
        """One micro-batch of records as tensors."""

    def units(self, batch: dict[str, torch.Tensor]) -> float:
        """How many loss units the batch holds (target tokens, pairs ...): the loss's denominator."""

    def loss(self, module: Any, batch: dict[str, torch.Tensor], total_units: float) -> tuple[torch.Tensor, dict]:
        """``(sum of the batch's per-unit losses / total_units, metrics)``; metrics are means over the batch."""

    def tokens(self, record: Any) -> int:
        """The tokens one record puts into a forward (images included): what ``train.micro_batch_tokens`` counts."""


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


def steps_per_episode(records: int, batch_size: int, world_size: int) -> int:
    """Optimizer steps in one pass over ``records`` when each of ``world_size`` ranks takes ``batch_size`` a step
    (:func:`batch_indices`'s epochs; ``vlrft.loop.Run.total_steps`` turns it into a run's length)."""
    return records // (batch_size * world_size)


def micro_batches(records: list[Any], size: int, group_size: int = 1) -> list[list[Any]]:
    """``records`` in consecutive chunks of ``size`` (0: one chunk), never splitting a group."""
    if size <= 0 or size >= len(records):
        return [records]
    size = max(group_size, size - size % group_size)
    return [records[i : i + size] for i in range(0, len(records), size)]


def token_micro_batches(
    strategy: Any, task: SupervisedTask, records: list[Any], budget: int, group_size: int = 1
) -> list[tuple[list[Any], float]]:
    """``records`` as micro-batches of at most ``budget`` tokens (``task.tokens``; a group of ``group_size``
    records is one unit), as many on every rank (``vlrft.micro_batching``): (records, loss weight 1, or 0 for
    a padding micro-batch run on the shortest group)."""
    groups = [records[i : i + group_size] for i in range(0, len(records), group_size)]
    tokens = [sum(task.tokens(r) for r in g) for g in groups]
    plan = plan_micro_batches(strategy, tokens, budget)
    shortest = groups[min(range(len(groups)), key=tokens.__getitem__)]
    return [([r for j in p for r in groups[j]], 1.0) if p != PAD else (shortest, 0.0) for p in plan]


def train_step(
    strategy: Any,
    task: SupervisedTask,
    records: list[Any],
    micro_batch_size: int = 0,
    group_size: int = 1,
    micro_batch_tokens: int = 0,
) -> dict[str, float]:
    """One optimizer step on this rank's ``records``: encode micro-batches (``micro_batch_size`` records, or up
    to ``micro_batch_tokens`` tokens each), count the step's units over all ranks, accumulate
    ``loss * world_size`` (strategies average gradients over ranks), clip and step.

    Returns the step's metrics: ``loss`` (the exact global loss), ``grad_norm`` and the task's metrics
    averaged over micro-batches and ranks. Everything of one update is in this function (a guard on the
    update, e.g. against non-finite values, goes here).
    """
    if micro_batch_tokens:
        chunks = token_micro_batches(strategy, task, records, micro_batch_tokens, group_size)
    else:
        chunks = [(chunk, 1.0) for chunk in micro_batches(records, micro_batch_size, group_size)]
    batches = [(task.encode(chunk), weight) for chunk, weight in chunks]
    local = torch.tensor([float(task.units(b)) * w for b, w in batches], dtype=torch.float64).sum()
    total = float(strategy.all_reduce(local, op="sum"))
    module = strategy.train_module
    loss_sum = 0.0
    sums: dict[str, float] = {}
    real = sum(1 for _, w in batches if w)
    for i, (batch, weight) in enumerate(batches):
        loss, metrics = task.loss(module, batch, total)
        strategy.backward(loss * (strategy.world_size * weight), last_micro_batch=i == len(batches) - 1)
        if not weight:  # a padding micro-batch: it only kept the ranks in step
            continue
        loss_sum += float(loss.detach())
        for k, v in metrics.items():
            sums[k] = sums.get(k, 0.0) + float(v) / real
    grad_norm = strategy.step()
    keys = sorted(sums)
    means = strategy.all_reduce(torch.tensor([sums[k] for k in keys], dtype=torch.float64), op="mean").tolist()
    out = dict(zip(keys, means))
    out["loss"] = float(strategy.all_reduce(torch.tensor(loss_sum, dtype=torch.float64), op="sum"))
    out["grad_norm"] = float(grad_norm)
    return out


class SupervisedTrainer(Trainer):
    """A :class:`SupervisedTask` on ``records``, ``batch_size`` records per rank and step (micro-batched),
    evaluated by ``evaluate`` (held-out metrics without ``eval/``; None: no held-out data)."""

    progress_metric = ("loss", "train/loss")
    curve_keys = ("train/loss",)

    def __init__(
        self,
        strategy: Any,
        task: SupervisedTask,
        records: list[Any],
        *,
        batch_size: int,
        seed: int,
        guard: NonFiniteGuard,
        micro_batch_size: int = 0,
        micro_batch_tokens: int = 0,
        group_size: int = 1,
        evaluate: Callable[[], dict[str, float]] | None = None,
        console_keys: tuple[str, ...] | None = None,
    ):
        self.strategy, self.task, self.records = strategy, task, records
        self.batch_size, self.seed, self.guard = batch_size, seed, guard
        self.micro_batch_size, self.micro_batch_tokens, self.group_size = (
            micro_batch_size,
            micro_batch_tokens,
            group_size,
        )
        self._evaluate, self.console_keys = evaluate, console_keys

    def step(self, step: int) -> dict[str, float]:
        s = self.strategy
        s.train_module.train()
        idx = batch_indices(len(self.records), step, self.batch_size, s.rank, s.world_size, self.seed, self.group_size)
        records = [self.records[i] for i in idx]
        metrics = train_step(s, self.task, records, self.micro_batch_size, self.group_size, self.micro_batch_tokens)
        self.guard.observe(s)
        return {f"train/{k}": v for k, v in metrics.items()}

    def evaluate(self) -> dict[str, float]:
        return self._evaluate() if self._evaluate is not None else {}

    def state_dict(self) -> dict[str, Any]:
        """The task's state (a task with a ``state_dict``: the DPO reference's cached log-probs)."""
        return {"task": self.task.state_dict()} if hasattr(self.task, "state_dict") else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if hasattr(self.task, "load_state_dict"):
            self.task.load_state_dict(state.get("task", {}))
