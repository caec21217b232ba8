"""Exact resume: a train-policy run killed with SIGKILL at a random point and started again ends with
parameters bitwise equal to an uninterrupted run, and sees every prompt once, in the same order."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from launch import run_job, subprocess_env

REPO = Path(__file__).resolve().parents[1]


def _cmd(model_dir: Path, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "vlrft",
        "train-policy",
        f"model.path={model_dir}",
        f"train.output_dir={out}",
        "data.eval_source=''",
        "data.synthetic_train_size=20",
        "rollout.rollout_batch_size=4",
        "rollout.n_samples_per_prompt=4",
        "rollout.max_new_tokens=4",
        "train.max_steps=12",
        "train.save_every=1",
        "train.keep_last=2",
        "train.micro_train_batch_size=8",
        "train.train_batch_size=8",
        "train.max_epochs=2",
        "optim.lr=1e-3",
        "logging.tensorboard=false",
        "logging.wandb=disabled",
        "logging.progress_bar=false",
    ]


def _order(out: Path) -> list[list[str]]:
    rows = [json.loads(x) for x in (out / "data_order.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    return [r["prompt_ids"] for r in rows]


def test_sigkill_then_resume_is_bitwise_identical(tiny_model, tmp_path):
    model_dir = tiny_model("qwen2_5_vl")
    full = tmp_path / "uninterrupted"
    res = run_job(_cmd(model_dir, full), env=subprocess_env(), timeout=840)
    assert res.returncode == 0, res.stderr[-4000:]

    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        _cmd(model_dir, killed), env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    ckpts = killed / "checkpoints"
    deadline = time.time() + 600
    target = random.Random(os.getpid()).randint(1, 3)  # kill somewhere after checkpoint `target` exists
    while time.time() < deadline and not (ckpts / f"step-{target:06d}" / "COMPLETE").exists():
        time.sleep(0.01)
    time.sleep(random.Random(target).uniform(0, 0.3))  # at least 9 more steps to go: well inside the run
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (killed / "final").exists(), "the run finished before it was killed"
    res = run_job(_cmd(model_dir, killed), env=subprocess_env(), timeout=840)
    assert res.returncode == 0, res.stderr[-4000:]
    assert "resumed from" in res.stderr + res.stdout

    a = (full / "final" / "model.safetensors").read_bytes()
    b = (killed / "final" / "model.safetensors").read_bytes()
    assert a == b
    order_a, order_b = _order(full), _order(killed)
    assert order_a == order_b
    seen = [pid for step in order_b for pid in step]
    # episodes of 20 prompts: within each, none twice or skipped
    assert len(seen) == 12 * 4 and len(set(seen[:20])) == 20 and len(set(seen[20:40])) == 20
    kept = sorted(p.name for p in (killed / "checkpoints").iterdir())
    assert kept == ["step-000011", "step-000012"]  # keep_last=2, no half-written .tmp left behind
