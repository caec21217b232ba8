"""Strategy options on a real tiny Qwen2.5-VL: frozen vision tower, LoRA (merged on export) and
gradient checkpointing (same gradients as without)."""

from __future__ import annotations

import torch
from PIL import Image
from tolerance import assert_within

import vlrft.models  # noqa: F401
from data_pipelines.collate import collate_sequences, encode_prompt, model_inputs
from data_pipelines.records import PromptRecord
from vlrft.strategies import OptimConfig, StrategyConfig, make_strategy


def _batch(proc):
    rec = PromptRecord(id="a", prompt="<image> What colour?", images=[Image.new("RGB", (56, 56), (200, 20, 20))])
    prompt = encode_prompt(proc, rec)
    return collate_sequences([prompt], [0], [torch.tensor([11, 12, 13])], proc.tokenizer.pad_token_id)


def _load(path):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    return AutoModelForImageTextToText.from_pretrained(path), AutoProcessor.from_pretrained(path)


def _step(strategy, model, batch):
    out = model(**model_inputs(batch), labels=batch["input_ids"])
    strategy.backward(out.loss)
    return strategy.step()


def test_frozen_vision_tower_keeps_its_weights(tiny_model):
    model, proc = _load(tiny_model("qwen2_5_vl"))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    s = make_strategy(StrategyConfig(freeze_vision_tower=True), OptimConfig(lr=1e-2))
    model, _, _ = s.prepare(model, total_steps=1)
    _step(s, model, _batch(proc))
    after = model.state_dict()
    vision = [k for k in after if ".visual." in f".{k}"]
    assert vision and all(torch.equal(after[k], before[k]) for k in vision)
    assert any(not torch.equal(after[k], before[k]) for k in after if k not in vision)


def test_lora_trains_adapters_only_and_exports_merged(tiny_model, tmp_path):
    model, proc = _load(tiny_model("qwen2_5_vl"))
    base = {k: v.clone() for k, v in model.state_dict().items()}
    s = make_strategy(StrategyConfig(lora_rank=4, lora_target_modules="q_proj,v_proj"), OptimConfig(lr=1e-2))
    model, _, _ = s.prepare(model, total_steps=1)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    batch = _batch(proc)
    _step(s, model, batch)  # lora_B starts at zero: the first step moves B only
    _step(s, model, batch)  # the second changes the adapted output
    s.save_pretrained(tmp_path / "merged", proc)
    merged, _ = _load(tmp_path / "merged")
    state = merged.state_dict()
    assert set(state) == set(base)  # plain transformers weights, adapters merged away
    changed = [k for k in state if not torch.equal(state[k], base[k])]
    assert changed and all(("q_proj" in k or "v_proj" in k) and k.endswith("weight") for k in changed)
    with torch.no_grad():
        ref = model(**model_inputs(batch)).logits
        got = merged(**model_inputs(batch)).logits
    # the merged weights (W + B A scale) vs the adapter path (W x + B A x scale): float32 reassociation of the
    # same products, a few ulps of O(1-10) logits through 2 layers, ~1e-5 at worst
    assert_within((ref - got).abs().max(), 1e-4, "LoRA merged export vs adapter logits")


def test_gradient_checkpointing_gives_the_same_gradients(tiny_model):
    """The same gradients with and without checkpointing, which recomputes each block inside its forward: the
    hooks on a block (FSDP2's and DeepSpeed's gather, FSDP2's cast of the inputs to bf16) run once per forward,
    not again in the backward's recompute (transformers < 5.2x checkpointed around ``__call__``, so they ran
    twice, and FSDP2 on torch < 2.13 left the recompute's inputs uncast: strategies.base.own_block_forwards)."""
    from vlrft.strategies.blocks import transformer_blocks

    grads = []
    for checkpointing in (False, True):
        model, proc = _load(tiny_model("qwen2_5_vl"))
        s = make_strategy(StrategyConfig(gradient_checkpointing=checkpointing), OptimConfig(lr=1e-3))
        model, _, _ = s.prepare(model, total_steps=1)
        model.train()
        assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules()) == checkpointing
        blocks, hooked, recomputed = transformer_blocks(model), [], []
        for block in blocks:
            block.register_forward_pre_hook(lambda m, args: hooked.append(m))
            block.mlp.register_forward_pre_hook(lambda m, args: recomputed.append(torch.is_grad_enabled()))
        batch = _batch(proc)
        model(**model_inputs(batch), labels=batch["input_ids"]).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        assert len(hooked) == len(blocks) == 4  # 2 vision blocks, 2 decoder layers: each block's hooks ran once
        assert len(recomputed) == len(blocks) * (2 if checkpointing else 1)  # checkpointing: each block computed twice
    assert set(grads[0]) == set(grads[1])
    # recomputation repeats the same arithmetic: equal up to a few ulps of gradients below ~1e-2 (~1e-9)
    worst = max((g - grads[1][name]).abs().max().item() for name, g in grads[0].items())
    assert_within(worst, 1e-6, "gradient checkpointing vs plain gradients")
