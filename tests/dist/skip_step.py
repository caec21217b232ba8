"""A non-finite step under a strategy changes nothing: parameters and optimizer state (AdamW moments and
step count) bitwise equal before and after, scheduler not stepped; the next finite step applies.

Run alone (single) or under ``torchrun --nproc_per_node=2`` (fsdp2, deepspeed: each rank checks its own
shard). Usage: python skip_step.py MODEL_DIR OUT_JSON STRATEGY [STRATEGY ...]
"""

import json
import sys

import torch
from transformers import AutoModelForImageTextToText

import vlrft.models  # noqa: F401
from vlrft.strategies import OptimConfig, StrategyConfig, finish_process, make_strategy


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def snapshot(strategy) -> dict[str, torch.Tensor]:
    """This rank's parameters and every tensor of its optimizer state, copied."""
    snap = {f"param/{i}": _local(p.detach()).clone() for i, p in enumerate(strategy.unwrap().parameters())}
    opt = strategy.optimizer
    inner = getattr(opt, "optimizer", opt)  # DeepSpeed's ZeRO optimizer wraps a torch AdamW
    for i, state in enumerate(inner.state.values()):
        for k, v in state.items():
            snap[f"optim/{i}/{k}"] = _local(v).clone() if torch.is_tensor(v) else torch.tensor(float(v))
    return snap


def one_step(strategy, scale: float) -> float:
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]], device=strategy.device)
    loss = strategy.train_module(input_ids=ids, labels=ids).loss * scale
    strategy.backward(loss)
    return strategy.step()


def check(model_dir: str, name: str) -> dict:
    strategy = make_strategy(StrategyConfig(name=name, zero_stage=2, grad_clip=1.0), OptimConfig(lr=1e-3))
    torch.manual_seed(0)
    strategy.prepare(AutoModelForImageTextToText.from_pretrained(model_dir), total_steps=10)
    one_step(strategy, 1.0)  # moments and step count exist
    before, lr_before = snapshot(strategy), strategy.lr
    norm = one_step(strategy, float("nan"))
    skipped, quantity = strategy.last_step_skipped, strategy.nonfinite_quantity
    after = snapshot(strategy)
    equal = sorted(before) == sorted(after) and all(torch.equal(before[k], after[k]) for k in before)
    one_step(strategy, 1.0)
    applied = not strategy.last_step_skipped and not all(
        torch.equal(before[k], v) for k, v in snapshot(strategy).items() if k.startswith("param/")
    )
    return {
        "skipped": skipped,
        "quantity": quantity,
        "norm_finite": norm == norm and abs(norm) != float("inf"),
        "bitwise_unchanged": equal,
        "tensors_compared": len(before),
        "optim_tensors": sum(k.startswith("optim/") for k in before),
        "lr_unchanged": lr_before == strategy.lr,
        "next_step_applies": applied,
    }


def main() -> None:
    model_dir, out = sys.argv[1:3]
    report = {name: check(model_dir, name) for name in sys.argv[3:]}
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
    sys.exit(finish_process(0))
