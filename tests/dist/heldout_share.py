"""Held-out evaluation of 5 records, alone or on 2 ranks (``torchrun --nproc_per_node=2``, FSDP2: a sharded model
that generates in lockstep), through ``vlrft.trainer.supervised_run.greedy_accuracy`` (train-sft's held-out
accuracy: ``vlrft.sampling.share_over_ranks`` and the eval harness), and the harness itself
on this rank's share. Each rank writes the records it counted, the
problems the harness counted and the all-reduced total to ``OUT_DIR/rank{R}.json``.
Usage: python heldout_share.py MODEL_DIR OUT_DIR [STRATEGY]
"""

import json
import sys
from pathlib import Path

from data_pipelines.synthetic import make_prompt_records
from eval.benchmarks import user_benchmark
from eval.runner import evaluate
from vlrft.config import load_config
from vlrft.models.loading import load_model
from vlrft.rollout import RolloutConfig, make_engine
from vlrft.sampling import share_over_ranks
from vlrft.strategies import finish_process, make_strategy
from vlrft.trainer.supervised_config import SFTTrainConfig
from vlrft.trainer.supervised_run import greedy_accuracy


def main() -> None:
    model_dir, out_dir = sys.argv[1:3]
    name = sys.argv[3] if len(sys.argv) > 3 else "single"
    cfg = load_config(SFTTrainConfig, None, [f"strategy.name={name}", "train.eval_batch_size=2"])
    strategy = make_strategy(cfg.strategy, cfg.optim)
    model, processor = load_model(model_dir)
    strategy.prepare(model, total_steps=1)
    records = make_prompt_records("color", 5, seed=3)
    mine, counted = share_over_ranks(records, strategy.rank, strategy.world_size)
    got = greedy_accuracy(strategy, processor, records, cfg)
    engine = make_engine(
        RolloutConfig.on_model(micro_batch_size=2),
        strategy.unwrap(),
        processor,
        synced=strategy.shards_parameters,
        device=strategy.device,
    )
    harness = evaluate(
        strategy.unwrap(),
        processor,
        mine,
        user_benchmark("heldout", "vocab_answer"),
        max_new_tokens=4,
        engine=engine,
        uncounted=len(mine) - counted,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    row = {"ids": [r.id for r in mine[:counted]], "num_problems": harness["num_problems"], "total": got["n"]}
    (out / f"rank{strategy.rank}.json").write_text(json.dumps(row))


if __name__ == "__main__":
    sys.exit(finish_process(main() or 0))
