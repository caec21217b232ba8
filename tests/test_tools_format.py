"""Multi-turn trajectories in the model family's own format (issue 26 items 2 and 4), proven token by token:

- a trajectory made as the rollout makes it (the prompt, each sampled turn as the policy's tokens, each tool turn
  from ``encode_observation``) is exactly the chat template's rendering of the whole conversation: the same ids,
  the same pixels of every image (those tools returned in turns 2 and 3 included), the same image marks;
- the tokens the trainer trains (the trajectory's action mask) are exactly the assistant tokens SFT's labels mark
  on that conversation: tool observations, images and template tokens are masked;
- the trainer's log-probs of a trajectory (one forward over the whole of it, as ``response_logprobs`` computes
  them, plain and group-shared) equal those of each turn computed from that turn's own context, as a rollout
  engine sees it when it samples the turn;
- the tool-call parser, argument checks and the calculator refuse what they must.
"""

from __future__ import annotations

import time

import pytest
import torch
from tolerance import assert_within

from data_pipelines.chat import ChatRecord, encode_chat
from data_pipelines.collate import EncodedPrompt, collate_sequences, encode_prompt, processor_image_kwargs
from data_pipelines.images import qwen_size
from data_pipelines.synthetic import make_prompt_records
from data_pipelines.turns import concat, encode_observation
from vlrft.models.loading import load_model
from vlrft.tools import ToolBox, ToolsConfig, calculate, format_tool_call, parse_tool_calls
from vlrft.tools.base import CallError, ToolCall, ToolResult, check_arguments, tool_message
from vlrft.tools.builtin import BUILTIN_TOOLS, ToolFailure, view_of
from vlrft.trainer.experience import response_logprobs

END = "<|im_end|>"


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def tool_model(request, tiny_model):
    return load_model(tiny_model(request.param, tool_tokens=True), "float32")


@pytest.fixture
def box(tool_model):
    box = ToolBox(ToolsConfig(names=["zoom", "calculator"]), processor_image_kwargs(tool_model[1]))
    yield box
    box.close()


def _trajectory(processor, box, turns: int, images: bool):
    """A mark_color record, its prompt, and a trajectory of ``turns`` assistant turns: each but the last calls a
    tool (``zoom``: an image comes back; else ``calculator``: text), the last answers. Returns (record, prompt,
    response pieces with which are sampled, the whole conversation's messages)."""
    record = make_prompt_records("mark_color", 1, seed=3)[0]
    prompt = encode_prompt(processor, record, tools=box.schemas)
    conversation = list(prompt.messages)
    views = [view_of(im, box.bounds) for im in record.images]
    tok = processor.tokenizer
    pieces: list[tuple[EncodedPrompt, bool]] = []
    regions = ["top_left", "bottom_right"]
    for k in range(turns):
        last = k == turns - 1
        if last:
            text = "red"
        elif images:
            text = format_tool_call("zoom", {"region": regions[k]})
        else:
            text = format_tool_call("calculator", {"expression": f"{k + 2} * 21"})
        sampled = tok(text + END, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
        pieces.append((EncodedPrompt(sampled), True))
        conversation.append({"role": "assistant", "content": [{"type": "text", "text": text}]})
        if last:
            break
        call = parse_tool_calls(text)[0]
        result = box.run(call, views)
        assert isinstance(result, ToolResult), result
        assert bool(result.images) == images and (images or result.text == str((k + 2) * 21))
        observation = [tool_message(result)]
        pieces.append(
            (encode_observation(processor, conversation, observation, tools=box.schemas, end_of_turn=END), False)
        )
        conversation += observation
        views += [view_of(im, box.bounds) for im in result.images]
    return record, prompt, pieces, conversation


@pytest.mark.parametrize("images", [True, False], ids=["images-returned", "text-returned"])
@pytest.mark.parametrize("turns", [1, 2, 3])
def test_a_trajectory_is_the_chat_template_of_its_conversation_token_for_token(tool_model, box, turns, images):
    _, processor = tool_model
    _, prompt, pieces, conversation = _trajectory(processor, box, turns, images)
    whole = encode_chat(processor, ChatRecord("c", conversation), tools=box.schemas)
    built = concat([prompt] + [p for p, _ in pieces])
    # the template closes the last assistant turn with <|im_end|>\n; the policy's turn ends at <|im_end|>
    assert torch.equal(built.input_ids, whole.input_ids[:-1])
    assert processor.tokenizer.decode(whole.input_ids[-1:]) == "\n"
    assert built.num_images == whole.num_images == 1 + (turns - 1) * images
    assert torch.equal(built.image_grid_thw, whole.image_grid_thw)
    assert torch.equal(built.pixel_values, whole.pixel_values)
    assert torch.equal(built.mm_token_type_ids, whole.mm_token_type_ids[:-1])
    # trained tokens = the assistant tokens SFT labels on the same conversation, and nothing else
    action = torch.cat([torch.full((p.input_ids.numel(),), int(s)) for p, s in pieces])
    labelled = (whole.labels[:-1] != -100).long()
    start = prompt.input_ids.numel()
    assert labelled[:start].sum() == 0
    assert torch.equal(action, labelled[start:])
    assert int(action.sum()) < action.numel() or turns == 1  # observations are there and masked


def _logprobs_of(model, prompt: EncodedPrompt, response: EncodedPrompt | torch.Tensor, shared: bool = False):
    ids = response.input_ids if isinstance(response, EncodedPrompt) else response
    batch = collate_sequences([prompt], [0], [response], pad_token_id=0)
    return response_logprobs(model, batch, ids[None], shared=shared)[0][0]


@pytest.mark.parametrize("images", [True, False], ids=["images-returned", "text-returned"])
@pytest.mark.parametrize("turns", [1, 2, 3])
def test_the_trainers_logprobs_of_a_trajectory_equal_each_turns_own(tool_model, box, turns, images):
    model, processor = tool_model
    _, prompt, pieces, _ = _trajectory(processor, box, turns, images)
    response = concat([p for p, _ in pieces])
    with torch.no_grad():
        whole = _logprobs_of(model, prompt, response)
        shared = _logprobs_of(model, prompt, response, shared=True)  # text observations: packed; images: plain path
        offset, worst = 0, 0.0
        for k, (piece, sampled) in enumerate(pieces):
            n = piece.input_ids.numel()
            if sampled:  # the engine's view: the turn sampled after its whole context, as a prompt of its own
                context = concat([prompt] + [p for p, _ in pieces[:k]])
                alone = _logprobs_of(model, context, piece.input_ids)
                worst = max(worst, float((whole[offset : offset + n] - alone).abs().max()))
                worst = max(worst, float((shared[offset : offset + n] - alone).abs().max()))
            offset += n
    # float32 log-softmax over 1,024 logits after two layers, the same tokens at the same positions in sequences of
    # other lengths (other reduction orders): differences of a few ulps of values of magnitude ~7, so 1e-5
    assert_within(worst, 1e-5, f"trajectory vs per-turn log-probs ({turns} turns, images={images})")


def test_calls_are_parsed_never_evaluated_and_bad_ones_are_errors():
    ok = format_tool_call("zoom", {"region": "top_left"})
    assert parse_tool_calls("no call here") == []
    assert parse_tool_calls(ok + " and " + ok) == [ToolCall("zoom", {"region": "top_left"})] * 2
    stringly = '<tool_call>{"name": "zoom", "arguments": "{\\"region\\": \\"top\\"}"}</tool_call>'
    assert parse_tool_calls(stringly) == [ToolCall("zoom", {"region": "top"})]
    kinds = [
        c.kind for c in parse_tool_calls("<tool_call>__import__('os')</tool_call><tool_call>[1]</tool_call><tool_call>")
    ]
    assert kinds == ["malformed", "malformed", "malformed"]
    assert parse_tool_calls("<tool_call>" + "{" * 5000 + "</tool_call>")[0].kind == "malformed"
    # 10 MB of arguments: refused unread (a counted "malformed" observation), in well under the tools' time limit
    t0 = time.monotonic()
    (huge,) = parse_tool_calls(format_tool_call("zoom", {"region": "x" * 10_000_000}))
    assert huge.kind == "malformed" and "10000045 characters (at most 4096)" in huge.message, huge
    assert time.monotonic() - t0 < 1.0  # measured about 0.01 s; the regex and the length check are linear
    zoom = BUILTIN_TOOLS["zoom"].parameters
    assert check_arguments(zoom, {"region": "top_left"}) is None
    assert "not one of" in check_arguments(zoom, {"region": "upstairs"})
    assert "unknown argument" in check_arguments(zoom, {"regoin": "top_left"})
    assert "must be integer" in check_arguments(zoom, {"region": "top", "image": True})
    assert "items" in check_arguments(zoom, {"box": [1, 2, 3]})


def test_the_calculator_computes_arithmetic_and_refuses_everything_else():
    assert calculate("(3 + 4) * 6 / 2") == 21.0
    assert calculate("2^10") == 1024.0 and calculate("sqrt(16) + abs(-2)") == 6.0
    assert abs(calculate("degrees(acos(0.5))") - 60.0) < 1e-9
    for bad in ("__import__('os').system('true')", "().__class__", "[1] * 9", "x + 1", "open('f')", "lambda: 1"):
        with pytest.raises(ToolFailure):
            calculate(bad)
    for huge in ("10 ** 10 ** 10", "9 ** 9 ** 9", "1 / 0", "a" * 300):
        with pytest.raises(ToolFailure):
            calculate(huge)


def test_tool_errors_are_observations_not_exceptions(tool_model, box):
    _, processor = tool_model
    record = make_prompt_records("mark_color", 1, seed=3)[0]
    views = [view_of(im, box.bounds) for im in record.images]
    assert box.run(ToolCall("zom", {}), views).kind == "unknown_tool"
    # the top half (224x112) scaled to the processor's most pixels, sides multiples of its factor
    top = box.run(ToolCall("zoom", {"region": "top"}), views).images[0]
    assert top.size == qwen_size((224 * 8, 112 * 8), **box.bounds) and top.size[0] == 2.5 * top.size[1]
    for args in ({}, {"region": "top", "box": [0, 0, 5, 5]}, {"box": [5, 5, 1, 1]}, {"region": "top", "image": 2}):
        failed = box.run(ToolCall("zoom", args), views)
        assert isinstance(failed, CallError) and failed.kind == "bad_arguments", (args, failed)
    message = tool_message(box.run(ToolCall("calculator", {"expression": "1/0"}), views))
    assert message["content"][0]["text"].startswith("error: calculator:")
