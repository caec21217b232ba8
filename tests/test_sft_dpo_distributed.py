"""SFT and DPO under torchrun (2 gloo ranks, FSDP2 and DeepSpeed ZeRO-2) make the same update as one process
on the same global batch (the SIGKILL resume of every trainer is tests/test_run_lifecycle.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from launch import QUIET, run_job, subprocess_env
from safetensors.torch import load_file
from tolerance import assert_within

REPO = Path(__file__).resolve().parents[1]


def _cmd(command: str, args: list[str], nproc: int, port_offset: int = 0) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", "vlrft", command, *args]
    port = 29900 + (os.getpid() + port_offset) % 90
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port"]
    return [*launcher, str(port), "-m", "vlrft", command, *args]


def _run(command: str, args: list[str], nproc: int, port_offset: int = 0) -> str:
    res = run_job(_cmd(command, args, nproc, port_offset), env=subprocess_env(), timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-6000:]
    return res.stdout + res.stderr


def _args(model: Path, out: Path, batch_size: int, strategy: str = "single", steps: int = 1) -> list[str]:
    return [
        f"model.path={model}",
        f"train.output_dir={out}",
        f"train.max_steps={steps}",
        f"train.batch_size={batch_size}",
        "train.micro_batch_size=1",  # gradient accumulation over micro-batches of unequal lengths, too
        "data.synthetic_train_size=16",
        "data.eval_source=''",
        "optim.lr=1e-3",
        # Adam turns rounding-level gradient differences (reduction order) into lr-sized steps when eps is
        # tiny; eps 1e-4 keeps the comparison about the strategies (as the reward-model test does)
        "optim.eps=1e-4",
        "strategy.grad_clip=0",
        f"strategy.name={strategy}",
        "strategy.zero_stage=2",
        *QUIET,
    ]


def _max_diff(a: Path, b: Path) -> float:
    x, y = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert set(x) == set(y)
    return max((x[k].float() - y[k].float()).abs().max().item() for k in x)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("command", ["train-sft", "train-dpo"])
@pytest.mark.parametrize("strategy", ["fsdp2", "deepspeed"])
def test_two_ranks_make_the_update_of_one_process(tiny_model, tmp_path, command, strategy):
    model = tiny_model("qwen2_5_vl")
    single, dist = tmp_path / "single", tmp_path / strategy
    _run(command, _args(model, single, 4), 1)
    _run(command, _args(model, dist, 2, strategy), 2)
    initial = tmp_path / "initial"
    initial.mkdir()
    os.symlink(model / "model.safetensors", initial / "model.safetensors")
    moved = _max_diff(single / "final", initial)
    diff = _max_diff(dist / "final", single / "final")
    print(f"{command} {strategy}: update {moved:.2e}, max |2 ranks - 1 process| = {diff:.2e}")
    assert moved > 5e-4  # a real update (Adam at lr 1e-3) ...
    # ... the same on 2 ranks as on one process. The bound: with eps = 1e-4 one AdamW step's slope in the gradient
    # is at most lr / eps = 10; two reduction orders give float32 gradients that differ by <= ~1e-6 (~100 ulps of
    # elements up to ~0.1), so the parameters agree within 10 * 1e-6 = 1e-5.
    assert_within(diff, 1e-5, f"{command} {strategy}: max |2 ranks - 1 process| after one AdamW step")
