"""The hf rollout engine: vision once per unique prompt, same tokens as plain generate, stop handling."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from data_pipelines.collate import collate_prompts, encode_prompt
from data_pipelines.records import PromptRecord
from vlrft.rollout import SamplingParams, make_engine


@pytest.fixture(scope="module")
def vl(tiny_model):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    import vlrft.models  # noqa: F401

    path = tiny_model("qwen2_5_vl")
    return AutoModelForImageTextToText.from_pretrained(path).eval(), AutoProcessor.from_pretrained(path)


def _prompts(proc):
    recs = [
        PromptRecord(id="a", prompt="What colour? <image>", images=[Image.new("RGB", (56, 84), (255, 0, 0))]),
        PromptRecord(id="b", prompt="Text only."),
        PromptRecord(
            id="c",
            prompt="<image> and <image>",
            images=[Image.new("RGB", (112, 112), (0, 0, 255)), Image.new("RGB", (56, 56), (0, 255, 0))],
        ),
    ]
    return [encode_prompt(proc, r) for r in recs]


def test_prefill_once_matches_plain_generate_greedy(vl):
    model, proc = vl
    prompts = _prompts(proc)
    engine = make_engine("hf", model, proc)
    assert engine.prefill_once
    once = engine.generate(prompts, SamplingParams(n=2, temperature=0, max_new_tokens=5))
    engine.prefill_once = False
    plain = engine.generate(prompts, SamplingParams(n=2, temperature=0, max_new_tokens=5))
    assert [r.prompt_index for r in once] == [0, 0, 1, 1, 2, 2]
    assert [r.response_ids.tolist() for r in once] == [r.response_ids.tolist() for r in plain]
    # and the same as HF generate on the left-padded batch
    batch = collate_prompts(prompts, proc.tokenizer.pad_token_id)
    with torch.no_grad():
        ref = model.generate(**batch, do_sample=False, max_new_tokens=5)[:, batch["input_ids"].shape[1] :]
    for i in range(3):
        got = once[2 * i].response_ids.tolist()
        assert got == ref[i, : len(got)].tolist()


def test_sampling_is_seeded_and_lengths_respect_limits(vl):
    model, proc = vl
    prompts = _prompts(proc)
    engine = make_engine("hf", model, proc)
    torch.manual_seed(3)
    a = engine.generate(prompts, SamplingParams(n=3, temperature=1.0, max_new_tokens=6))
    torch.manual_seed(3)
    b = engine.generate(prompts, SamplingParams(n=3, temperature=1.0, max_new_tokens=6))
    assert [x.response_ids.tolist() for x in a] == [x.response_ids.tolist() for x in b]
    assert len({tuple(x.response_ids.tolist()) for x in a}) > 3  # samples of a group differ
    for x in a:
        assert 1 <= x.response_ids.numel() <= 6
        assert (x.finish_reason == "stop") == (x.response_ids[-1].item() in engine.eos_ids)
        assert not set(x.response_ids.tolist()) & set(engine.suppress)  # no vision placeholders generated


def test_a_pad_token_the_policy_samples_stays_in_its_response(vl):
    """A model whose tokenizer's pad token is no EOS can sample it (a real token of its vocabulary); the engine
    keeps it as a response token, to be trained on like any other. It was dropped as if it were padding: a
    one-token response of it came back empty and its probability was never pushed down."""
    import copy

    model, proc = vl
    pad = proc.tokenizer.pad_token_id
    prompts = _prompts(proc)[1:2]  # text only
    engine = make_engine("hf", model, proc)
    assert pad not in engine.eos_ids
    first = engine.generate(prompts, SamplingParams(n=1, temperature=0, max_new_tokens=1))[0].response_ids.item()
    swapped = copy.deepcopy(model)
    with torch.no_grad():  # the LM head rows of the greedy token and the pad token exchanged: greedy picks pad
        w = swapped.lm_head.weight
        w[[first, pad]] = w[[pad, first]].clone()
    engine = make_engine("hf", swapped, proc)
    for new_tokens in (1, 3):
        got = engine.generate(prompts, SamplingParams(n=2, temperature=0, max_new_tokens=new_tokens))
        for r in got:
            assert r.response_ids[0].item() == pad and r.response_ids.numel() >= 1
            assert r.finish_reason == ("stop" if r.response_ids[-1].item() in engine.eos_ids else "length")


def test_a_row_ended_by_a_stop_string_drops_the_padding_after_it(vl):
    """Rows of one generate call that end at a stop string are padded while the others go on: the padding is
    dropped, the row ends with its stop string, finish reason ``stop``; rows that did not stop keep every token."""
    model, proc = vl
    prompts = _prompts(proc)
    engine = make_engine("hf", model, proc)
    free = engine.generate(prompts, SamplingParams(n=1, temperature=0, max_new_tokens=6))
    tok = proc.tokenizer
    ids = free[0].response_ids.tolist()
    # the first printable token of row 0 after its first, with room after it: row 0 stops there
    stop = next(
        (tok.decode(ids[k : k + 1]) for k in range(1, len(ids) - 1) if tok.decode(ids[k : k + 1]).strip()), None
    )
    assert stop, f"no printable token to stop at in {ids}"
    stopped = engine.generate(prompts, SamplingParams(n=1, temperature=0, max_new_tokens=6, stop=[stop]))
    for before, after in zip(free, stopped):  # greedy: the same tokens, up to the stop string where a row stopped
        n = after.response_ids.numel()
        assert after.response_ids.tolist() == before.response_ids.tolist()[:n]
        if n < before.response_ids.numel():  # cut short: at the stop string, the padding after it dropped
            assert after.finish_reason == "stop" and after.text.endswith(stop)
    assert stopped[0].finish_reason == "stop" and stopped[0].text.endswith(stop)
    assert stopped[0].response_ids.numel() < free[0].response_ids.numel()
    print("rows stopped at", [(r.response_ids.numel(), r.finish_reason) for r in stopped])
