"""read_records over every source format and image form; column maps; skip reports; prompt-length filter."""

from __future__ import annotations

import base64
import io
import json
import logging

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from data_pipelines.collate import encode_prompt
from data_pipelines.errors import DataError
from data_pipelines.readers import SkipReport, filter_by_prompt_length, prompt_length, read_records, record_from_row
from data_pipelines.records import JudgmentRecord, PreferencePair, PromptRecord

RED, BLUE = (200, 10, 10), (10, 10, 200)


def png(color, size=(56, 56)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


ROWS = [
    {"id": "r0", "prompt": "<image>What colour is this?", "images": ["img/red.png"], "answer": "red", "task": "color"},
    {"id": "r1", "prompt": "Compare <image> with <image>.", "images": ["img/red.png", "img/blue.png"], "answer": 2},
    {"id": "r2", "prompt": "Text only: what is 2+2?", "answer": "4", "source_note": "kept in metadata"},
]


def full(row):  # columnar formats: every column in every row (null where absent)
    return {k: row.get(k) for k in ("id", "prompt", "images", "answer", "task", "source_note")}


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "red.png").write_bytes(png(RED))
    (tmp_path / "img" / "blue.png").write_bytes(png(BLUE, (84, 56)))
    return tmp_path


def check_records(records):
    assert [r.id for r in records] == ["r0", "r1", "r2"]
    assert [r.answer for r in records] == ["red", "2", "4"]
    assert records[0].task == "color" and records[2].task == "default"
    assert [len(r.images) for r in records] == [1, 2, 0]
    assert records[0].images[0].getpixel((3, 3)) == RED
    assert records[1].images[1].size == (84, 56) and records[1].images[1].getpixel((3, 3)) == BLUE
    assert records[2].metadata == {"source_note": "kept in metadata"} and records[0].metadata == {}
    assert all(isinstance(r, PromptRecord) for r in records)


def test_jsonl_json_csv_parquet_give_the_same_records(folder):
    (folder / "d.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS) + "\n\n")
    (folder / "d.json").write_text(json.dumps(ROWS))
    (folder / "wrapped.json").write_text(json.dumps({"version": 1, "data": ROWS}))
    (folder / "lines.json").write_text("\n".join(json.dumps(r) for r in ROWS))  # JSON Lines under .json
    csv_rows = ["id,prompt,images,answer,task,source_note"]
    csv_rows += [
        'r0,<image>What colour is this?,"[""img/red.png""]",red,color,',
        'r1,Compare <image> with <image>.,"[""img/red.png"", ""img/blue.png""]",2,,',
        "r2,Text only: what is 2+2?,,4,,kept in metadata",
    ]
    (folder / "d.csv").write_text("\n".join(csv_rows) + "\n")
    pq.write_table(pa.Table.from_pylist([dict(full(r), answer=str(r["answer"])) for r in ROWS]), folder / "d.parquet")
    for name in ("d.jsonl", "d.json", "wrapped.json", "lines.json", "d.csv", "d.parquet"):
        records, report = read_records(folder / name)
        check_records(records)
        assert (report.read, report.kept, report.skipped) == (3, 3, 0), name


def test_parquet_with_image_bytes_and_folder_of_hub_layout_files(folder):
    rows = [
        dict(
            full(r),
            answer=str(r["answer"]),
            images=[
                {"bytes": png(RED if "red" in p else BLUE, (56, 56) if "red" in p else (84, 56)), "path": p}
                for p in r.get("images", [])
            ],
        )
        for r in ROWS
    ]
    (folder / "hub" / "data").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), folder / "hub" / "data" / "test-00000-of-00001.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:1]), folder / "hub" / "data" / "train-00000-of-00001.parquet")
    records, _ = read_records(folder / "hub", split="test")  # bytes win over the (absent) path
    check_records(records)
    assert len(read_records(folder / "hub", split="train")[0]) == 1


def test_datasets_folder_with_image_features(tmp_path):
    red, blue = Image.new("RGB", (56, 56), RED), Image.new("RGB", (84, 56), BLUE)
    features = datasets.Features(
        {
            "id": datasets.Value("string"),
            "prompt": datasets.Value("string"),
            "images": datasets.List(datasets.Image()),
            "answer": datasets.Value("string"),
            "task": datasets.Value("string"),
            "source_note": datasets.Value("string"),
        }
    )
    ds = datasets.Dataset.from_dict(
        {
            "id": ["r0", "r1", "r2"],
            "prompt": [r["prompt"] for r in ROWS],
            "images": [[red], [red, blue], []],
            "answer": ["red", "2", "4"],
            "task": ["color", None, None],
            "source_note": [None, None, "kept in metadata"],
        },
        features=features,
    )
    ds.save_to_disk(str(tmp_path / "saved"))
    records, _ = read_records(tmp_path / "saved")
    check_records(records)
    # A single Image column named "image" (the alias of "images") and a DatasetDict with splits.
    single = datasets.Dataset.from_dict(
        {"question": ["<image>colour?"], "image": [red]},
        features=datasets.Features({"question": datasets.Value("string"), "image": datasets.Image()}),
    )
    datasets.DatasetDict({"train": single, "test": single}).save_to_disk(str(tmp_path / "dict"))
    with pytest.raises(DataError, match=r"split None not found; the dataset has \['test', 'train'\]"):
        read_records(tmp_path / "dict")
    (rec,), _ = read_records(tmp_path / "dict", split="test")
    assert rec.prompt == "<image>colour?" and rec.images[0].getpixel((0, 0)) == RED


def test_images_as_data_uri_bytes_and_pil_in_rows():
    uri = "data:image/png;base64," + base64.b64encode(png(BLUE)).decode()
    kwargs = {"min_pixels": 3136, "max_pixels": 12544}
    for image in (uri, png(BLUE), Image.new("RGB", (56, 56), BLUE), {"bytes": png(BLUE), "path": None}):
        rec = record_from_row({"prompt": "<image>?", "images": image}, image_kwargs=kwargs)
        assert rec.images[0].getpixel((0, 0)) == BLUE and rec.images[0].size == (56, 56)


def test_load_images_false_keeps_sources_and_resize_bounds_apply(folder):
    (folder / "d.jsonl").write_text("\n".join(json.dumps(r) for r in ROWS))
    records, _ = read_records(folder / "d.jsonl", load_images=False)
    assert records[1].images == ["img/red.png", "img/blue.png"]
    records, _ = read_records(folder / "d.jsonl", min_pixels=28 * 28 * 16, max_pixels=28 * 28 * 64)
    assert records[0].images[0].size == (112, 112)


def test_column_map_aliases_and_messages(tmp_path):
    rows = [
        {"problem": "<image>Find x.", "image": "a.png", "solution": "5"},
        {"question": "2+2?", "answer": 4},
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]},
            ],
            "images": ["a.png"],
            "answer": "red",
        },
    ]
    Image.new("RGB", (56, 56), RED).save(tmp_path / "a.png")
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    records, _ = read_records(tmp_path / "d.jsonl", column_map={"solution": "answer"})
    assert [r.prompt for r in records] == ["<image>Find x.", "2+2?", "<image>Colour?"]
    assert [r.answer for r in records] == ["5", "4", "red"]
    assert records[2].system == "Be brief." and len(records[0].images) == 1
    # TRL's conversational form: `prompt` is itself a messages list; images inline or in `images`.
    conversational = [
        {
            "prompt": [
                {"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "Colour?"}]}
            ]
        },
        {
            "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}],
            "images": ["a.png"],
        },
    ]
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps(r) for r in conversational))
    records, _ = read_records(tmp_path / "c.jsonl")
    assert [r.prompt for r in records] == ["<image>Colour?"] * 2 and all(
        r.images[0].getpixel((0, 0)) == RED for r in records
    )
    # An explicit map wins over the aliases: "question" stays metadata when "q" is mapped to prompt.
    (tmp_path / "m.jsonl").write_text(json.dumps({"q": "hi", "question": "other"}))
    (rec,), _ = read_records(tmp_path / "m.jsonl", column_map={"q": "prompt"})
    assert rec.prompt == "hi" and rec.metadata == {"question": "other"}


def test_preference_and_judgment_kinds(tmp_path):
    Image.new("RGB", (56, 56), RED).save(tmp_path / "a.png")
    (tmp_path / "p.jsonl").write_text(
        json.dumps(
            {
                "prompt": "<image>Colour?",
                "images": ["a.png"],
                "chosen": "red",
                "rejected": "blue",
                "margin": "1.5",
                "tie": "false",
            }
        )
    )
    (pair,), _ = read_records(tmp_path / "p.jsonl", kind="preference")
    assert isinstance(pair, PreferencePair) and (pair.chosen, pair.rejected, pair.margin, pair.tie) == (
        "red",
        "blue",
        1.5,
        False,
    )
    (tmp_path / "j.csv").write_text('prompt,images,target\n"<image>Is it red?",a.png,<answer>yes</answer>\n')
    (judg,), _ = read_records(tmp_path / "j.csv", kind="judgment")
    assert (
        isinstance(judg, JudgmentRecord)
        and judg.target == "<answer>yes</answer>"
        and judg.images[0].getpixel((0, 0)) == RED
    )


@pytest.mark.timeout(60)
def test_hub_id_offline_fails_at_once_with_a_clear_error():
    with pytest.raises(DataError, match=r"cannot load hub dataset 'nobody-here/not-cached'.*local path") as info:
        read_records("nobody-here/not-cached", split="train")
    assert info.value.category == "missing source"
    with pytest.raises(DataError, match=r"file not found"):
        read_records("missing/folder/data.jsonl")  # a path-looking name is not a hub id


def test_skip_report_counts_and_logs(tmp_path, caplog):
    lines = [
        json.dumps({"prompt": "ok"}),
        json.dumps({"prompt": ""}),
        "{oops",
        json.dumps({"prompt": 3}),
        json.dumps({"prompt": ""}),
    ]
    (tmp_path / "d.jsonl").write_text("\n".join(lines))
    with caplog.at_level(logging.WARNING, logger="data_pipelines"):
        records, report = read_records(tmp_path / "d.jsonl", on_bad_record="skip")
    assert len(records) == 1 and (report.read, report.kept, report.skipped) == (5, 1, 4)
    assert dict(report.counts) == {"empty prompt": 2, "invalid JSON": 1, "wrong type": 1}
    summary = report.summary()
    assert "read 5 records, kept 1, skipped 4" in summary and "2 x empty prompt (first: " in summary
    assert f"{tmp_path / 'd.jsonl'}:2 field 'prompt': empty prompt" in summary
    assert summary in caplog.text
    assert len(read_records(tmp_path / "d.jsonl", on_bad_record="skip", limit=1)[0]) == 1


def test_numeric_ids_and_answers_become_text(tmp_path):
    pq.write_table(pa.Table.from_pylist([{"id": 7, "prompt": "p", "answer": 2.5}]), tmp_path / "d.parquet")
    (rec,), _ = read_records(tmp_path / "d.parquet")
    assert (rec.id, rec.answer) == ("7", "2.5")


def test_filter_by_prompt_length_counts_image_tokens(tiny_model, tmp_path):
    from transformers import AutoProcessor

    import vlrft.models  # noqa: F401 - registers the image-only processors

    processor = AutoProcessor.from_pretrained(tiny_model("qwen2_5_vl"))
    small = PromptRecord(
        id="small", prompt="<image>Colour?", images=[Image.new("RGB", (56, 56), RED)]
    )  # 4 image tokens
    big = PromptRecord(id="big", prompt="<image>Colour?", images=[Image.new("RGB", (112, 112), RED)])  # 16 image tokens
    text = PromptRecord(id="text", prompt="Colour?")
    n_small, n_big, n_text = (prompt_length(r, processor) for r in (small, big, text))
    assert n_big - n_small == 12  # same text, 16 - 4 image tokens
    assert n_small - n_text == 4 + 2  # 4 image tokens + <|vision_start|><|vision_end|>
    assert n_text == len(
        processor.tokenizer.apply_chat_template(
            [{"role": "user", "content": "Colour?"}], add_generation_prompt=True, tokenize=True
        )["input_ids"]
    )
    report = SkipReport(source="test", read=3, kept=3)
    kept = filter_by_prompt_length([small, big, text], processor, n_small, on_bad_record="skip", report=report)
    assert [r.id for r in kept] == ["small", "text"] and report.counts == {"prompt too long": 1} and report.kept == 2
    with pytest.raises(
        DataError,
        match=rf"record 'big' field 'prompt': prompt has {n_big} tokens \(image tokens included\) "
        rf"> max_prompt_length {n_small}",
    ):
        filter_by_prompt_length([small, big], processor, n_small)
    # Text-only records count with a bare tokenizer too; image records need the processor.
    assert filter_by_prompt_length([text], processor.tokenizer, n_text) == [text]
    with pytest.raises(ValueError, match="need the model's processor"):
        filter_by_prompt_length([small], processor.tokenizer, 100)


def test_prompt_length_is_the_encoded_prompts_length(tiny_model):
    """prompt_length counts what encode_prompt feeds the model: a text-only Qwen chat template (string
    contents, as Qwen2.5-Instruct's) and a Qwen-VL processor with an image."""
    from transformers import AutoProcessor, AutoTokenizer

    import vlrft.models  # noqa: F401 - registers the image-only processors

    tok = AutoTokenizer.from_pretrained(tiny_model("qwen2"))
    tok.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    text = PromptRecord(id="t", prompt="What is 2+2?", system="Be brief.")
    n = prompt_length(text, tok, prompt_template="answer_tag")
    assert n == encode_prompt(tok, text, prompt_template="answer_tag").input_ids.numel()
    assert n == len(
        tok(
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is 2+2? Put your final "
            "answer within <answer> </answer> tags.<|im_end|>\n<|im_start|>assistant\n"
        )["input_ids"]
    )
    processor = AutoProcessor.from_pretrained(tiny_model("qwen2_5_vl"))
    image = PromptRecord(id="i", prompt="Colour of <image>?", images=[png(RED, (112, 84))])
    encoded = encode_prompt(processor, image, system_prompt="You judge colours.")
    assert encoded.num_images == 1
    assert prompt_length(image, processor, system_prompt="You judge colours.") == encoded.input_ids.numel()
    assert prompt_length(text, processor) == encode_prompt(processor, text).input_ids.numel()


def test_jsonl_with_bom_and_crlf_line_ends(tmp_path):
    (tmp_path / "d.jsonl").write_bytes(b'\xef\xbb\xbf{"prompt": "first"}\r\n\r\n{"prompt": "second"}\r\n')
    records, _ = read_records(tmp_path / "d.jsonl")
    assert [(r.id, r.prompt) for r in records] == [("d-1", "first"), ("d-3", "second")]  # ids carry the line


@pytest.mark.timeout(60)
def test_over_long_prompt_is_counted_not_truncated(tiny_model):
    from transformers import AutoProcessor

    import vlrft.models  # noqa: F401

    processor = AutoProcessor.from_pretrained(tiny_model("qwen2_5_vl"))
    image = Image.new("RGB", (112, 112), (1, 2, 3))
    records = [
        PromptRecord(id=f"r{i}", prompt="<image>" + "word " * n, images=[image]) for i, n in enumerate((1, 400, 2))
    ]
    report = SkipReport(source="mem", read=3, kept=3)
    kept = filter_by_prompt_length(records, processor, 64, on_bad_record="skip", report=report)
    assert [r.id for r in kept] == ["r0", "r2"] and report.counts == {"prompt too long": 1}
    assert kept[0] is records[0] and kept[0].prompt == records[0].prompt  # untouched, not truncated
    with pytest.raises(
        DataError,
        match=r"record 'r1' field 'prompt': prompt has \d+ tokens \(image tokens included\) > max_prompt_length 64",
    ):
        filter_by_prompt_length(records, processor, 64)
