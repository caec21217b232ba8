"""The two short runs the multi-turn tools tests share: the tool demonstrations' train-sft that teaches a tiny model
the zoom call's format, and two train-policy steps of multi-turn trajectories on it (configs/sft/zoom_tools.yaml,
configs/policy/zoom_tools.yaml; docs/tools.md)."""

from __future__ import annotations

import json
from pathlib import Path

from launch import QUIET

from vlrft.cli import main

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def tool_sft(out: Path, *overrides: str) -> Path:
    """60 steps of train-sft on the tool demonstrations at 3e-3, enough for the call's format (which region it zooms
    into and the colour it names are still guesses; the config's 1e-3 after 50 warm-up steps is for its 400 steps).
    Returns the exported model folder."""
    args = ["train-sft", str(CONFIGS / "sft" / "zoom_tools.yaml"), f"train.output_dir={out}", "train.max_steps=60"]
    args += ["optim.lr=3e-3", "optim.warmup_steps=0", "train.eval_every=0", "data.synthetic_train_size=256"]
    assert main([*args, "data.eval_source=", *overrides, *QUIET]) == 0
    return out / "final"


def two_tool_steps(model: Path, out: Path, *overrides: str) -> list[dict]:
    """Two train-policy steps of 2 prompts x 4 trajectories with the zoom tool on ``model``; returns the steps'
    metrics rows. Sampled at temperature 1, the tool SFT's policy zooms in most trajectories."""
    args = ["train-policy", str(CONFIGS / "policy" / "zoom_tools.yaml"), f"model.path={model}", "train.max_steps=2"]
    args += ["rollout.rollout_batch_size=2", "rollout.n_samples_per_prompt=4", "data.synthetic_train_size=8"]
    assert main([*args, "data.synthetic_eval_size=4", f"train.output_dir={out}", *overrides, *QUIET]) == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
