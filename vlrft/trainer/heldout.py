"""Held-out evaluation during ``train-policy``: the eval harness (``eval.runner.evaluate``) run through the
trainer's own rollout engine on each rank's share, its metrics averaged over ranks."""

from __future__ import annotations

import torch

from data_pipelines.records import PromptRecord
from eval.benchmarks import user_benchmark
from eval.runner import evaluate
from vlrft.rollout.trajectories import TrajectoryRunner
from vlrft.strategies.base import mean_over_ranks


def heldout_eval(trainer, records: list[PromptRecord] | None = None) -> dict[str, float]:
    """Held-out evaluation with the eval harness (``eval.runner.evaluate``) through the trainer's rollout
    engine: ``train.eval_n`` responses per prompt at ``train.eval_temperature``, scored by the accuracy
    source's verifier. Each rank evaluates its share; scalar metrics are averaged weighted by problems."""

    cfg, s = trainer.cfg, trainer.strategy
    records = trainer.eval_records if records is None else records
    # sharded models generate in lockstep: every rank must make the same number of generate calls
    records = records[: len(records) - len(records) % s.world_size]
    mine = records[s.rank :: s.world_size]
    bench = user_benchmark("heldout", trainer.accuracy_verifier, cfg.data.prompt_template)
    runs = {"": trainer.trajectories}
    if trainer.trajectories is not None and cfg.tools.eval_withheld:  # what the accuracy owes to the tools' answers
        runs["withheld/"] = TrajectoryRunner(trainer.engine, trainer.processor, trainer.tools, cfg.tools, withheld=True)
    metrics = {}
    for prefix, trajectories in runs.items():
        got = evaluate(
            trainer.strategy.unwrap(),
            trainer.processor,
            mine,
            bench,
            n=cfg.train.eval_n,
            temperature=cfg.train.eval_temperature,
            max_new_tokens=cfg.rollout.max_new_tokens,
            batch_size=cfg.rollout.micro_rollout_batch_size,
            seed=cfg.train.seed,
            system_prompt=cfg.data.system_prompt or None,
            engine=trainer.engine,
            trajectories=trajectories,
        )
        metrics.update({prefix + k: v for k, v in got.items() if prefix == "" or k != "num_problems"})
    count = float(metrics["num_problems"])
    numeric = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and k != "num_problems"}
    # a rank may lack a count (a tool none of its trajectories called): 0 there
    reduced = mean_over_ranks(s, numeric, weight=count, missing="zero")
    return {"num_prompts": float(s.all_reduce(torch.tensor(count), "sum")), **reduced}
