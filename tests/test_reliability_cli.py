"""One clean line per known failure, tracebacks only with --debug, plain progress lines in log files
(issue 11: "Raw tracebacks", "Logs on a cluster")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from data_pipelines.errors import DataError
from data_pipelines.records import PromptRecord
from reward_models.pool import RewardPool, RewardPoolConfig, RewardSourceError
from reward_models.sources import VerifierSourceConfig as RewardSourceConfig
from vlrft.cli import KNOWN_FAILURES, known_failure, main
from vlrft.config import ConfigError, load_config
from vlrft.errors import KnownError, Preempted
from vlrft.tracking import Tracker
from vlrft.trainer.config import PolicyTrainConfig

REPO = Path(__file__).resolve().parents[1]


class CheckpointError(KnownError):
    """A KnownError subclass as the run-time work defines them (checkpoints, run folders, ...)."""


def test_the_table_of_known_failures_and_their_kinds():
    assert set(KNOWN_FAILURES) == {ConfigError, DataError, Preempted, KnownError}
    assert known_failure(Preempted("x")) == "preempted" and Preempted("x").exit_code == 75
    assert known_failure(ConfigError("x")) == "config error"
    assert known_failure(DataError("x")) == "data error"
    assert known_failure(RewardSourceError("x")) == "reward source error"
    assert known_failure(CheckpointError("x")) == "checkpoint error"
    assert known_failure(KnownError("x")) == "error"
    assert known_failure(ValueError("x")) is None and known_failure(KeyError("x")) is None


def test_a_config_error_is_one_line_on_stderr_and_exit_code_2(tmp_path, capsys):
    rc = main(["train-policy", "rollout.temperature=-1", f"train.output_dir={tmp_path}"])
    out = capsys.readouterr()
    assert (
        rc == 2 and out.err == "vlrft train-policy: config error: rollout.temperature=-1.0: must be > 0 for training\n"
    )
    assert out.out == ""


def test_a_data_error_is_one_located_line(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"id": "a", "prompt": "?", "answer": "red"}\n{"id": "b", "prompt": "?"}\n')
    args = ["train-policy", f"data.train_source={data}", "data.eval_source=", "rollout.rollout_batch_size=1"]
    assert main([*args, f"train.output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"vlrft train-policy: data error: {data}:2 field 'answer': record 'b' has no answer, "
        "which reward source 'accuracy' (verifier vocab_answer) needs\n"
    )
    assert not (tmp_path / "run").exists()  # refused before the model was built or the folder written


def test_debug_flag_or_environment_shows_the_traceback(tmp_path, capsys, monkeypatch):
    for argv in (["--debug", "train-policy", "train.max_steps=-3"], ["train-policy", "train.max_steps=-3", "--debug"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "Traceback (most recent call last)" in err and "ConfigError: train.max_steps=-3: must be >= 0" in err
        assert err.endswith("vlrft train-policy: config error: train.max_steps=-3: must be >= 0\n")
    monkeypatch.setenv("VLRFT_DEBUG", "1")
    assert main(["train-policy", "train.max_steps=-3"]) == 2
    assert "Traceback" in capsys.readouterr().err
    monkeypatch.setenv("VLRFT_DEBUG", "0")
    assert main(["train-policy", "train.max_steps=-3"]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_an_unexpected_exception_keeps_its_traceback(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(OSError):  # not a known failure: re-raised, so Python prints the traceback
        main(["make-tiny-model", str(blocker / "model"), "--arch", "qwen2"])


def test_a_failing_reward_source_is_a_known_failure_naming_the_source():
    pool = RewardPool(RewardPoolConfig(sources=[RewardSourceConfig(name="gsm", verifier="gsm8k")]))
    try:
        with pytest.raises(
            RewardSourceError, match=r"reward source 'gsm' \(verifier\) failed on record 'r': ValueError"
        ) as err:
            pool.score([PromptRecord(id="r", prompt="?", answer="not a number")], ["#### 3"])
    finally:
        pool.close()
    assert isinstance(err.value, KnownError) and known_failure(err.value) == "reward source error"


@pytest.mark.slow  # a fresh interpreter imports torch and transformers: ~10 s of CPU on a 2-core machine
def test_the_real_entry_point_prints_no_traceback(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "VLRFT_DEBUG": ""}
    res = subprocess.run(
        [sys.executable, "-m", "vlrft", "train-policy", "model.path=./no-model", f"train.output_dir={tmp_path}"],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
    )
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert (
        res.stderr.strip().splitlines()[-1] == "vlrft train-policy: config error: model.path=./no-model: no such folder"
    )


# -- logs in files -------------------------------------------------------------------------------------
def _tracked_run(tmp_path: Path, log_every_s: float, steps: int = 6) -> str:
    cfg = load_config(
        PolicyTrainConfig,
        None,
        ["logging.tensorboard=false", "logging.wandb=disabled", f"logging.log_every_s={log_every_s}"],
    )
    log = tmp_path / f"stderr-{log_every_s}.log"
    with open(log, "w") as stream:  # stderr redirected to a file, as under a scheduler
        saved, sys.stderr = sys.stderr, stream
        try:
            tracker = Tracker(tmp_path / "run", cfg, True, 0, steps, desc="train-policy", console_keys=("reward/",))
            for step in range(1, steps + 1):
                tracker.log({"reward/combined": step / 10, "other": 1.0}, step)
                tracker.advance(step / 10, "reward")
            tracker.close()
        finally:
            sys.stderr = saved
    return log.read_text()


def test_stderr_to_a_file_gets_plain_lines_at_first_and_last_step_not_bar_frames(tmp_path):
    text = _tracked_run(tmp_path, log_every_s=30)
    lines = text.splitlines()
    assert "\r" not in text and len(lines) == 2
    assert lines[0].startswith(
        "train-policy step 1/6 (17%), elapsed 0:00:00, ETA 0:00:00: reward=0.1, reward/combined=0.1"
    )
    assert lines[1].startswith("train-policy step 6/6 (100%)") and "reward/combined=0.6" in lines[1]
    assert "other=" not in text  # the main metrics only; everything is in metrics.jsonl
    every = _tracked_run(tmp_path, log_every_s=0).splitlines()
    assert [line.split(" (")[0] for line in every] == [f"train-policy step {i}/6" for i in range(1, 7)]
    assert max(len(line) for line in every) < 200


@pytest.mark.slow
def test_train_policy_with_stderr_to_a_file_writes_a_few_short_lines_per_run(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    args = [
        "train.max_steps=4",
        "rollout.rollout_batch_size=2",
        "rollout.n_samples_per_prompt=2",
        "rollout.max_new_tokens=4",
        "data.synthetic_train_size=8",
        "data.eval_source=",
        "logging.tensorboard=false",
        "logging.wandb=disabled",
        f"train.output_dir={tmp_path / 'run'}",
    ]
    with open(tmp_path / "stderr.log", "w") as err:
        res = subprocess.run(
            [sys.executable, "-m", "vlrft", "train-policy", *args], stdout=subprocess.PIPE, stderr=err, env=env
        )
    assert res.returncode == 0
    text = (tmp_path / "stderr.log").read_text()
    steps = [line for line in text.splitlines() if line.startswith("train-policy step ")]
    print(f"stderr: {len(text)} characters, {len(text.splitlines())} lines for 4 steps")
    assert "\r" not in text and [s.split(" (")[0] for s in steps] == ["train-policy step 1/4", "train-policy step 4/4"]
    assert len(text) / 4 < 300  # characters per step (a bar wrote thousands)
