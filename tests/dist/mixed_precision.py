"""Three training steps under ``strategy.mixed_precision`` (single in one process; FSDP2 / DeepSpeed ZeRO-2 under
torchrun with 2 gloo ranks): the losses, the dtype a decoder layer's and a vision block's matmuls compute in (a forward
hook on their first Linear; autocast keeps the residual stream in float32, so a block's own output would not say), the
dtype of the weights the optimizer updates (the master weights), and how far they moved.

Usage: python mixed_precision.py MODEL_DIR OUT_FILE STRATEGY MIXED_PRECISION  (writes OUT_FILE.RANK, JSON)
"""

from __future__ import annotations

import json
import sys

import torch
from PIL import Image

from data_pipelines.collate import collate_sequences, encode_prompt, model_inputs
from data_pipelines.records import PromptRecord
from vlrft.models.loading import load_model
from vlrft.strategies import OptimConfig, StrategyConfig, finish_process, make_strategy


def master_dtypes(strategy) -> list[str]:
    """The dtypes of what the optimizer steps: FSDP2 and single, the parameters (FSDP2: this rank's shards);
    DeepSpeed, its fp32 partitions (the module itself holds bf16 copies)."""
    opt = strategy.optimizer
    groups = getattr(opt, "single_partition_of_fp32_groups", None)
    tensors = groups if groups is not None else [p for g in opt.param_groups for p in g["params"]]
    return sorted({str(t.dtype) for t in tensors})


def main() -> None:
    model_dir, out_file, name, mixed = sys.argv[1:5]
    cfg = StrategyConfig(name=name, zero_stage=2, mixed_precision=mixed, grad_clip=1.0)
    strategy = make_strategy(cfg, OptimConfig(lr=1e-3))
    model, proc = load_model(model_dir, "float32")
    before = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    strategy.prepare(model, total_steps=3)
    seen: dict[str, str] = {}  # the output dtype of the first Linear of the first decoder layer / vision block
    for module in strategy.unwrap().modules():
        kind = type(module).__name__.removeprefix("FSDP")  # fully_shard makes FSDP<class>
        if kind.endswith(("DecoderLayer", "VisionBlock")) and kind not in seen:
            seen[kind] = ""
            linear = next(m for m in module.modules() if isinstance(m, torch.nn.Linear))
            linear.register_forward_hook(lambda m, a, out, k=kind: seen.__setitem__(k, str(out.dtype)))
    rec = PromptRecord(id="a", prompt="<image> What colour?", images=[Image.new("RGB", (56, 56), (200, 20, 20))])
    answer = torch.tensor(proc.tokenizer(" red red red")["input_ids"] + [proc.tokenizer.eos_token_id])
    batch = collate_sequences([encode_prompt(proc, rec)], [0], [answer], proc.tokenizer.pad_token_id)
    batch = {k: v.to(strategy.device) for k, v in batch.items()}
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    losses = []
    for _ in range(3):
        loss = strategy.train_module(**model_inputs(batch), labels=labels).loss
        strategy.backward(loss)
        strategy.step()
        losses.append(float(loss.detach()))
    after = {k: v.clone() for k, v in strategy.full_params()}  # each tensor is valid until the next is drawn
    report = {
        "bf16": cfg.bf16,
        "losses": losses,
        "compute_dtypes": seen,
        "master_dtypes": master_dtypes(strategy),
        "moved": max((after[k].float().cpu() - v).abs().max().item() for k, v in before.items() if k in after),
    }
    with open(f"{out_file}.{strategy.rank}", "w") as f:
        json.dump(report, f)
    strategy.barrier()


if __name__ == "__main__":
    main()
    sys.exit(finish_process(0))
