"""``strategy.mixed_precision``: bf16 compute with fp32 master weights (FSDP2's MixedPrecisionPolicy and DeepSpeed's
bf16 on 2 gloo ranks, autocast in one process) trains; ``auto`` leaves a CPU run in float32."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from launch import run_job, subprocess_env, torchrun

from vlrft.strategies import StrategyConfig

SCRIPT = Path(__file__).parent / "dist" / "mixed_precision.py"
BLOCKS = ("Qwen2_5_VLDecoderLayer", "Qwen2_5_VLVisionBlock")


def _run(tiny_model, tmp_path, strategy: str, mixed: str) -> list[dict]:
    out = tmp_path / "mp"
    args = [str(SCRIPT), str(tiny_model("qwen2_5_vl")), str(out), strategy, mixed]
    cmd = [sys.executable, *args] if strategy == "single" else torchrun(*args, nproc=2)
    res = run_job(cmd, env=subprocess_env(), timeout=840)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    reports = [json.loads(f.read_text()) for f in sorted(tmp_path.glob("mp.*"))]
    assert len(reports) == (1 if strategy == "single" else 2)
    return reports


def test_auto_is_bf16_on_cuda_only():
    assert StrategyConfig().mixed_precision == "auto"
    assert StrategyConfig().bf16 == torch.cuda.is_available()
    assert StrategyConfig(mixed_precision="bf16").bf16 and not StrategyConfig(mixed_precision="no").bf16


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["single", "fsdp2", "deepspeed"])
def test_bf16_computes_in_bf16_and_keeps_fp32_master_weights(tiny_model, tmp_path, strategy):
    for r in _run(tiny_model, tmp_path, strategy, "bf16"):
        print(strategy, r)
        assert r["bf16"]
        losses = r["losses"]
        assert all(x == x and abs(x) < 1e3 for x in losses) and losses[-1] < losses[0], losses
        assert r["compute_dtypes"] == {k: "torch.bfloat16" for k in BLOCKS}
        assert r["master_dtypes"] == ["torch.float32"]
        assert r["moved"] > 1e-3  # three AdamW steps at lr 1e-3 moved the weights


@pytest.mark.skipif(torch.cuda.is_available(), reason="auto is bf16 on CUDA")
def test_auto_on_cpu_trains_in_float32_as_before(tiny_model, tmp_path):
    for r in _run(tiny_model, tmp_path, "single", "auto"):
        assert not r["bf16"]
        assert r["compute_dtypes"] == {k: "torch.float32" for k in BLOCKS}
        assert r["master_dtypes"] == ["torch.float32"]
