"""User code under hostile use (issue 64): reward functions and tools that end the process, fork, print to the
reply pipe, answer tens of megabytes or a giant image, return what is not a number, carry broken schemas, hang at
import or look for the trainer's secrets. Each is a failure of that code, counted or one line, never a silent end,
a corrupted reply, a leaked process or a run taken down. The user code lives in files the tests write."""

from __future__ import annotations

import os
import re
import sys
import textwrap
import time
from pathlib import Path

import pytest
from launch import QUIET

from data_pipelines.images import DEFAULT_MAX_IMAGE_PIXELS
from data_pipelines.records import PromptRecord
from reward_models.pool import RewardPool, RewardPoolConfig, RewardSourceError
from vlrft.cli import main
from vlrft.config import load_config
from vlrft.processes import stat_fields
from vlrft.tools import ToolBox, ToolsConfig
from vlrft.tools.base import CallError, ToolCall, ToolResult
from vlrft.tools.box import CHARS_PER_TOKEN

REWARDS = """
import math, os, subprocess, sys, time


def exits(sample):
    if sample.id == "b":
        sys.exit(0)
    return 1.0


def ends_the_run(sample):
    sys.exit()


def interrupted(sample):
    if sample.id == "b":
        raise KeyboardInterrupt
    return 1.0


def forks(sample, pids):
    child = subprocess.Popen(["sleep", "1000"])
    with open(pids, "a") as f:
        f.write(f"{child.pid}\\n")
    if sample.id == "b":
        time.sleep(3600)
    return 1.0


def prints(sample):
    os.system(f"echo hi from the shell {sample.id}")
    print(f"x from python {sample.id}")
    return 1.0


def huge(sample):
    return 10**400 if sample.id == "b" else 1.0


def extras(sample):
    return {"score": 1.0, "big": 1e308, "nan": math.nan, "word": "x", "nested": {"a": 1}, "errors": 5.0}


def environment(sample):
    return {
        "score": 1.0,
        "secret": float("VLRFT_TEST_SECRET_TOKEN" in os.environ),
        "added": float(os.environ.get("MY_ADDED_NAME") == "yes"),
        "path": float("PATH" in os.environ),
    }
"""

TOOLS = """
import os, sys
from PIL import Image

NO_ARGUMENTS = {"type": "object", "properties": {}}


def photo():
    os.system("echo a shell line in the tool")
    return Image.new("RGB", (4032, 3024), (10, 20, 30))


def giant():
    return Image.new("1", (20000, 20000))


def chatty():
    return "x" * 50_000_000


def wrong_type():
    return {"pixels": 3}


def exits():
    sys.exit(0)


for fn in (photo, giant, chatty, wrong_type, exits):
    fn.schema = NO_ARGUMENTS
"""


@pytest.fixture(scope="module")
def rewards(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("user") / "hostile_rewards.py"
    path.write_text(textwrap.dedent(REWARDS))
    return path


@pytest.fixture(scope="module")
def tools(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("user-tools") / "hostile_tools.py"
    path.write_text(TOOLS)
    return path


@pytest.fixture(scope="module")
def tool_logs(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tool-logs")


@pytest.fixture(scope="module")
def box(tools, tool_logs):
    """One worker for the tools below (its start, importing transformers, is most of a tool test's time); 2048 MB of
    address space (the worker holds 0.8 GB after its imports): room for giant's 400 MB bitmap, none for its 1.2 GB
    RGB conversion. What it prints goes to ``tool_logs``."""
    names = [f"{tools}:{fn}" for fn in ("photo", "giant", "chatty", "wrong_type")]
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLRFT_WORKER_LOG_DIR", str(tool_logs))
        box = ToolBox(ToolsConfig(names=names, num_workers=1, memory_limit_mb=2048, max_tokens=256, timeout_s=60))
    yield box
    box.close()


@pytest.fixture(autouse=True)
def worker_logs(tmp_path, monkeypatch):
    """What the workers print goes to the test's folder, not the shared temporary one."""
    monkeypatch.setenv("VLRFT_WORKER_LOG_DIR", str(tmp_path / "logs"))


def _line(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


RECORDS = [PromptRecord(id=i, prompt="Name the colour.", answer="red", task="colors") for i in ("a", "b", "c")]
RESPONSES = ["red", "blue", "red"]


def _score(*sources: str):
    pool = RewardPool(load_config(RewardPoolConfig, None, [f"sources=[{', '.join(sources)}]"]))
    try:
        return pool.score(RECORDS, RESPONSES)
    finally:
        pool.close()


# -- 1: sys.exit and KeyboardInterrupt in user code are failures of that code, never the end of the run -----------
@pytest.fixture(params=["python", "wandb"])
def exit_hook(request, monkeypatch):
    """``sys.exit`` as Python has it, or wrapped by a library as wandb's run does (and leaves it): the failure is
    located at the user's line either way, not in the library's wrapper."""
    if request.param == "wandb":
        from wandb.sdk.lib.exit_hooks import ExitHooks

        monkeypatch.setattr(sys, "exit", sys.exit)
        monkeypatch.setattr(sys, "excepthook", sys.excepthook)
        ExitHooks().hook()
    return request.param


INLINE_EXITS = {"exits": "SystemExit(0): a reward function may not end the run", "interrupted": "KeyboardInterrupt"}


@pytest.mark.parametrize("fn", list(INLINE_EXITS))
def test_an_inline_function_calling_sys_exit_or_raising_keyboardinterrupt_is_a_counted_failure(
    rewards, fn, capfd, exit_hook
):
    says = INLINE_EXITS[fn]
    common = f"kind: function, function: '{rewards}:{fn}', isolation: inline"
    out = _score(f"{{name: f, {common}, fallback: -1.0, max_failure_share: 1.0}}")
    assert out.per_source["f"].tolist() == [1.0, -1.0, 1.0]
    assert out.metrics["reward/f/errors"] == 1 and out.metrics["reward/f/failures"] == 1
    line = _line(rewards, "sys.exit(0)" if fn == "exits" else "raise KeyboardInterrupt")
    assert f"failed on record 'b': {rewards}:{line}: {says}" in capfd.readouterr().err
    with pytest.raises(RewardSourceError, match=re.escape(f"{rewards}:{line}: {says}")):
        _score(f"{{name: f, {common}}}")


def test_an_inline_tool_calling_sys_exit_is_an_error_observation(tools, exit_hook):
    box = ToolBox(ToolsConfig(names=[f"{tools}:exits"], isolation="inline"))
    try:
        result = box.run(ToolCall("exits", {}), [])
    finally:
        box.close()
    line = _line(tools, "sys.exit(0)")
    assert result == CallError(
        "raised", f"exits failed: {tools}:{line}: SystemExit(0): a tool may not end the run", "exits"
    )


def test_train_policy_whose_inline_function_calls_sys_exit_stops_with_one_line_and_code_2(
    rewards, tmp_path, capsys, monkeypatch
):
    """Before: exit code 0, no message, no model. After: the reward source's one line, exit 2, no final model; the
    process-isolated source beside it printed into the run's worker logs (item 3)."""
    monkeypatch.delenv("VLRFT_WORKER_LOG_DIR")  # the run's own folder: logs/workers
    out = tmp_path / "run"
    inline = f"{{name: mine, kind: function, function: '{rewards}:ends_the_run', isolation: inline}}"
    printer = f"{{name: printer, kind: function, function: '{rewards}:prints', weight: 0.0}}"
    args = ["train-policy", f"train.output_dir={out}", "train.max_steps=1", "data.eval_source=", *QUIET]
    assert main([*args, f"reward.sources=[{printer}, {inline}]"]) == 2
    err = capsys.readouterr().err
    assert err.endswith(
        f"vlrft train-policy: reward source error: reward source 'mine' (function) failed on record 'color-0-684': "
        f"{rewards}:{_line(rewards, 'sys.exit()')}: SystemExit(None): a reward function may not end the run "
        "(no fallback set: reward.sources[].fallback)\n"
    ), err
    assert not (out / "final").exists()
    logs = "".join(p.read_text() for p in (out / "logs" / "workers").glob("reward-printer.*.log"))
    assert "hi from the shell color-0-684\n" in logs and "x from python color-0-684\n" in logs


# -- 2: what a function starts dies with its worker ---------------------------------------------------------------
def _alive(pid: int) -> bool:
    fields = stat_fields(pid)
    return fields is not None and fields[0] != "Z"  # a zombie is dead, waiting for its reaper


def test_processes_a_function_starts_die_with_its_worker_on_timeout_and_on_close(rewards, tmp_path):
    pids = tmp_path / "pids.txt"
    source = (
        f"{{name: f, kind: function, function: '{rewards}:forks', function_kwargs: {{pids: '{pids}'}}, "
        "timeout_s: 3, num_workers: 1, fallback: 0.0, max_failure_share: 1.0}"
    )
    pool = RewardPool(load_config(RewardPoolConfig, None, [f"sources=[{source}]"]))
    try:
        out = pool.score(RECORDS, RESPONSES)
        started = [int(p) for p in pids.read_text().split()]
        assert out.per_source["f"].tolist() == [1.0, 0.0, 1.0] and len(started) == 3
        assert out.metrics["reward/f/timeouts"] == 1
        t0 = time.monotonic()
        while _alive(started[1]) and time.monotonic() - t0 < 10:  # SIGKILL is delivered, not awaited
            time.sleep(0.05)
        # one worker scored a and b: killed at b's timeout, with both its sleepers; c's lives while its worker does
        assert not _alive(started[0]) and not _alive(started[1])
        assert _alive(started[2])
    finally:
        pool.close()
    t0 = time.monotonic()
    while any(map(_alive, started)) and time.monotonic() - t0 < 10:
        time.sleep(0.05)
    assert [p for p in started if _alive(p)] == []


# -- 3: prints of user code go to a per-worker log, never into the reply pipe ------------------------------------
def test_a_function_and_a_tool_writing_to_stdout_score_correctly_and_their_lines_are_in_the_worker_log(
    rewards, box, tool_logs, tmp_path
):
    out = _score(f"{{name: loud, kind: function, function: '{rewards}:prints', num_workers: 1}}")
    assert out.per_source["loud"].tolist() == [1.0, 1.0, 1.0] and out.metrics["reward/loud/errors"] == 0
    (log,) = (tmp_path / "logs").glob("reward-loud.*.log")  # one worker, one log
    assert log.read_text().splitlines() == [f"{w} {i}" for i in "abc" for w in ("hi from the shell", "x from python")]
    result = box.run(ToolCall("photo", {}), [])
    assert isinstance(result, ToolResult) and result.images[0].getpixel((0, 0)) == (10, 20, 30)
    (log,) = tool_logs.glob("tools.*.log")  # one worker, one log
    assert set(log.read_text().splitlines()) == {"a shell line in the tool"}  # a line per call of photo


# -- 4: a reply of tens of megabytes is read in linear time -------------------------------------------------------
REPLY_BOUND_S = 6.0  # measured 1.5-1.7 s on the 2-core machine at load 5.7-8.6 (the quadratic read: 25-32 s)


def test_a_36_mb_image_reply_is_read_within_a_bound(box):
    box.run(ToolCall("photo", {}), [])  # warm: the tool's module imported in its worker
    t0 = time.perf_counter()
    result = box.run(ToolCall("photo", {}), [])
    took = time.perf_counter() - t0
    assert isinstance(result, ToolResult) and result.images[0].size == (4032, 3024)  # 36.6 MB of pixels
    assert took < REPLY_BOUND_S, took


# -- 5, 6: a giant image is refused, a flood of text is cut before it is tokenized ----------------------------------
def test_a_tool_image_over_the_record_cap_is_an_error_observation_within_a_memory_limit(tools, box):
    result = box.run(ToolCall("giant", {}), [])  # within the box's memory limit: the RGB copy was never made
    assert result == CallError(
        "raised",
        f"giant failed: {tools}:{_line(tools, 'def giant')} (giant): returned a 20000x20000 image (400000000 pixels), "
        f"more than the {DEFAULT_MAX_IMAGE_PIXELS} a record image may have",
        "giant",
    )


def test_a_tool_answering_50_mb_of_text_is_cut_to_its_budget_in_the_worker(box):
    t0 = time.perf_counter()
    result = box.run(ToolCall("chatty", {}), [])
    took = time.perf_counter() - t0
    kept = 256 * CHARS_PER_TOKEN
    assert result.text == "x" * kept + f"\n[{50_000_000 - kept} more characters cut]"
    assert took < 3.0, took  # measured 0.09 s at load 8.6


# -- 7: one line at preflight, at the user's file ---------------------------------------------------------------
BAD_SCHEMAS = {
    "required_int": ('{"type": "object", "properties": {}, "required": 5}', "'required' is 5; want a list of argument"),
    "a_string": ('"takes a region"', "its schema is a str; want a dict"),
    "no_name": (
        '{"type": "function", "function": {"parameters": {"type": "object"}}}',
        'its schema {"type": "function", ...} names no tool: want "function": {"name": ...}',
    ),
}


@pytest.mark.parametrize("fn", list(BAD_SCHEMAS))
def test_a_broken_tool_schema_is_one_line_at_preflight_naming_the_tool_and_file(fn, tmp_path, capsys):
    schema, says = BAD_SCHEMAS[fn]
    path = tmp_path / "schemas.py"
    path.write_text(f"def {fn}():\n    return 'hi'\n\n\n{fn}.schema = {schema}\n")
    out = tmp_path / "run"
    args = ["train-policy", f"tools.names=[{path}:{fn}]", f"train.output_dir={out}", *QUIET]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"vlrft train-policy: config error: tools.names[0]={path}:{fn}: {path}:1: ") and says in err
    assert err.count("\n") == 1 and not out.exists()


def test_a_function_spec_naming_a_file_that_is_not_python_is_one_line_at_preflight(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for name in ("data.json", "script.sh"):
        (tmp_path / name).write_text("{}\n")
    cases = {
        f"{tmp_path / 'script.sh'}:fn": f"{tmp_path / 'script.sh'} is not a Python file; want path/to/file.py:function",
        "data.json:fn": "data.json is a file but not a Python file; want path/to/file.py:function",
    }
    for spec, says in cases.items():
        source = f"reward.sources=[{{name: mine, kind: function, function: '{spec}'}}]"
        assert main(["train-policy", f"train.output_dir={tmp_path / 'run'}", source]) == 2
        assert capsys.readouterr().err == (
            f"vlrft train-policy: config error: reward.sources[0].function={spec}: {says}\n"
        )


def test_a_function_returning_an_int_too_large_for_a_float_is_a_counted_failure_naming_it(rewards, capfd):
    out = _score(f"{{name: f, kind: function, function: '{rewards}:huge', fallback: 0.0, max_failure_share: 1.0}}")
    assert out.per_source["f"].tolist() == [1.0, 0.0, 1.0] and out.metrics["reward/f/errors"] == 1
    where = f"{rewards}:{_line(rewards, 'def huge')}"
    assert f"failed on record 'b': {where}: returned an integer of 1329 bits, too large for a float" in (
        capfd.readouterr().err
    )


def test_a_tool_returning_the_wrong_type_is_reported_at_the_users_tool(tools, box):
    result = box.run(ToolCall("wrong_type", {}), [])
    where = f"{tools}:{_line(tools, 'def wrong_type')}"
    assert result.message == (
        f"wrong_type failed: {where} (wrong_type): returned dict; want text, a PIL image, a list of them or "
        "{text, images}"
    )


# -- 8: extras averaged without overflow, the dropped ones counted and said once ----------------------------------
def test_extras_average_without_overflow_and_those_dropped_are_counted_and_named_once(rewards, capfd):
    out = _score(f"{{name: f, kind: function, function: '{rewards}:extras', isolation: inline}}")
    assert out.metrics["reward/f/big"] == 1e308  # the sum of three would be inf
    assert out.metrics["reward/f/dropped_extras"] == 12  # nan, word, nested, errors: for each of 3 samples
    assert out.metrics["reward/f/errors"] == 0  # the function's own "errors" never replaces the count
    err = capfd.readouterr().err
    where = f"{rewards}:{_line(rewards, 'def extras')}"
    for key, why in [
        ("nan", "nan"),
        ("word", "str 'x'; want a finite number"),
        ("nested", "dict \"{'a': 1}\"; want a finite number"),
        ("errors", "a name of the source's own metrics"),
    ]:
        line = (
            f"warning: reward source 'f' ({where}): extra {key!r} dropped: {why} (counted in reward/f/dropped_extras)"
        )
        assert err.count(line) == 1, err


# -- 9: what reaches a worker's environment; an import that hangs -------------------------------------------------
def test_workers_see_only_the_allow_listed_environment(rewards, monkeypatch):
    monkeypatch.setenv("VLRFT_TEST_SECRET_TOKEN", "s3cret")
    monkeypatch.setenv("MY_ADDED_NAME", "yes")
    monkeypatch.setenv("VLRFT_WORKER_ENV", "MY_ADDED_*")
    out = _score(f"{{name: f, kind: function, function: '{rewards}:environment', num_workers: 1}}")
    assert out.per_source["f"].tolist() == [1.0, 1.0, 1.0]
    assert (out.metrics["reward/f/secret"], out.metrics["reward/f/added"], out.metrics["reward/f/path"]) == (0, 1, 1)


def test_a_module_that_hangs_at_import_is_one_line_at_preflight_after_the_time_limit(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("VLRFT_IMPORT_TIMEOUT_S", "2")
    path = tmp_path / "slow.py"
    path.write_text("import time\n\ntime.sleep(3600)\n\n\ndef score(sample):\n    return 1.0\n")
    source = f"reward.sources=[{{name: mine, kind: function, function: '{path}:score'}}]"
    t0 = time.monotonic()
    assert main(["train-policy", f"train.output_dir={tmp_path / 'run'}", source]) == 2
    assert time.monotonic() - t0 < 30
    assert capsys.readouterr().err == (
        f"vlrft train-policy: config error: reward.sources[0].function={path}:score: importing {path} did not finish "
        "within 2 s (VLRFT_IMPORT_TIMEOUT_S)\n"
    )
    assert not os.path.exists(tmp_path / "run")
