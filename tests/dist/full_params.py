"""``Strategy.full_params()`` under a strategy: the stream equals the model as loaded in one process before any
update and the exported full state after one, name for name and bitwise.

Run under ``torchrun --nproc_per_node=2``. Usage: python full_params.py MODEL_DIR OUT_FILE STRATEGY ZERO_STAGE
"""

import sys

import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

import vlrft.models  # noqa: F401
from data_pipelines.collate import collate_sequences, encode_prompt, model_inputs
from data_pipelines.records import PromptRecord
from vlrft.strategies import OptimConfig, StrategyConfig, finish_process, make_strategy


def main() -> None:
    model_dir, out_file, name, stage = sys.argv[1:5]
    strategy = make_strategy(StrategyConfig(name=name, zero_stage=int(stage), grad_clip=0), OptimConfig(lr=1e-2))
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(model_dir)
    proc = AutoProcessor.from_pretrained(model_dir)
    model, _, _ = strategy.prepare(model, total_steps=1)
    report = {}
    on_disk = {n: p.detach() for n, p in AutoModelForImageTextToText.from_pretrained(model_dir).named_parameters()}
    before = {k: v.clone() for k, v in strategy.full_params()}
    report["names_before"] = sorted(before)
    report["max_diff_disk"] = max((before[k].float() - on_disk[k].float()).abs().max().item() for k in before)
    report["missing_from_disk"] = sorted(set(before) - set(on_disk))

    rec = PromptRecord(id="a", prompt="<image> What colour?", images=[Image.new("RGB", (56, 56), (200, 20, 20))])
    batch = collate_sequences([encode_prompt(proc, rec)], [0], [torch.tensor([11, 12, 13])], proc.tokenizer.pad_token_id)
    batch = {k: v.to(strategy.device) for k, v in batch.items()}
    strategy.backward(strategy.train_module(**model_inputs(batch), labels=batch["input_ids"]).loss)
    strategy.step()
    after = {k: v.clone() for k, v in strategy.full_params()}
    state = strategy.full_state_dict()
    if strategy.is_rank0:
        report["max_diff_export"] = max((after[k].float() - state[k].float()).abs().max().item() for k in after)
        report["moved"] = max((after[k].float() - before[k].float()).abs().max().item() for k in after)
        report["missing_from_export"] = sorted(set(after) - set(state))
        torch.save(report, out_file)
    strategy.barrier()


if __name__ == "__main__":
    main()
    sys.exit(finish_process(0))
