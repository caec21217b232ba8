"""Hostile stops during checkpoint writes (issue 11): SIGKILL or Ctrl-C (SIGINT) while a checkpoint is being
written, then the same command again, ends bitwise equal to an uninterrupted run; Ctrl-C releases the run
folder's lock, a SIGKILLed run's lock is taken over."""

from __future__ import annotations

import json
import signal
import subprocess
import time

import pytest
from launch import run_job, subprocess_env
from test_policy_resume import _cmd


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_stopped_during_a_checkpoint_write_resumes_bitwise(tiny_model, tmp_path, sig):
    model_dir = tiny_model("qwen2_5_vl")
    full = tmp_path / "uninterrupted"
    res = run_job(_cmd(model_dir, full), env=subprocess_env(), timeout=840)
    assert res.returncode == 0, res.stderr[-4000:]

    run = tmp_path / "stopped"
    # SIGINT at its default: a job started in the background (nohup, `&` without job control) inherits it ignored,
    # and Python then installs no KeyboardInterrupt handler, so the Ctrl-C below would be ignored
    proc = subprocess.Popen(
        _cmd(model_dir, run),
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    tmp = run / "checkpoints" / "step-000003.tmp"
    deadline = time.time() + 600

    def reached() -> bool:  # the .tmp folder lives for milliseconds: a loaded machine may not look in time
        return tmp.exists() or any((run / "checkpoints" / f"step-00000{k}" / "COMPLETE").exists() for k in (3, 4))

    while not reached() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.001)
    assert proc.poll() is None, "the run ended before it could be stopped"
    proc.send_signal(sig)  # while step 3's checkpoint is written (or just after)
    _, err = proc.communicate(timeout=120)
    assert not (run / "final").exists()
    lock = run / "LOCK"
    if sig == signal.SIGINT:
        assert proc.returncode != 0 and not lock.exists(), err[-2000:]
    else:
        assert json.loads(lock.read_text())["pid"] == proc.pid  # left behind, taken over below
    res = run_job(_cmd(model_dir, run), env=subprocess_env(), timeout=840)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "resumed from" in res.stdout + res.stderr
    assert (full / "final" / "model.safetensors").read_bytes() == (run / "final" / "model.safetensors").read_bytes()
    steps = [json.loads(x)["step"] for x in (run / "data_order.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 13))
    assert not lock.exists()
