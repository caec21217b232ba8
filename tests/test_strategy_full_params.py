"""``Strategy.full_params()``, the stream a rollout engine with its own weights loads after each update:
Hugging Face names, full tensors, LoRA merged in; under FSDP2 and ZeRO-3 on 2 gloo ranks equal to the
model as loaded in one process before an update and to the exported full state after one."""

from __future__ import annotations

import copy

import pytest
import torch
from tolerance import assert_within
from transformers import AutoModelForImageTextToText

import vlrft.models  # noqa: F401
from tests.test_policy_distributed import _run_script
from vlrft.strategies import OptimConfig, StrategyConfig, make_strategy
from vlrft.strategies.blocks import transformer_blocks


def test_single_streams_every_parameter_under_its_hf_name(tiny_model):
    model = AutoModelForImageTextToText.from_pretrained(tiny_model("qwen2_5_vl"))
    s = make_strategy(StrategyConfig(), OptimConfig())
    s.prepare(model)
    got = dict(s.full_params())
    ref = dict(model.named_parameters())
    assert list(got) == list(ref)
    assert all(torch.equal(got[k], ref[k]) for k in ref)


def test_lora_is_merged_like_peft_merge_and_unload(tiny_model):
    model = AutoModelForImageTextToText.from_pretrained(tiny_model("qwen2_5_vl"))
    base = {n: p.detach().clone() for n, p in model.named_parameters()}
    s = make_strategy(StrategyConfig(lora_rank=4, lora_target_modules="q_proj,v_proj"), OptimConfig())
    peft_model, _, _ = s.prepare(model)
    with torch.no_grad():  # adapters that do something (lora_B starts at zero)
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn_like(p) * 0.1)
    got = dict(s.full_params())
    merged = dict(copy.deepcopy(peft_model).merge_and_unload().named_parameters())
    assert list(got) == list(base) == list(merged)  # the base model's names, no adapters
    diff = max((got[k] - merged[k]).abs().max().item() for k in got)
    # W + B A * scale in float32 either way, one rank-4 product: a few ulps of weights below ~1, i.e. ~1e-7
    assert_within(diff, 1e-6, "merged LoRA weights vs peft merge_and_unload")
    changed = [k for k in got if not torch.equal(got[k], base[k])]
    assert changed and all(("q_proj" in k or "v_proj" in k) and k.endswith("weight") for k in changed)


def test_trainable_only_leaves_out_a_frozen_vision_tower_but_keeps_lora_bases(tiny_model):
    """What a vLLM engine is sent after an update: a frozen tower is not re-sent; LoRA bases are, merged."""
    path = tiny_model("qwen2_5_vl")
    s = make_strategy(StrategyConfig(freeze_vision_tower=True), OptimConfig())
    s.prepare(AutoModelForImageTextToText.from_pretrained(path))
    every, trainable = dict(s.full_params()), dict(s.full_params(trainable_only=True))
    left_out = set(every) - set(trainable)
    assert left_out and all(".visual." in k for k in left_out)
    assert not any(".visual." in k for k in trainable) and len(trainable) + len(left_out) == len(every)
    s = make_strategy(StrategyConfig(lora_rank=4, lora_target_modules="q_proj,v_proj"), OptimConfig())
    s.prepare(AutoModelForImageTextToText.from_pretrained(path))
    sent = dict(s.full_params(trainable_only=True))
    assert sent and all(("q_proj" in k or "v_proj" in k) for k in sent)  # only the LoRA-merged weights move


@pytest.mark.distributed
@pytest.mark.parametrize(
    "strategy, stage, mixed, lora, ranks",
    [
        ("fsdp2", "2", "no", "", 2),
        ("fsdp2", "2", "bf16", "", 2),
        ("fsdp2", "2", "no", "lora", 2),
        ("deepspeed", "3", "no", "", 2),
        # 3 ranks: the tiny model's sizes (multiples of 16) do not divide by 3, so ZeRO-3's partitions are padded
        ("deepspeed", "3", "no", "", 3),
        ("deepspeed", "3", "no", "lora", 2),
    ],
)
def test_sharded_strategies_stream_full_tensors(tiny_model, tmp_path, strategy, stage, mixed, lora, ranks):
    out = tmp_path / "report.pt"
    _run_script("full_params.py", [str(tiny_model("qwen2_5_vl")), str(out), strategy, stage, mixed, lora], ranks)
    report = torch.load(out)
    model = AutoModelForImageTextToText.from_pretrained(tiny_model("qwen2_5_vl"))
    ref = [n for n, _ in model.named_parameters()]
    assert report["names_before"] == sorted(ref)
    assert report["missing_from_disk"] == [] and report["missing_from_export"] == []
    assert report["max_diff_disk"] == 0.0  # the stream before an update is the model as loaded ...
    assert report["moved"] > 1e-3  # ... an update moves it (Adam, lr 1e-2) ...
    # ZeRO-3's partitions are padded, the padding never written: the finiteness check reads only real elements (NaN
    # bits in the padding once stopped a finite 3-rank run), and still sees a NaN in a real one
    if strategy == "deepspeed" and stage == "3" and ranks == 3:
        assert report["padding_nan_ignored"] is True
    else:
        assert report["padding_nan_ignored"] in (True, None)
    if lora:  # ... and after it the stream is the exported state, its adapters merged (one rank-4 product: ~1e-7)
        assert report["lora_layers"] == 2 * model.config.text_config.num_hidden_layers
        assert_within(report["max_diff_export"], 1e-6, f"{strategy} LoRA stream vs the export merged")
        return
    assert report["max_diff_export"] == 0.0  # ... and after it the stream is the exported state
    # a caller that casts to bf16 may get bf16 (FSDP2's bf16 gathers): bitwise its own cast of the float32 stream
    assert report["dtypes"] == ["torch.float32"] and report["max_diff_bf16"] == 0.0
    # gathered unit by unit (each block; the rest, the root's), one all-gather each, not one per parameter; FSDP2 with
    # a bf16 policy (whose gathers cast) serves a float32 caller parameter by parameter, in float32
    units = 1 + len(transformer_blocks(model))
    if mixed == "bf16":
        assert report["groups"] == [len(ref)] and len(report["groups_bf16"]) == units
        assert report["dtypes_bf16"] == ["torch.bfloat16"]
    else:
        assert len(report["groups"]) == len(report["groups_bf16"]) == units and sum(report["groups"]) == len(ref)
        assert report["dtypes_bf16"] == ["torch.float32"]  # no cast of its own: the float32 parameters
