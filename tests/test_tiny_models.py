"""The tiny-model factory writes real Qwen(-VL) models that the Auto classes reload and train."""

from __future__ import annotations

import json
import math

import pytest
import torch
from PIL import Image
from records import say_the_colour

import vlrft.models  # noqa: F401  (registers the image-only processors)
from vlrft.archs import ARCHS, VL_ARCHS
from vlrft.models.processing import torchvision_available
from vlrft.models.tiny import SPECIAL_TOKENS, TinySpec, make_tiny_model


def _load(path, arch):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoProcessor, AutoTokenizer

    if arch in VL_ARCHS:
        return AutoModelForImageTextToText.from_pretrained(path), AutoProcessor.from_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)


def _chat_batch(arch, proc):
    if arch in VL_ARCHS:
        image = Image.new("RGB", (84, 56), (200, 30, 30))
        content = [{"type": "image", "image": image}, {"type": "text", "text": "What colour is the image?"}]
    else:
        content = "Tom has 3 apples and buys 4 more. How many apples does he have?"
    messages = [{"role": "user", "content": content}, {"role": "assistant", "content": "The answer is 7."}]
    return proc.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")


@pytest.mark.parametrize("arch", ARCHS)
def test_reload_forward_generate_backward_step(tiny_model, arch):
    path = tiny_model(arch)
    model, proc = _load(path, arch)
    assert sum(p.numel() for p in model.parameters()) < 3_000_000
    batch = _chat_batch(arch, proc)
    ids = batch["input_ids"]
    if arch in VL_ARCHS:
        # 84x56 pixels -> a 6x4 patch grid (14 px patches; 16 px for qwen3_vl -> rounded to 32 px multiples)
        grid = batch["image_grid_thw"].tolist()[0]
        n_image_tokens = (ids == proc.image_token_id).sum().item()
        assert n_image_tokens == grid[0] * grid[1] * grid[2] // 4
        assert 4 <= n_image_tokens <= 16
    model.train()
    out = model(**batch, labels=ids)
    vocab = model.config.get_text_config().vocab_size
    assert out.logits.shape == (1, ids.shape[1], vocab)
    # a random init predicts close to uniform: loss near ln(vocab)
    assert math.isfinite(out.loss.item()) and abs(out.loss.item() - math.log(vocab)) < 0.5
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out.loss.backward()
    opt.step()
    opt.zero_grad()
    after = model(**batch, labels=ids).loss.item()
    assert after < out.loss.item() - 0.05  # one step on the same batch lowers its loss
    model.eval()
    torch.manual_seed(0)
    gen = model.generate(**batch, do_sample=True, temperature=1.0, max_new_tokens=6, min_new_tokens=6)
    assert gen.shape == (1, ids.shape[1] + 6)
    assert torch.equal(gen[0, : ids.shape[1]], ids[0])


def test_same_seed_same_bytes_and_different_seed_differs(tmp_path):
    a = make_tiny_model(tmp_path / "a", arch="qwen2_5_vl", seed=3)
    b = make_tiny_model(tmp_path / "b", arch="qwen2_5_vl", seed=3)
    c = make_tiny_model(tmp_path / "c", arch="qwen2_5_vl", seed=4)
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    assert "model.safetensors" in names and "processor_config.json" in names
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_sizes_are_honoured(tmp_path):
    from transformers import AutoConfig

    path = make_tiny_model(tmp_path / "m", arch="qwen2_5_vl", hidden=96, layers=3, vision_depth=1, heads=4)
    cfg = AutoConfig.from_pretrained(path)
    assert cfg.text_config.hidden_size == 96 and cfg.text_config.num_hidden_layers == 3
    assert cfg.vision_config.depth == 1 and cfg.vision_config.out_hidden_size == 96
    assert sum(cfg.text_config.rope_parameters["mrope_section"]) == 96 // 4 // 2
    with pytest.raises(ValueError, match="unknown arch"):
        make_tiny_model(tmp_path / "x", arch="llama")


def test_tokenizer_special_tokens_follow_the_bpe_vocab_in_qwen_order(tiny_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model("qwen2"))
    ids = [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS]
    assert ids == list(range(TinySpec().vocab_size - len(SPECIAL_TOKENS), TinySpec().vocab_size))
    assert len(tok) == TinySpec().vocab_size
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    text = "Natalia sold 48 clips in April. #### 72 \\boxed{72} <think>so</think>"
    assert tok.decode(tok(text)["input_ids"]) == text
    assert tok("12345")["input_ids"] == [tok.convert_tokens_to_ids(d) for d in "12345"]  # digits split
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_vl_processor_needs_no_torchvision(tiny_model):
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(tiny_model("qwen2_vl"))
    assert type(proc.image_processor).__name__ == "Qwen2VLImageProcessorPil"
    if not torchvision_available():
        assert type(proc).__name__ == "ImageOnlyQwen2VLProcessor"
    sizes = [(28, 28), (112, 112), (300, 300)]
    out = proc(
        text=["<|vision_start|><|image_pad|><|vision_end|>x"] * len(sizes),
        images=[Image.new("RGB", s) for s in sizes],
        return_tensors="pt",
        padding=True,
    )
    # bounds: min_pixels 3136 (28x28 grows to 56x56 -> 4 tokens), max_pixels 12544 (112x112 -> 16
    # tokens); 300x300 shrinks by sqrt(90000/12544) and rounds down to 84x84 (9 tokens)
    assert out["image_grid_thw"].tolist() == [[1, 4, 4], [1, 8, 8], [1, 6, 6]]


def test_text_qwen3_trains_through_train_sft_and_train_policy_on_text_records(tiny_model, tmp_path):
    """Text Qwen3 (q/k norms, its own head size) through the trainers on a file of text records: train-sft lowers
    the held-out nll in 4 steps, train-policy runs 2 GRPO steps with real gradients and exports; its group-shared
    forward and prefill-once decoding are proven equal to the plain paths in tests/test_group_forward.py."""
    from vlrft.cli import main

    records = say_the_colour(tmp_path, 16, colours=4)
    path = tiny_model("qwen3")
    quiet = ["logging.wandb=disabled", "logging.progress_bar=false", "logging.tensorboard=false"]
    data = [f"data.train_source={records}", f"data.eval_source={records}", "train.eval_every=4"]
    sft = tmp_path / "sft"
    args = ["train-sft", f"model.path={path}", *data, "data.response_template= {answer}", "train.max_steps=4"]
    assert main([*args, "optim.lr=1e-2", f"train.output_dir={sft}", *quiet]) == 0
    nll = [json.loads(x)["eval/nll"] for x in (sft / "metrics.jsonl").read_text().splitlines() if "eval/nll" in x]
    assert len(nll) == 2 and nll[1] < nll[0] - 0.5, nll
    rl = tmp_path / "rl"
    source = "reward.sources=[{name: accuracy, kind: verifier, verifier: exact_match}]"
    args = ["train-policy", f"model.path={sft / 'final'}", *data, source, "train.max_steps=2", "optim.lr=1e-3"]
    args += ["rollout.rollout_batch_size=4", "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=4"]
    assert main([*args, f"train.output_dir={rl}", *quiet]) == 0
    steps = [json.loads(x) for x in (rl / "metrics.jsonl").read_text().splitlines() if "reward/combined" in x]
    assert [r["step"] for r in steps] == [1, 2] and all(r["train/grad_norm"] > 0 for r in steps), steps
    assert (rl / "final" / "model.safetensors").is_file()
