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
    if "a3b" in script.name:  # the mixture-of-experts recipes: routing replay on the hf engine, on two nodes
        assert cfg.rollout.routing_replay and cfg.rollout.engine == "hf" and "--nnodes" in head
    assert len(SCRIPTS) >= 5


@pytest.mark.parametrize("script", [s for s in SCRIPTS if "qwen3" in s.name], ids=lambda p: p.name)
def test_new_architecture_recipes_print_their_config(script, capsys):
    """Issue 60, item 7: the Qwen3.5 (dense, MoE) and Qwen3-VL-MoE launch scripts at real shapes, validated by
    ``vlrft train-policy --print-config`` as a user would (nothing loads; the hub ids are not fetched)."""
    from vlrft.cli import main

    text = script.read_text()
    tail = text.split("train-policy ", 1)[1].replace("\\\n", " ").replace('"$@"', "")
    args = [str(REPO / a) if a.endswith(".yaml") else a.replace("$DATA", "data") for a in shlex.split(tail)]
    assert main(["train-policy", *args, "--print-config"]) == 0
    printed = capsys.readouterr().out
    model = next(a.split("=", 1)[1] for a in args if a.startswith("model.path="))
    assert f"path: {model}" in printed and model.startswith(("Qwen/Qwen3.5-", "Qwen/Qwen3-VL-"))
