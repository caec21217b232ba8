"""Multi-turn rollouts with tools through the hf engine (issue 26 items 1-4 and 6), with a real policy that calls
the zoom tool (``tool_policy``: a tiny Qwen2.5-VL after 60 steps of train-sft on tool demonstrations):

- trajectories run turn by turn for a whole batch: the call is parsed, the tool's image comes back as the next
  turn's image, the policy answers; what the engine sampled plus the observations is token for token the chat
  template's rendering of the conversation, and only the sampled tokens are marked for training;
- user tools from the user's file that raise, hang, return the wrong type, kill their worker, or break their schema
  give an error observation the policy sees and a counted metric, within the time limit, never a crash or a hang;
  an unknown tool, the token budget, the turn limit and withheld answers end as documented;
- a user tool that cannot load or has no schema is one line before anything runs;
- train-policy trains on trajectories (tool metrics, turns in samples.jsonl, the loss over sampled tokens only);
- vlrft eval runs the same environment with and without tools and shows each turn with its images in the report.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from launch import QUIET
from tool_runs import two_tool_steps

from data_pipelines.chat import ChatRecord, encode_chat
from data_pipelines.collate import encode_prompt, processor_image_kwargs
from data_pipelines.synthetic import make_prompt_records, write_prompt_records
from vlrft.cli import main
from vlrft.models.loading import load_model
from vlrft.rollout import SamplingParams, make_engine
from vlrft.rollout.trajectories import TrajectoryRunner
from vlrft.tools import ToolBox, ToolsConfig

GREEDY = SamplingParams(n=1, temperature=0.0, max_new_tokens=32)

HOSTILE = """
import os, time
from PIL import Image

SCHEMA = {"type": "function", "function": {"name": "zoom", "description": "zoom", "parameters": {
    "type": "object", "properties": {"region": {"type": "string"}}, "required": ["region"]}}}


def raises(region, images):
    raise RuntimeError("the lens fell off")


def hangs(region, images):
    time.sleep(3600)


def wrong_type(region, images):
    return {"pixels": 3}


def exits(region, images):
    os._exit(3)


def works(region, images):
    return [f"zoomed into {region}", images[0].resize((56, 56))]


def wants_a_box(box):
    return "never called"


for fn in (raises, hangs, wrong_type, exits, works):
    fn.schema = SCHEMA
wants_a_box.schema = {"type": "function", "function": {"name": "zoom", "description": "", "parameters": {
    "type": "object", "properties": {"box": {"type": "array"}}, "required": ["box"]}}}
"""


@pytest.fixture(scope="module")
def policy(tool_policy):
    return load_model(tool_policy, "float32")


@pytest.fixture(scope="module")
def hostile(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("user-tools") / "tools.py"
    path.write_text(HOSTILE)
    return path


def _run(policy, cfg: ToolsConfig, n: int = 4, withheld: bool = False, sampling: SamplingParams = GREEDY):
    model, processor = policy
    box = ToolBox(cfg, processor_image_kwargs(processor))
    try:
        runner = TrajectoryRunner(make_engine("hf", model, processor), processor, box, cfg, withheld)
        records = make_prompt_records("mark_color", n, seed=7, image_size=256)
        prompts = [encode_prompt(processor, r, tools=box.schemas) for r in records]
        return records, prompts, runner.run(records, prompts, sampling), box.schemas
    finally:
        box.close()


def test_trajectories_run_turn_by_turn_and_are_the_template_of_their_conversation(policy):
    _, processor = policy
    cfg = ToolsConfig(names=["zoom"], max_turns=3, max_tokens=256)
    records, prompts, rollouts, schemas = _run(policy, cfg)
    again = _run(policy, cfg)[2]
    assert [x.response_ids.tolist() for x in rollouts] == [x.response_ids.tolist() for x in again]  # greedy
    for record, prompt, x in zip(records, prompts, rollouts):
        t = x.trajectory
        assert t.calls == {"zoom": 1} and t.errors == {} and len(t.turns) == 2, t.turns
        assert t.turns[0]["calls"][0]["name"] == "zoom" and t.turns[0]["observations"] == [{"text": "", "images": 1}]
        assert x.finish_reason == "stop" and x.text == t.turns[1]["text"]
        most = processor.image_processor.size["longest_edge"]  # a quadrant at the most pixels the processor takes
        assert t.num_images == 1 and t.response.images[0].size[0] ** 2 == most
        whole = encode_chat(processor, ChatRecord(record.id, prompt.messages + t.messages), tools=schemas)
        assert torch.equal(torch.cat([prompt.input_ids, x.response_ids]), whole.input_ids[:-1])
        assert torch.equal(torch.cat([prompt.pixel_values, t.response.pixel_values]), whole.pixel_values)
        labelled = (whole.labels[prompt.input_ids.numel() : -1] != -100).long()
        assert torch.equal(t.action_mask, labelled)  # the sampled tokens are the assistant's, nothing else
        sampled = sum(len(processor.tokenizer(turn["text"])["input_ids"]) + 1 for turn in t.turns)
        assert int(t.action_mask.sum()) == sampled


@pytest.mark.parametrize(
    "fn, kind, says",
    [
        ("raises", "raised", "RuntimeError: the lens fell off"),
        ("hangs", "timeout", "took longer than 2 s"),
        ("wrong_type", "raised", "returned dict"),
        ("exits", "raised", "died (exit code 3)"),
        ("wants_a_box", "bad_arguments", "missing argument 'box'"),
    ],
)
def test_a_failing_user_tool_is_an_observation_counted_within_the_time_limit(policy, hostile, fn, kind, says):
    cfg = ToolsConfig(names=[f"{hostile}:{fn}"], max_turns=3, timeout_s=2.0)
    t0 = time.monotonic()
    rollouts = _run(policy, cfg, n=2)[2]
    assert time.monotonic() - t0 < 60  # each call is cut at 2 s (the worker's start is not part of it)
    for x in rollouts:
        t = x.trajectory
        # counted; a retry may fail otherwise (the policy never saw an error in its demonstrations)
        assert t.errors.get(kind, 0) >= 1 and t.calls == {}, (t.errors, t.turns)
        observed = t.turns[0]["observations"][0]["text"]
        assert observed.startswith("error: ") and says in observed, observed
        # the policy saw the error and went on (tried again, answered, or rambled to its turn limit: it never saw an
        # error in its demonstrations); the run went on to its end
        assert len(t.turns) >= 2 and x.finish_reason in ("stop", "max_turns", "length"), (x.finish_reason, t.turns)


def test_a_working_user_tool_returns_text_and_an_image(policy, hostile):
    rollouts = _run(policy, ToolsConfig(names=[f"{hostile}:works"], max_turns=3))[2]
    for x in rollouts:
        t = x.trajectory
        assert t.calls == {"zoom": 1} and t.errors == {}
        assert t.turns[0]["observations"] == [
            {"text": f"zoomed into {t.turns[0]['calls'][0]['arguments']['region']}", "images": 1}
        ]
        assert t.response.images[0].size == (56, 56)


def test_unknown_tools_budgets_turn_limits_and_withheld_answers_end_as_documented(policy):
    unknown = _run(policy, ToolsConfig(names=["calculator"], max_turns=3), n=2)[2]
    assert all(x.trajectory.errors == {"unknown_tool": 1} for x in unknown)
    assert "unknown tool 'zoom' (tools: calculator)" in unknown[0].trajectory.turns[0]["observations"][0]["text"]
    off = _run(policy, ToolsConfig(names=["zoom"], max_turns=3), n=2, withheld=True)[2]
    for x in off:  # the call runs, its image comes back blank
        assert x.trajectory.calls.get("zoom", 0) >= 1 and x.trajectory.errors == {}
        assert {im.getextrema() for im in x.trajectory.response.images} == {((128, 128),) * 3}
    one_turn = _run(policy, ToolsConfig(names=["zoom"], max_turns=1), n=2)[2]
    assert all(x.finish_reason == "max_turns" and len(x.trajectory.turns) == 1 for x in one_turn)
    short = _run(policy, ToolsConfig(names=["zoom"], max_turns=3, max_tokens=30), n=2)[2]  # the image alone is 18
    assert all(x.finish_reason == "budget" and x.response_ids.numel() <= 30 for x in short)
    tiny = _run(policy, ToolsConfig(names=["zoom"], max_turns=3, max_tokens=10), n=2)[2]
    assert all(x.finish_reason == "budget" and x.response_ids.numel() == 10 for x in tiny)  # cut mid-turn
    # a call cut before its turn ended is a failed call, counted (tools.error_reward): never cheaper than a
    # malformed call that ends its turn (an RL policy learnt to dodge the penalty by never closing its turns)
    cut = _run(policy, ToolsConfig(names=["zoom"], max_turns=3), n=2, sampling=replace(GREEDY, max_new_tokens=8))[2]
    for x in (*tiny, *cut):
        assert x.text.startswith("<tool_call>") and "</tool_call>" not in x.text, x.text
        assert x.trajectory.errors == {"malformed": 1} and x.trajectory.calls == {}, x.trajectory.turns
        assert x.trajectory.turns[-1]["calls"] == [
            {"error": "malformed", "message": "a <tool_call> without its </tool_call>"}
        ]
    assert all(x.finish_reason == "length" for x in cut)


def test_tools_that_cannot_load_are_one_line_before_the_run(hostile, tmp_path, capsys):
    (tmp_path / "no_schema.py").write_text("def zoom(region):\n    return region\n")
    (tmp_path / "broken.py").write_text("import nonexistent_module_xyz\n")
    cases = [
        ("zooom", "tools.names[0]=zooom: unknown tool; built in: zoom, crop, rotate, calculator"),
        (f"{tmp_path / 'no_schema.py'}:zoom", "no_schema.py:1: no schema: give the function a `schema` attribute"),
        (f"{tmp_path / 'broken.py'}:zoom", f"importing {tmp_path / 'broken.py'} failed: {tmp_path / 'broken.py'}:1:"),
        (f"{hostile}:absent", "has no function 'absent'"),
    ]
    for name, says in cases:
        out = tmp_path / "run"
        args = ["train-policy", f"tools.names=[{name}]", "train.max_steps=1", f"train.output_dir={out}", *QUIET]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err.startswith("vlrft train-policy: config error: tools.names[0]=") and says in err, err
        assert err.count("\n") == 1
        assert not out.exists()  # refused before the run folder


def test_train_policy_trains_on_trajectories(policy, tool_policy, tmp_path):
    out = tmp_path / "rl"
    rows = two_tool_steps(tool_policy, out, "train.eval_every=2")
    steps = [r for r in rows if "tools/calls" in r and "reward/combined" in r]
    # sampled at temperature 1, most trajectories zoom once; each zoom returns one image
    assert len(steps) == 2 and all(r["tools/images"] == r["tools/calls/zoom"] >= 0.5 for r in steps), steps
    evals = [r for r in rows if "eval/accuracy" in r]
    assert all("eval/tools/calls" in r and "eval/withheld/accuracy" in r for r in evals), evals
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert all("turns" in s and s["response"] == s["turns"][-1]["text"] for s in samples)
    assert any(
        s["tool_calls"] == {"zoom": 1} and s["turns"][0]["observations"] == [{"text": "", "images": 1}] for s in samples
    )


def test_vlrft_eval_runs_the_environment_with_and_without_tools_and_shows_each_turn(tool_policy, tmp_path, capsys):
    records = make_prompt_records("mark_color", 4, seed=10000, image_size=256)
    data = write_prompt_records(records, tmp_path / "test.jsonl")
    out = tmp_path / "eval"
    args = ["eval", "--benchmark", "mark_color", "--verifier", "vocab_answer", "--model", str(tool_policy)]
    args += ["--data", str(data), "--tools", "zoom", "--max-turns", "3", "--max-new-tokens", "32", "--out", str(out)]
    assert main([*args, "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "mark_color: accuracy" in printed and "mark_color with the tools' answers withheld: accuracy" in printed
    with_tools = json.loads((out / "metrics.json").read_text())
    without = json.loads((out / "withheld" / "metrics.json").read_text())
    assert with_tools["tools/calls/zoom"] >= 0.5 and with_tools["tools/images"] == with_tools["tools/calls/zoom"]
    assert without["tools/calls/zoom"] >= 0.5 and without.get("tools/errors", 0) == 0
    row = json.loads((out / "samples.jsonl").read_text().splitlines()[0])
    turns = row["responses"][0]["turns"]
    assert turns[0]["calls"][0]["name"] == "zoom" and row["responses"][0]["text"] == turns[-1]["text"]
    report = (out / "report.html").read_text()
    assert report.count("alt='returned image'") == round(4 * with_tools["tools/images"])  # each turn's image shown
    assert "<i>turn 2</i>" in report
