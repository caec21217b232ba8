"""The launch scripts for real scales pass the config schema (every override names a real key with a
valid value), so a typo fails here instead of on a GPU cluster."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from vlrft.config import load_config
from vlrft.trainer.config import PolicyTrainConfig

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((REPO / "scripts").glob("grpo_*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_launch_script_config_resolves(script):
    text = script.read_text()
    head, tail = text.split("train-policy ", 1)
    config, tail = tail.split(maxsplit=1)
    tail = tail.replace("\\\n", " ").replace('"$@"', "")
    overrides = [a.replace("$DATA", "data") for a in shlex.split(tail) if "=" in a]
    cfg = load_config(PolicyTrainConfig, REPO / config, overrides)
    assert cfg.model.path.startswith("Qwen/") and cfg.strategy.name in ("fsdp2", "deepspeed")
    assert cfg.strategy.mixed_precision == "bf16"
    if "vllm" in script.name:  # the vLLM recipe: engine, its venv, a rollout correction
        assert cfg.rollout.engine == "vllm" and cfg.algorithm.rollout_correction == "token_tis"
        assert ".venv-vllm/bin/torchrun" in head + config
    assert len(SCRIPTS) >= 2
