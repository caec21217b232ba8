"""The learning proof of multi-turn rollouts with tools (issue 26, docs/tools.md): "thinking with images" on
synthetic:mark_color, whose small mark's colour cannot be read at the resolution the image is shown at, only in a
zoomed view of its (lighter) quadrant. A tiny random Qwen3-VL (hidden 128, Qwen's tool tokens) is taught the
format by train-sft on tool demonstrations (configs/sft/zoom_tools.yaml), then trained by GRPO with the zoom tool
(configs/policy/zoom_tools.yaml), through the hf engine:

- held-out accuracy with tools >= 0.9 at the last two evaluations of RL;
- the same models with the tools' answers withheld (each zoom answered by a blank image of its size) stay within 0.1
  of chance (0.25): the answer comes from what the tool showed;
- RL improves on its SFT starting point;
- the share of trajectories that zoom into the right region (a reward function of weight 0 that reads the
  trajectory, examples/tools/my_tools.py:right_region) rises with the accuracy.

Slow (SFT about 4 minutes, RL about 5 on a 2-core CPU).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vlrft.cli import main

REPO = Path(__file__).resolve().parents[1]
QUIET = ["logging.wandb=disabled", "logging.progress_bar=false", "logging.tensorboard=false"]
REGION = f"{{name: right_region, kind: function, function: '{REPO}/examples/tools/my_tools.py:right_region'"
REGION += ", weight: 0.0, isolation: inline}"

pytestmark = pytest.mark.slow


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_sft_then_grpo_learns_to_zoom_and_read_the_mark(tmp_path):
    sft = tmp_path / "sft"
    assert (
        main(["train-sft", str(REPO / "configs" / "sft" / "zoom_tools.yaml"), f"train.output_dir={sft}", *QUIET]) == 0
    )
    sft_acc = json.loads((sft / "summary.json").read_text())["eval_after"]["accuracy"]
    rl = tmp_path / "rl"
    args = [
        "train-policy",
        str(REPO / "configs" / "policy" / "zoom_tools.yaml"),
        f"model.path={sft / 'final'}",
        "reward.sources=[{name: accuracy, kind: verifier, verifier: vocab_answer}, " + REGION + "]",
        f"train.output_dir={rl}",
        *QUIET,
    ]
    assert main(args) == 0
    rows = _rows(rl)
    evals = {r["step"]: r for r in rows if "eval/accuracy" in r}
    steps = sorted(evals)
    with_tools = [evals[s]["eval/accuracy"] for s in steps]
    without = [evals[s]["eval/withheld/accuracy"] for s in steps]
    assert abs(evals[0]["eval/accuracy"] - sft_acc) < 1e-9  # RL starts where SFT ended
    assert min(with_tools[-2:]) >= 0.9, with_tools
    assert with_tools[-1] > sft_acc, (sft_acc, with_tools)
    assert all(abs(a - 0.25) <= 0.1 for a in without), without  # chance without the tool's answer
    train = [r for r in rows if "reward/right_region" in r]
    early = sum(r["reward/right_region"] for r in train[:10]) / 10
    late = sum(r["reward/right_region"] for r in train[-10:]) / 10
    assert late > early and late >= 0.8, (early, late)
    assert all(r["tools/calls/zoom"] >= 0.9 for r in train[-10:])
