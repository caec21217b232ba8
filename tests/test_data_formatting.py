"""Chat formatting: message structure, templates, system prompts, rendering through the tiny models' templates."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from data_pipelines.formatting import PROMPT_TEMPLATES, build_messages
from data_pipelines.records import JudgmentRecord, PreferencePair, PromptRecord

RED, BLUE = Image.new("RGB", (56, 56), (255, 0, 0)), Image.new("RGB", (112, 56), (0, 0, 255))


def test_images_go_where_their_placeholders_are():
    rec = PromptRecord(id="a", prompt="Compare <image> with <image>: which is red?", images=[RED, BLUE])
    (user,) = build_messages(rec)
    assert user["role"] == "user"
    assert user["content"] == [
        {"type": "text", "text": "Compare "},
        {"type": "image", "image": RED},
        {"type": "text", "text": " with "},
        {"type": "image", "image": BLUE},
        {"type": "text", "text": ": which is red?"},
    ]


def test_without_placeholders_images_come_first_and_text_only_is_a_list():
    (user,) = build_messages(PromptRecord(id="a", prompt="Which colour?", images=[RED, BLUE]))
    assert [c["type"] for c in user["content"]] == ["image", "image", "text"]
    assert user["content"][0]["image"] is RED
    (user,) = build_messages(PromptRecord(id="b", prompt="2+2?"))
    assert user["content"] == [{"type": "text", "text": "2+2?"}]


def test_images_not_yet_loaded_are_loaded(tmp_path):
    RED.save(tmp_path / "r.png")
    (user,) = build_messages(PromptRecord(id="a", prompt="<image>?", images=[str(tmp_path / "r.png")]))
    assert isinstance(user["content"][0]["image"], Image.Image) and user["content"][0]["image"].getpixel((0, 0)) == (
        255,
        0,
        0,
    )


def test_templates_system_prompt_and_response():
    rec = PromptRecord(id="a", prompt="<image>Find x.", images=[RED])
    msgs = build_messages(rec, system_prompt="You are careful.", prompt_template="math_boxed")
    assert msgs[0] == {"role": "system", "content": [{"type": "text", "text": "You are careful."}]}
    text = msgs[1]["content"][1]["text"]
    assert text.startswith("Find x. ") and "<think> </think>" in text and text.endswith("\\boxed{}.")
    assert PROMPT_TEMPLATES["plain"].format(prompt="p") == "p"
    assert (
        build_messages(PromptRecord(id="g", prompt="Q?"), prompt_template="gsm8k")[0]["content"][0]["text"]
        == 'Q? Let\'s think step by step and output the final answer after "####".'
    )
    assert (
        build_messages(PromptRecord(id="c", prompt="Q?"), prompt_template="Question: {prompt}\nAnswer:")[0]["content"][
            0
        ]["text"]
        == "Question: Q?\nAnswer:"
    )
    with pytest.raises(ValueError, match="neither a name in PROMPT_TEMPLATES"):
        build_messages(rec, prompt_template="no field here")
    # The record's own system prompt wins over the run-wide default.
    own = PromptRecord(id="s", prompt="Q?", system="Record system.")
    assert build_messages(own, system_prompt="Default.")[0]["content"][0]["text"] == "Record system."
    pair = PreferencePair(id="p", prompt="<image>Colour?", chosen="red", rejected="blue", images=[RED])
    assert build_messages(pair, response=pair.chosen)[-1] == {
        "role": "assistant",
        "content": [{"type": "text", "text": "red"}],
    }
    judgment = JudgmentRecord(id="j", prompt="<image>Is it red?", target="<answer>yes</answer>", images=[RED])
    assert [m["role"] for m in build_messages(judgment, response=judgment.target)] == ["user", "assistant"]


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen2_vl"])
def test_messages_render_through_the_tiny_processor_chat_template(tiny_model, arch):
    from transformers import AutoProcessor

    import vlrft.models  # noqa: F401 - registers the image-only processors

    processor = AutoProcessor.from_pretrained(tiny_model(arch))
    rec = PromptRecord(id="a", prompt="Compare <image> with <image>: which is red?", images=[RED, BLUE])
    messages = build_messages(rec, system_prompt="Be brief.")
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    vision = "<|vision_start|><|image_pad|><|vision_end|>"
    assert text == (
        f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nCompare {vision} with {vision}: "
        "which is red?<|im_end|>\n<|im_start|>assistant\n"
    )
    batch = processor(
        text=[text], images=[c["image"] for c in messages[1]["content"] if c["type"] == "image"], return_tensors="pt"
    )
    pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert batch["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 8]]  # 56x56 -> 4 tokens, 56x112 -> 8 tokens
    assert batch["input_ids"][0].tolist().count(pad) == 4 + 8
    # Text-only records go through the same template.
    text_only = processor.apply_chat_template(build_messages(PromptRecord(id="t", prompt="2+2?")), tokenize=False)
    assert text_only == "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n"


def test_text_only_record_renders_through_text_model_tokenizer(tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model("qwen2"))
    messages = build_messages(PromptRecord(id="g", prompt="Tom has 3 apples.", answer="3"), prompt_template="gsm8k")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert (
        'user\nTom has 3 apples. Let\'s think step by step and output the final answer after "####".<|im_end|>' in text
    )
    assert text.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("arch", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_loaded_images_are_sized_as_the_processor_sizes_them(tiny_model, tmp_path, arch):
    """load_image with the processor's bounds resizes exactly as the processor does, so it resizes no further."""
    from transformers import AutoProcessor

    import vlrft.models  # noqa: F401
    from data_pipelines.images import image_bounds
    from data_pipelines.readers import read_records
    from vlrft.archs import ARCHS

    if arch not in ARCHS:
        pytest.skip(f"{arch} needs a newer transformers")
    processor = AutoProcessor.from_pretrained(tiny_model(arch))
    bounds = image_bounds(processor)
    patch = processor.image_processor.patch_size
    assert bounds["image_factor"] == 2 * patch
    sizes = [(90, 60), (300, 40), (17, 17), (500, 500)]
    for i, size in enumerate(sizes):
        Image.new("RGB", size, (i * 40, 90, 200)).save(tmp_path / f"{i}.png")
    rows = [{"prompt": "<image>Which colour?", "images": [f"{i}.png"]} for i in range(len(sizes))]
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    records, _ = read_records(tmp_path / "d.jsonl", **bounds)
    for rec in records:
        text = processor.apply_chat_template(build_messages(rec), tokenize=False, add_generation_prompt=True)
        assert text.count("<|vision_start|><|image_pad|><|vision_end|>") == 1
        out = processor(text=[text], images=rec.images, return_tensors="pt")
        _, gh, gw = out["image_grid_thw"][0].tolist()
        assert (gw * patch, gh * patch) == rec.images[0].size
