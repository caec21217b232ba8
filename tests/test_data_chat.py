"""Chat records -> token ids with labels on assistant tokens only, proven token by token against the chat
template; single and multi-turn, 0..n images per turn, text-only models; files; collation."""

from __future__ import annotations

import json

import pytest
import torch

from data_pipelines.chat import (
    ChatRecord,
    chat_from_prompt,
    collate_chats,
    encode_chat,
    normalise_messages,
    pair_conversations,
    read_chat_records,
)
from data_pipelines.collate import tokenizer_of
from data_pipelines.errors import DataError
from data_pipelines.formatting import text_only_messages
from data_pipelines.synthetic import make_preference_pairs, make_prompt_records
from vlrft.models.loading import load_processor


def _expected_mask(processor, record: ChatRecord, ids: torch.Tensor, grid) -> list[bool]:
    """Independent reference: the template's TEXT (each image's one pad expanded to its grid's token count),
    character spans of each assistant turn's content plus its <|im_end|>, and each token's character span
    from decoding the ids one prefix at a time."""
    messages = record.messages if hasattr(processor, "image_processor") else text_only_messages(record.messages)
    text = processor.apply_chat_template(messages, tokenize=False)
    pad = "<|image_pad|>"
    pieces = text.split(pad)
    counts = [] if grid is None else [int(g.prod()) // 4 for g in grid]  # spatial merge 2 x 2
    assert len(pieces) == len(counts) + 1
    text = pieces[0] + "".join(pad * n + piece for n, piece in zip(counts, pieces[1:]))
    head, end = "<|im_start|>assistant\n", "<|im_end|>"
    spans, pos = [], 0
    while (start := text.find(head, pos)) >= 0:
        lo = start + len(head)
        hi = text.index(end, lo) + len(end)
        spans.append((lo, hi))
        pos = hi
    tok = tokenizer_of(processor)
    mask, prev = [], ""
    for k in range(ids.numel()):
        cur = tok.decode(ids[: k + 1], skip_special_tokens=False)
        lo, hi = len(prev), len(cur)
        mask.append(any(lo >= a and hi <= b for a, b in spans))
        prev = cur
    assert prev == text  # the ids are the template's text, nothing added or lost
    return mask


def _check(processor, record: ChatRecord):
    enc = encode_chat(processor, record)
    labelled = (enc.labels != -100).tolist()
    assert labelled == _expected_mask(processor, record, enc.input_ids, enc.image_grid_thw)
    assert torch.equal(enc.labels[enc.labels != -100], enc.input_ids[enc.labels != -100])
    return enc


@pytest.fixture(scope="module")
def vl(tiny_model):
    return load_processor(tiny_model("qwen2_5_vl"))


def test_single_turn_vl_labels_only_the_answer_and_its_end_token(vl):
    rec = make_prompt_records("color", 1, seed=0)[0]
    enc = _check(vl, chat_from_prompt(rec, rec.answer))
    tok = tokenizer_of(vl)
    assert tok.decode(enc.input_ids[enc.labels != -100]) == f"{rec.answer}<|im_end|>"
    # the image's tokens are marked for m-rope positions, exactly where the image pads are
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    assert torch.equal(enc.mm_token_type_ids.bool(), enc.input_ids == pad) and enc.num_images == 1


def test_multi_turn_with_zero_one_and_two_images_per_turn(vl):
    ims = [r.images[0] for r in make_prompt_records("color", 3, seed=1)]
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello."},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "<image>What colour?"},
        {"role": "assistant", "content": "red"},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and"}, {"type": "image"}]},
        {"role": "assistant", "content": "blue and green"},
    ]
    rec = ChatRecord("multi", normalise_messages(messages, ims))
    enc = _check(vl, rec)
    assert enc.num_images == 3 and enc.num_target_tokens > 6
    assert (
        tokenizer_of(vl).decode(enc.input_ids[enc.labels != -100])
        == "Hi.<|im_end|>red<|im_end|>blue and green<|im_end|>"
    )


def test_text_only_model_and_text_only_record_take_the_same_path(tiny_model, vl):
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    rec = ChatRecord("t", normalise_messages(messages, []))
    text = load_processor(tiny_model("qwen2"))
    enc = _check(text, rec)
    assert enc.pixel_values is None and tokenizer_of(text).decode(enc.input_ids[enc.labels != -100]) == "4<|im_end|>"
    enc_vl = _check(vl, rec)  # a VL model on a text record: no images, same labels
    assert enc_vl.pixel_values is None and torch.equal(enc_vl.labels, enc.labels)


def test_bad_conversations_are_refused_by_name(tiny_model, vl):
    im = make_prompt_records("color", 1, seed=0)[0].images
    with pytest.raises(DataError, match="placeholder"):
        normalise_messages([{"role": "user", "content": "<image><image>"}, {"role": "assistant", "content": "x"}], im)
    with pytest.raises(DataError, match="not referenced"):
        normalise_messages([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"}], im)
    with pytest.raises(DataError, match="no assistant turn"):
        normalise_messages([{"role": "user", "content": "hi"}], [])
    with pytest.raises(DataError, match="role 'bot'"):
        normalise_messages([{"role": "bot", "content": "hi"}], [])
    rec = chat_from_prompt(make_prompt_records("color", 1, seed=0)[0], "red")
    with pytest.raises(DataError, match="text-only"):
        encode_chat(load_processor(tiny_model("qwen2")), rec)
    with pytest.raises(DataError, match="max_length=5"):
        encode_chat(vl, rec, max_length=5)


def test_files_pairs_and_collation(vl, tmp_path):
    recs = make_prompt_records("color", 2, seed=2)
    for i, r in enumerate(recs):
        r.images[0].save(tmp_path / f"{i}.png")
    rows = [
        {"id": "a", "prompt": "What colour?", "response": recs[0].answer, "images": ["0.png"]},
        {
            "messages": [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]},
                {"role": "assistant", "content": recs[1].answer},
            ],
            "images": ["1.png"],
        },
        {"prompt": "no response here"},
    ]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"chat.jsonl:3 field 'response'"):
        read_chat_records(path, processor=vl)
    got, report = read_chat_records(path, processor=vl, on_bad_record="skip")
    assert [r.id for r in got] == ["a", "chat-2"] and report.skipped == 1
    chats = [_check(vl, r) for r in got]
    pair = make_preference_pairs("color", 1, seed=3)[0]
    chosen, rejected = pair_conversations(pair)
    chats += [_check(vl, chosen), _check(vl, rejected)]
    batch = collate_chats(chats, tokenizer_of(vl).pad_token_id)
    assert batch["input_ids"].shape[0] == 4 and batch["image_grid_thw"].shape[0] == 4
    for i, c in enumerate(chats):  # right padding: each row is the conversation, then pad with no loss
        n = c.input_ids.numel()
        assert torch.equal(batch["labels"][i, :n], c.labels) and (batch["labels"][i, n:] == -100).all()
        assert torch.equal(batch["mm_token_type_ids"][i, :n], c.mm_token_type_ids)
