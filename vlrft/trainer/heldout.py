"""Held-out evaluation during ``train-policy``: the eval harness (``eval.runner.evaluate``) run through the
trainer's own rollout engine on each rank's share (``vlrft.sampling.share_over_ranks``: every record scored once),
its metrics averaged over ranks. What it needs from the trainer comes through one method,
``PolicyTrainer.heldout_context()``, never by reading the trainer's attributes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from data_pipelines.records import PromptRecord
from eval.benchmarks import user_benchmark
from eval.runner import evaluate
from vlrft.rollout.trajectories import TrajectoryRunner
from vlrft.sampling import share_over_ranks
from vlrft.strategies.numerics import mean_over_ranks


@dataclass
class HeldoutContext:
    """What held-out evaluation takes from a policy trainer: its strategy, processor and engine, the held-out
    records, the accuracy verifier, the trajectory runners by metric prefix (``""``: the trained way, ``None`` for
    single-turn; ``"withheld/"``: tools' answers withheld), and the run's config (``train.eval_*``, ``rollout``,
    ``data``)."""

    strategy: Any
    processor: Any
    engine: Any
    records: list[PromptRecord]
    verifier: str
    runs: dict[str, TrajectoryRunner | None]
    cfg: Any


def heldout_eval(trainer: Any, records: list[PromptRecord] | None = None) -> dict[str, float]:
    """Held-out evaluation with the eval harness (``eval.runner.evaluate``) through the trainer's rollout
    engine: ``train.eval_n`` responses per prompt at ``train.eval_temperature``, scored by the accuracy
    source's verifier. Each rank evaluates its share; scalar metrics are averaged weighted by problems."""
    ctx: HeldoutContext = trainer.heldout_context()
    cfg, s = ctx.cfg, ctx.strategy
    mine, counted = share_over_ranks(ctx.records if records is None else records, s.rank, s.world_size)
    bench = user_benchmark("heldout", ctx.verifier, cfg.data.prompt_template)
    metrics: dict[str, Any] = {}
    for prefix, trajectories in ctx.runs.items():
        got = evaluate(
            s.unwrap(),
            ctx.processor,
            mine,
            bench,
            n=cfg.train.eval_n,
            temperature=cfg.train.eval_temperature,
            max_new_tokens=cfg.rollout.max_new_tokens,
            batch_size=cfg.rollout.micro_rollout_batch_size,
            seed=cfg.train.seed,
            system_prompt=cfg.data.system_prompt or None,
            engine=ctx.engine,
            trajectories=trajectories,
            uncounted=len(mine) - counted,
        )
        metrics.update({prefix + k: v for k, v in got.items() if prefix == "" or k != "num_problems"})
    count = float(metrics["num_problems"])
    numeric = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and k != "num_problems"}
    # a rank may lack a count (a tool none of its trajectories called): 0 there
    reduced = mean_over_ranks(s, numeric, weight=count, missing="zero")
    return {"num_prompts": float(s.all_reduce(torch.tensor(count), "sum")), **reduced}
