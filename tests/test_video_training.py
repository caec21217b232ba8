"""Records with videos through the training paths (issue 61): readers, chat formatting, encoding, the group-shared
forward, the hf engine, preflight counting, train-sft and train-policy on Qwen2-VL, Qwen2.5-VL and Qwen3-VL, and bad
video files as one line or a counted skip. Videos are real H.264 mp4 files written with PyAV
(``data_pipelines.synthetic_video``)."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from launch import QUIET
from tolerance import assert_within
from updates import loss_gradients

from data_pipelines.collate import collate_sequences, encode_prompt
from data_pipelines.errors import DataError
from data_pipelines.readers import filter_by_prompt_length, prompt_length, read_records
from data_pipelines.records import PromptRecord
from data_pipelines.synthetic_video import dot_frames, make_dot_motion_records
from data_pipelines.video import use_video_settings
from vlrft.archs import ARCHS
from vlrft.cli import main
from vlrft.models.loading import load_model
from vlrft.models.packing import pack_groups, sample_images
from vlrft.rollout import SamplingParams, make_engine
from vlrft.trainer.experience import response_logprobs, response_tensors

VL = ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"]
# small frames for tiny models: a 64x64 video becomes 56x56 (Qwen2/2.5-VL) or 64x64 (Qwen3-VL), 4-8 tokens a grid
SMALL = {"min_pixels": 3136, "max_pixels": 4096}
SMALL_CLI = ["data.video_min_pixels=3136", "data.video_max_pixels=4096"]
# the bound of tests/test_group_forward.py: the same float32 sums in another order, ~1e-6 at worst; 1e-5 is 10x
FORWARD_BOUND = 1e-5


@pytest.fixture(scope="module")
def videos(tmp_path_factory) -> dict[str, Path | list[str]]:
    """Two dot-motion mp4 files and one video given as a list of frame images."""
    root = tmp_path_factory.mktemp("videos")
    recs = make_dot_motion_records(2, root, seed=5)
    frames = []
    for k, im in enumerate(dot_frames((20, 30), "blue", "left", frames=5, step=3, size=64, radius=5)):
        im.save(root / f"f{k}.png")
        frames.append(str(root / f"f{k}.png"))
    return {"a": Path(recs[0]["videos"][0]), "b": Path(recs[1]["videos"][0]), "frames": frames}


def _records(videos) -> list[PromptRecord]:
    from PIL import Image

    image = Image.new("RGB", (56, 56), (200, 30, 30))
    return [
        PromptRecord(id="v", prompt="<video>Does the dot move left or right?", videos=[str(videos["a"])]),
        PromptRecord(id="text", prompt="A text-only prompt that is a little longer than the others."),
        PromptRecord(id="iv", prompt="<image> then <video>: same colour?", images=[image], videos=[videos["frames"]]),
        PromptRecord(id="vv", prompt="<video> or <video>?", videos=[str(videos["b"]), str(videos["a"])]),
    ]


def _processor_batch(proc, recs, sizes, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [encode_prompt(proc, r) for r in recs]
    index, responses = [], []
    for p, n in enumerate(sizes):
        for _ in range(n):
            responses.append(torch.randint(3, 200, (int(torch.randint(1, 10, (1,), generator=g)),), generator=g))
            index.append(p)
    pad = proc.tokenizer.pad_token_id
    ids, mask = response_tensors(responses, pad)
    return prompts, collate_sequences(prompts, index, responses, pad), ids, mask


@pytest.mark.parametrize("arch", VL + [a for a in ("qwen3_5",) if a in ARCHS])
def test_video_prompts_share_the_forward_exactly_and_encode_each_video_once(arch, tiny_model, videos):
    """Group-shared vs plain log-probs and entropies with video prompts (one video, an image and a frame-list video,
    two videos, text only) within the bound of the image path; the vision tower encodes each prompt's video patches
    once in the shared path and once per sample in the plain one. Qwen3.5 (hybrid linear attention) takes the cached
    path, the others a packed row."""
    model, proc = load_model(tiny_model(arch), torch.float32)
    use_video_settings(proc, **SMALL)
    model.eval()
    recs = _records(videos)
    prompts, batch, ids, mask = _processor_batch(proc, recs, [3, 1, 4, 2])
    assert [p.num_videos for p in prompts] == [1, 0, 1, 2] and [p.num_images for p in prompts] == [0, 0, 1, 0]
    video_id = proc.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    tokens = [int((p.input_ids == video_id).sum()) for p in prompts]
    merge = proc.image_processor.merge_size**2
    assert tokens == [int(p.video_grid_thw.prod(-1).sum()) // merge if p.num_videos else 0 for p in prompts]
    assert ("second_per_grid_ts" in batch) == (arch == "qwen2_5_vl")  # Qwen2.5-VL's timing input
    if arch in ("qwen3_vl", "qwen3_5"):  # its timing is in the prompt: "<t seconds>" before each temporal grid
        assert "seconds>" in proc.tokenizer.decode(prompts[0].input_ids)
    seen: list[int] = []
    handle = model.model.visual.register_forward_hook(lambda mod, args, out: seen.append(args[0].shape[0]))
    try:
        with torch.no_grad():
            lp_s, ent_s = response_logprobs(model, batch, ids, with_entropy=True, shared=True, temperature=0.7)
            lp_p, ent_p = response_logprobs(model, batch, ids, with_entropy=True, shared=False, temperature=0.7)
    finally:
        handle.remove()
    m = mask.bool()
    dlp, dent = (lp_s - lp_p)[m].abs().max().item(), (ent_s - ent_p)[m].abs().max().item()
    print(f"{arch}: max |dlogp| {dlp:.2e}, max |dentropy| {dent:.2e} over {int(m.sum())} tokens")
    assert_within(dlp, FORWARD_BOUND, f"{arch}: shared vs plain log-probs, video prompts")
    assert_within(dent, FORWARD_BOUND, f"{arch}: shared vs plain entropies, video prompts")
    once = sample_images(batch, [batch["prompt_index"].tolist().index(p) for p in range(len(recs))])
    per_prompt = once["pixel_values"].shape[0] + once["pixel_values_videos"].shape[0]
    every = batch["pixel_values"].shape[0] + batch["pixel_values_videos"].shape[0]
    assert (
        sorted(seen)
        == sorted(
            [once["pixel_values"].shape[0], once["pixel_values_videos"].shape[0]]
            + [batch["pixel_values"].shape[0], batch["pixel_values_videos"].shape[0]]
        )
        and per_prompt < every
    )  # images and videos are separate tower calls
    packed = pack_groups(model, batch, ids.shape[1], torch.device("cpu"))
    assert torch.equal(packed.inputs["video_grid_thw"], once["video_grid_thw"])


def test_video_gradients_equal_the_plain_path_for_every_parameter(tiny_model, videos):
    """The policy loss's gradient wrt every parameter (vision tower included) with video prompts, shared vs plain,
    within the image path's relative bound."""
    model, proc = load_model(tiny_model("qwen2_5_vl"), torch.float32)
    use_video_settings(proc, **SMALL)
    model.train()
    _, batch, ids, mask = _processor_batch(proc, _records(videos), [2, 1, 3, 2], seed=1)
    adv = torch.randn(ids.shape[0], 1, generator=torch.Generator().manual_seed(0)).expand_as(ids)

    gs, gp = (loss_gradients(model, batch, ids, mask, adv, shared=x) for x in (True, False))
    assert set(gs) == set(gp) and any(k.startswith("model.visual") for k in gs)
    # a key projection's bias has a zero gradient in exact arithmetic (it adds q.b to every score of a query: softmax
    # ignores it), so what both paths compute for it is rounding noise, whose relative difference means nothing
    compared = [k for k in gp if gp[k].norm() > 0 and not k.endswith("k_proj.bias")]
    worst = max(((gs[k] - gp[k]).norm() / gp[k].norm()).item() for k in compared)
    print(f"{len(gp)} parameters, worst relative gradient difference {worst:.2e}")
    assert_within(worst, FORWARD_BOUND, "shared vs plain gradients with videos, worst relative difference")


@pytest.mark.parametrize("arch", ["qwen2_5_vl", "qwen3_vl"])
def test_engine_samples_video_prompts_as_the_plain_path(arch, tiny_model, videos):
    """The hf engine's prefill-once path gives the repeated-prompt path's tokens on video prompts (greedy and
    seeded), and the video reaches the model: another video gives other greedy tokens' log-probs."""
    model, proc = load_model(tiny_model(arch), torch.float32)
    use_video_settings(proc, **SMALL)
    prompts = [encode_prompt(proc, r) for r in _records(videos)]
    engine = make_engine("hf", model, proc)
    results = {}
    for once in (True, False):
        engine.prefill_once = once
        greedy = engine.generate(prompts, SamplingParams(n=2, temperature=0, max_new_tokens=6))
        torch.manual_seed(7)
        sampled = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=6))
        results[once] = [[x.response_ids.tolist() for x in out] for out in (greedy, sampled)]
    assert results[True] == results[False]
    other = encode_prompt(
        proc, PromptRecord(id="w", prompt="<video>Does the dot move left or right?", videos=[str(videos["b"])])
    )
    a, b = (
        engine.generate([p], SamplingParams(n=1, temperature=0, max_new_tokens=1, logprobs=True))[0]
        for p in (prompts[0], other)
    )
    assert not torch.equal(a.logprobs, b.logprobs)


@pytest.mark.parametrize("arch", VL)
def test_preflight_counts_video_tokens_from_headers_exactly(arch, tiny_model, videos, tmp_path):
    """``prompt_length`` (preflight) counts a video prompt's tokens from the file's header: equal to the encoded
    prompt's, Qwen3-VL's timestamps included; a truncated file whose header survives is counted, and decoding it
    is the one-line error naming it (the proof that counting decodes no frame)."""
    _, proc = load_model(tiny_model(arch), torch.float32)
    use_video_settings(proc, **SMALL)
    for rec in _records(videos):
        assert prompt_length(rec, proc) == encode_prompt(proc, rec).input_ids.numel()
    cut = _truncated_with_header(tmp_path)
    rec = PromptRecord(id="cut", prompt="<video>?", videos=[str(cut)])
    assert prompt_length(rec, proc) > 20
    with pytest.raises(DataError, match=f"corrupt video at frame .*: {cut}$"):
        encode_prompt(proc, rec)


def _truncated_with_header(tmp_path: Path) -> Path:
    """An mp4 written with its index first (``faststart``), cut in half: the header is whole, the frames are not."""
    full = tmp_path / "faststart.mp4"
    with av.open(str(full), "w", options={"movflags": "faststart"}) as c:
        s = c.add_stream("libx264", rate=10)
        s.width, s.height, s.pix_fmt = 64, 64, "yuv420p"
        for im in dot_frames((20, 32), "red", "right", frames=30, step=1, size=64, radius=5):
            c.mux(s.encode(av.VideoFrame.from_ndarray(np.asarray(im), format="rgb24")))
        c.mux(s.encode())
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(full.read_bytes()[: full.stat().st_size // 2])
    return cut


def _ten_hours(path: Path) -> Path:
    """A real 10-hour video: 3,600 16x16 frames at 0.1 frame per second."""
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=Fraction(1, 10))
        s.width, s.height, s.pix_fmt = 16, 16, "yuv420p"
        frame = np.zeros((16, 16, 3), np.uint8)
        for i in range(3600):
            frame[:] = i % 256
            c.mux(s.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        c.mux(s.encode())
    return path


def _bad_files(tmp_path: Path, good: Path) -> dict[str, Path]:
    text = tmp_path / "notes.mp4"
    text.write_text("not a video")
    empty = tmp_path / "empty.mp4"
    with av.open(str(empty), "w") as c:
        s = c.add_stream("libx264", rate=10)
        s.width, s.height, s.pix_fmt = 64, 48, "yuv420p"
        c.start_encoding()
    cut = tmp_path / "cut.mp4"  # an mp4 as written by default (its index last), cut: no header to read
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    return {"text": text, "empty": empty, "cut": cut, "missing": tmp_path / "missing.mp4"}


def test_bad_video_files_are_one_line_or_a_counted_skip(tmp_path, videos):
    """A text file named .mp4, a video of 0 frames, a cut mp4 and a missing file: each one located line naming the
    record's field and the file, or (``on_bad_record=skip``) a skip counted per reason; good records are kept with
    their videos as absolute paths."""
    bad = _bad_files(tmp_path, videos["a"])
    rows = [{"id": "ok", "prompt": "<video>?", "answer": "left", "videos": [str(videos["a"])]}]
    rows += [{"id": k, "prompt": "<video>?", "answer": "left", "videos": [p.name]} for k, p in bad.items()]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    want = {
        "text": "not a readable video (",
        "empty": "video has no frames (no video stream): ",
        "cut": "not a readable video (",
        "missing": "file not found: ",
    }
    for row, (key, path) in enumerate(bad.items(), start=2):
        one = tmp_path / f"{key}.jsonl"
        one.write_text(json.dumps(rows[0]) + "\n" + json.dumps(rows[row - 1]) + "\n")
        with pytest.raises(DataError) as err:
            read_records(one)
        msg = str(err.value)
        assert (
            "\n" not in msg and msg.startswith(f"{one}:2 field 'videos[0]': {want[key]}") and msg.endswith(str(path))
        ), msg
    records, report = read_records(data, on_bad_record="skip")
    assert [r.id for r in records] == ["ok"] and records[0].videos == [str(videos["a"])]
    assert report.skipped == 4 and dict(report.counts) == {"corrupt video": 2, "empty video": 1, "missing file": 1}


def test_a_ten_hour_video_is_refused_by_its_token_count_before_decoding(tmp_path, tiny_model):
    """A 10-hour video's prompt is counted from its header (768 frames at the pixel budget) and refused by
    ``max_prompt_length`` as one line naming the record, or skipped and counted."""
    long = _ten_hours(tmp_path / "ten_hours.mp4")
    _, proc = load_model(tiny_model("qwen2_5_vl"), torch.float32)
    rec = PromptRecord(id="long", prompt="<video>What happens?", videos=[str(long)])
    n = prompt_length(rec, proc)
    assert n > 50_000  # 384 temporal grids of 12x12 merged patches
    with pytest.raises(DataError) as err:
        filter_by_prompt_length([rec], proc, 2048)
    assert str(err.value) == (
        f"record 'long' field 'prompt': prompt has {n} tokens (image tokens included, 1 video(s) included) > "
        "max_prompt_length 2048"
    )
    assert filter_by_prompt_length([rec], proc, 2048, on_bad_record="skip") == []


def _video_jsonl(root: Path, n: int, seed: int) -> Path:
    """Dot-motion records as a user's JSONL: video paths relative to the file."""
    recs = make_dot_motion_records(n, root / "videos", seed=seed)
    rows = [{**r, "videos": [str(Path(r["videos"][0]).relative_to(root))]} for r in recs]
    path = root / f"records-{seed}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize("arch", VL)
def test_train_sft_and_train_policy_run_on_video_records(arch, tiny_model, tmp_path):
    """train-sft (two steps, held-out NLL falls) and train-policy (two GRPO steps with gradients) on a JSONL of
    video records with relative paths, on each Qwen-VL family."""
    path = tiny_model(arch)
    data = _video_jsonl(tmp_path, 8, seed=0)
    src = [f"data.train_source={data}", f"data.eval_source={data}", *SMALL_CLI, *QUIET]
    sft = tmp_path / "sft"
    args = ["train-sft", f"model.path={path}", f"train.output_dir={sft}", "train.max_steps=2", "train.batch_size=2"]
    assert main([*args, *src]) == 0
    rows = [json.loads(x) for x in (sft / "metrics.jsonl").read_text().splitlines()]
    nll = [r["eval/nll"] for r in rows if "eval/nll" in r]
    assert len(nll) == 2 and nll[1] < nll[0] and [r["eval/n"] for r in rows if "eval/n" in r] == [8.0, 8.0]
    rl = tmp_path / "rl"
    args = ["train-policy", f"model.path={path}", f"train.output_dir={rl}", "train.max_steps=2", "train.eval_every=0"]
    args += ["rollout.rollout_batch_size=2", "rollout.max_new_tokens=4", "optim.lr=1e-3"]
    assert main([*args, *src]) == 0
    rows = [json.loads(x) for x in (rl / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/combined" in r]
    assert [r["step"] for r in steps] == [1, 2] and all(r["train/grad_norm"] > 0 for r in steps)
    logged = [json.loads(x) for x in (rl / "samples.jsonl").read_text().splitlines()]
    assert logged and all(r["video"] == [str(tmp_path / "videos" / f"{r['id']}.mp4")] for r in logged)


def test_reward_models_score_and_train_on_videos_and_what_cannot_see_them_refuses(
    tiny_model, srm_dir, tmp_path, capsys
):
    """Local reward models see videos: train-policy scored by a scalar reward model on video records, train-reward-model
    (scalar, and judge) on records with videos, each trains; the RM's batches hold the videos' tokens. A served source
    (``kind: openai_judge``, ``http``) and the vllm engine take images only: each is one line before any model loads.
    ``vlrft eval`` generates on video records (hf engine), its report with a strip of frames per video."""
    from reward_models.encoding import encode_responses

    data = _video_jsonl(tmp_path, 4, seed=1)
    srm = srm_dir
    capsys.readouterr()  # (the model's build output, when built here)
    first = json.loads(data.read_text().splitlines()[0])["id"]
    out = tmp_path / "rl"
    args = ["train-policy", f"data.train_source={data}", "data.eval_source=", "rollout.rollout_batch_size=2"]
    args += ["train.max_steps=1", "rollout.max_new_tokens=2", "rollout.n_samples_per_prompt=2", *SMALL_CLI, *QUIET]
    acc = "{name: acc, kind: verifier, verifier: vocab_answer}"
    rm = "reward.sources=[" + acc + ", {name: rm, kind: srm, path: " + str(srm) + "}]"
    assert main([*args, rm, f"train.output_dir={out}"]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "reward/rm" in r] == [1]
    served = "reward.sources=[" + acc + ", {name: served, kind: openai_judge, url: 'http://127.0.0.1:9', model: j}]"
    assert main([*args, served, f"train.output_dir={tmp_path / 'h'}"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"vlrft train-policy: data error: {data}:1 field 'videos': record {first!r} has 1 video(s), which reward "
        "source 'served' (openai_judge j at http://127.0.0.1:9) does not see (served reward models take images only): "
        "score video records with verifiers, functions or local reward models (srm, grm)"
    )
    assert main([*args, "rollout.engine=vllm", f"train.output_dir={tmp_path / 'v'}"]) == 2
    assert capsys.readouterr().err == (
        f"vlrft train-policy: data error: {data}:1 field 'videos': record {first!r} has 1 video(s); "
        "rollout.engine=vllm takes images only; use rollout.engine=hf for records with videos\n"
    )
    assert not (tmp_path / "h").exists() and not (tmp_path / "v").exists()

    video = str(tmp_path / "videos" / f"{first}.mp4")
    pairs, judgments = tmp_path / "pairs.jsonl", tmp_path / "judgments.jsonl"
    row = {"prompt": "<video>Which way?", "videos": [video]}
    pairs.write_text(
        "".join(json.dumps({**row, "id": f"p{i}", "chosen": "left", "rejected": "right"}) + "\n" for i in range(4))
    )
    judgments.write_text(
        "".join(json.dumps({**row, "id": f"j{i}", "target": "<answer>yes</answer>"}) + "\n" for i in range(4))
    )
    for kind, source in (("srm", pairs), ("grm", judgments)):
        run = tmp_path / f"rm-{kind}"
        rm_args = ["train-reward-model", f"model.kind={kind}", f"data.train_source={source}", "data.eval_source="]
        rm_args += ["optim.lr=1e-3", "train.max_steps=2", "train.batch_size=2", *SMALL_CLI, *QUIET]
        assert main([*rm_args, f"train.output_dir={run}"]) == 0, kind
        assert (run / "final").is_dir()
    _, proc = load_model(tiny_model("qwen2_5_vl"), torch.float32)
    batch = encode_responses(proc, [("<video>Which way?", media_of_video(video), "left", None)])
    assert batch["video_grid_thw"].shape[0] == 1 and int((batch["input_ids"] == proc.video_token_id).sum()) > 0

    args = ["eval", "--benchmark", "dots", "--verifier", "exact_match", "--model", str(tiny_model("qwen3_vl"))]
    args += ["--data", str(data), "--out", str(tmp_path / "eval"), "--max-new-tokens", "2", "--no-progress"]
    assert main(args) == 0
    report = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert report["num_problems"] == 4
    rows = [json.loads(x) for x in (tmp_path / "eval" / "samples.jsonl").read_text().splitlines()]
    assert [r["videos"] for r in rows] == [[str(tmp_path / "videos" / f"{r['id']}.mp4")] for r in rows]
    page = (tmp_path / "eval" / "report.html").read_text()
    assert page.count("alt='video frame'") == 4 * 8  # a strip of 8 frames per video (each has 8)


def media_of_video(path: str) -> list:
    from data_pipelines.records import PromptRecord as Record
    from data_pipelines.records import media

    return media(Record(id="x", prompt="", videos=[path]))


def test_the_example_in_docs_video_runs_as_written(tmp_path, monkeypatch):
    """docs/video.md's example: its Python block as written (writing the dot-motion files), then its two commands
    as written, cut to two steps each (the full run is tests/test_video_learning.py)."""
    import re
    import shlex

    text = (Path(__file__).parents[1] / "docs" / "video.md").read_text()
    example = text[text.index("## Example") :]
    code = re.findall(r"```python\n(.*?)```", example, re.S)[0]
    commands = re.findall(r"```bash\n(.*?)```", example, re.S)[0].replace("\\\n", " ").strip().splitlines()
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dots").mkdir()
    exec(compile(code, "docs/video.md", "exec", dont_inherit=True), {"__name__": "docs_example"})
    assert len((tmp_path / "dots" / "train.jsonl").read_text().splitlines()) == 256
    assert len(commands) == 2
    for line in commands:
        words = shlex.split(line)
        assert words[0] == "vlrft"
        assert main([*words[1:], "train.max_steps=2", "train.eval_every=0", *QUIET]) == 0
    assert (tmp_path / "runs" / "dots-grpo" / "final" / "model.safetensors").is_file()


def test_chat_records_take_videos_as_placeholders_parts_and_columns(tiny_model, videos, tmp_path):
    """train-sft's chat rows: a ``<video>`` placeholder filled from ``videos``, an inline ``{"type": "video"}`` part,
    and a prompt + response row; each encodes its video (tokens from the file, labels on the answer only), and a
    bad video in a chat row is one located line."""
    from data_pipelines.chat import IGNORE_INDEX, encode_chat, read_chat_records

    _, proc = load_model(tiny_model("qwen2_5_vl"), torch.float32)
    use_video_settings(proc, **SMALL)
    rows = [
        {
            "messages": [{"role": "user", "content": "<video>Which way?"}, {"role": "assistant", "content": "left"}],
            "videos": [videos["a"].name],
        },
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "video", "video": str(videos["b"])}, {"type": "text", "text": "Which way?"}],
                },
                {"role": "assistant", "content": "right"},
            ]
        },
        {"prompt": "Which way?", "response": "left", "videos": [videos["frames"]]},
    ]
    data = videos["a"].parent / "chats.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    chats, report = read_chat_records(data, processor=proc)
    assert report.kept == 3 and [c.videos for c in chats] == [
        [str(videos["a"])],
        [str(videos["b"])],
        [videos["frames"]],
    ]
    video_id = proc.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    for chat, answer in zip(chats, ["left", "right", "left"]):
        enc = encode_chat(proc, chat)
        assert enc.num_videos == 1 and int((enc.input_ids == video_id).sum()) > 0
        target = enc.labels[enc.labels != IGNORE_INDEX]
        assert proc.tokenizer.decode(target) == f"{answer}<|im_end|>"
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "Which way?", "response": "left", "videos": ["nope.mp4"]}) + "\n")
    with pytest.raises(DataError) as err:
        read_chat_records(bad, processor=proc)
    assert str(err.value) == f"{bad}:1 field 'messages[0]': file not found: {tmp_path / 'nope.mp4'}"


def test_sft_holds_no_decoded_video_between_batches(tiny_model, videos):
    """train-sft's encoder caches image conversations but never a video's pixels (each batch decodes its videos); the
    token count it plans micro-batches with comes from the headers and equals the encoded length."""
    from data_pipelines.chat import ChatRecord, chat_from_prompt
    from vlrft.config import load_config
    from vlrft.trainer.supervised_config import SFTTrainConfig
    from vlrft.trainer.supervised_run import SFTTask

    _, proc = load_model(tiny_model("qwen2_5_vl"), torch.float32)
    use_video_settings(proc, **SMALL)
    task = SFTTask(proc, load_config(SFTTrainConfig, None, []), "cpu")
    video = chat_from_prompt(_records(videos)[0], "left")
    text = ChatRecord("t", [m for m in chat_from_prompt(_records(videos)[1], "ok").messages])
    for chat in (video, text):
        batch = task.encode([chat])
        assert task.tokens(chat) == batch["input_ids"].shape[1]
    assert "pixel_values_videos" in task.encode([video])
    assert list(task.enc.cache) == [id(text)]
