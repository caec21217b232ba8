"""``Strategy.full_params()`` under a strategy: the stream equals the model as loaded in one process before any
update and the exported full state after one, name for name and bitwise; how many groups the stream gathers
(one all-gather each); the stream for a bf16 caller (``dtype=torch.bfloat16``; in bf16 from FSDP2's bf16 gathers)
against the float32 stream, both cast. ``lora``: rank-4 adapters on q_proj and v_proj, merged in the stream; after the update
(which moves the adapters off their zero product) the stream is checked against the merge computed here from the
exported state (``W + scaling * B @ A``).

Run under ``torchrun --nproc_per_node=2`` (or 3: ZeRO-3's partitions padded).
Usage: python full_params.py MODEL_DIR OUT_FILE STRATEGY ZERO_STAGE [MIXED [lora]]
"""

import sys

import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor

import vlrft.models  # noqa: F401
from data_pipelines.collate import collate_sequences, encode_prompt, model_inputs
from data_pipelines.records import PromptRecord
from vlrft.strategies import OptimConfig, StrategyConfig, finish_process, make_strategy
from vlrft.strategies.weight_stream import hf_name as _hf_name


def main() -> None:
    model_dir, out_file, name, stage = sys.argv[1:5]
    mixed = sys.argv[5] if len(sys.argv) > 5 else "no"
    lora = dict(lora_rank=4, lora_target_modules="q_proj,v_proj") if sys.argv[6:] == ["lora"] else {}
    cfg = StrategyConfig(name=name, zero_stage=int(stage), grad_clip=0, mixed_precision=mixed, **lora)
    strategy = make_strategy(cfg, OptimConfig(lr=1e-2))
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
    bf16 = {k: v.clone() for k, v in strategy.full_params(dtype=torch.bfloat16)}
    report["dtypes"] = sorted({str(v.dtype) for v in after.values()})
    report["dtypes_bf16"] = sorted({str(v.dtype) for v in bf16.values()})
    # what the caller holds after its cast to bf16, from either stream
    cast = {k: v.to(torch.bfloat16).float() for k, v in bf16.items()}
    report["max_diff_bf16"] = max((cast[k] - after[k].to(torch.bfloat16).float()).abs().max().item() for k in after)
    every = lambda n, p: True  # noqa: E731
    report["groups"] = [len(g) for g in strategy._gathered_groups(strategy.unwrap(), every, None)]
    report["groups_bf16"] = [len(g) for g in strategy._gathered_groups(strategy.unwrap(), every, torch.bfloat16)]
    report["padding_nan_ignored"] = _padding_probe(strategy)
    state = strategy.full_state_dict()
    if strategy.is_rank0 and lora:  # the exported state holds base weights and adapters under peft's names
        scaling = {n: m.scaling["default"] for n, m in strategy.unwrap().named_modules() if hasattr(m, "lora_A")}
        merged = {_hf_name(k): v for k, v in state.items() if ".lora_" not in k}
        for owner, scale in scaling.items():
            a, b = state[f"{owner}.lora_A.default.weight"], state[f"{owner}.lora_B.default.weight"]
            merged[_hf_name(f"{owner}.weight")] = state[f"{owner}.base_layer.weight"] + (b.float() @ a.float()) * scale
        state = merged
        report["lora_layers"] = len(scaling)
    if strategy.is_rank0:
        report["max_diff_export"] = max((after[k].float() - state[k].float()).abs().max().item() for k in after)
        report["moved"] = max((after[k].float() - before[k].float()).abs().max().item() for k in after)
        report["missing_from_export"] = sorted(set(after) - set(state))
        torch.save(report, out_file)
    strategy.barrier()


def _padding_probe(strategy) -> bool | None:
    """ZeRO-3: NaN written into the padding of every partition (memory DeepSpeed never initialises) leaves the weights
    finite to ``require_finite_weights``; NaN in one real element does not. ``None`` where nothing is padded."""
    from vlrft.errors import NonFiniteError

    params = [p for p in strategy.unwrap().parameters() if hasattr(p, "ds_tensor")]
    rank = torch.distributed.get_rank()
    padded = [p for p in params if p.ds_numel - rank * p.ds_tensor.ds_numel < p.ds_tensor.ds_numel]
    if not strategy._agree(bool(padded)):
        return None
    with torch.no_grad():
        for p in padded:
            real = max(0, p.ds_numel - rank * p.ds_tensor.ds_numel)
            p.ds_tensor.reshape(-1)[real:] = float("nan")
        strategy.require_finite_weights("in the padding probe")  # raises if the padding were read
        first = params[0].ds_tensor.reshape(-1)
        kept = first[0].clone()
        if rank == 0:
            first[0] = float("nan")
        try:
            strategy.require_finite_weights("in the padding probe")
            caught = False
        except NonFiniteError:
            caught = True
        first[0] = kept
        for p in padded:
            real = max(0, p.ds_numel - rank * p.ds_tensor.ds_numel)
            p.ds_tensor.reshape(-1)[real:] = 0.0
    return caught


if __name__ == "__main__":
    main()
    sys.exit(finish_process(0))
