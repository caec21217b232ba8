"""The learning proof of multi-turn rollouts with tools (issue 26, docs/tools.md): "thinking with images" on
synthetic:mark_color, whose small mark's colour cannot be read at the resolution the image is shown at, only in a
zoomed view of its (lighter) quadrant. A tiny random Qwen3-VL (hidden 128, Qwen's tool tokens), through the hf
engine:

1. ``train-sft configs/sft/zoom_tools.yaml``: demonstrations that all zoom into the right quadrant, then name the
   colour (400 steps): the call's format, where to look and how to read the zoomed mark. Held-out 1.0.
2. ``train-sft configs/sft/zoom_tools_rarely.yaml``: 50 steps on records of which only 15 % of the demonstrations
   zoom (the others answer at once, a guess): a policy that can use the tool but rarely chooses to. Greedy, it
   answers at once: held-out 0.25 (chance), the starting point of RL.
3. ``train-policy configs/policy/zoom_tools.yaml`` (GRPO with the zoom tool, 60 steps, strict reward of the final
   answer, -0.5 for each malformed call): the sampled call rate and right-region rate rise from about 0.2 to 1.0 and
   the held-out accuracy with tools from 0.25 to >= 0.9 (measured 1.0 from step 15 on hf); the same models with the
   tools' answers withheld (each zoom answered by a blank image of its size) are never more than 0.1 above chance:
   the answer comes from what the tool showed.

``lessons`` is shared with the vLLM suite's proof (tests/test_vllm_tools.py), which runs stage 3 on the vllm engine.
Slow: about 3.5 minutes, 20 s and 3 minutes on a 2-core Intel Xeon when it is quiet.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launch import QUIET

from vlrft.cli import main

REPO = Path(__file__).resolve().parents[1]
REGION = f"{{name: right_region, kind: function, function: '{REPO}/examples/tools/my_tools.py:right_region'"
REGION += ", weight: 0.0, isolation: inline}"
SOURCES = "reward.sources=[{name: accuracy, kind: verifier, verifier: vocab_answer}, " + REGION + "]"

# three stages in one test: about 11 minutes beside the slow suite on a 2-core Intel Xeon before stage 1 was cut to
# 400 steps, about 7.5 now; more on a slower machine (pyproject's 900 s is the limit of one test elsewhere)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2700)]


def _summary(run: Path) -> dict:
    return json.loads((run / "summary.json").read_text())


def lessons(
    tmp_path: Path, *rl_overrides: str, base: Path | None = None, same_engine: bool = True, sft: tuple[str, ...] = ()
) -> dict:
    """The three stages from ``base`` (a model folder; the config's tiny Qwen3-VL when None; ``same_engine``: RL
    evaluates with the hf engine, as the SFT stages do; ``sft``: overrides of stage 1). Returns the two SFT held-out
    accuracies and RL's metrics rows."""
    first, rarely, rl = tmp_path / "sft", tmp_path / "sft-rarely", tmp_path / "rl"
    cmd = ["train-sft", str(REPO / "configs" / "sft" / "zoom_tools.yaml"), f"train.output_dir={first}", *sft]
    assert main([*cmd, *([f"model.path={base}"] if base else []), *QUIET]) == 0
    cmd = ["train-sft", str(REPO / "configs" / "sft" / "zoom_tools_rarely.yaml"), f"model.path={first / 'final'}"]
    assert main([*cmd, f"train.output_dir={rarely}", *QUIET]) == 0
    cmd = ["train-policy", str(REPO / "configs" / "policy" / "zoom_tools.yaml"), f"model.path={rarely / 'final'}"]
    assert main([*cmd, SOURCES, f"train.output_dir={rl}", *rl_overrides, *QUIET]) == 0
    rows = [json.loads(line) for line in (rl / "metrics.jsonl").read_text().splitlines()]
    sft, sft_rarely = _summary(first)["eval_after"]["accuracy"], _summary(rarely)["eval_after"]["accuracy"]
    # RL starts where SFT ended: the same model greedy on the same 64 held-out prompts, within one prompt (the SFT's
    # evaluation decodes in batches of 16, train-policy's in its rollout batches: other padding, other float
    # rounding, and a near-tie of the greedy choice may flip; measured on AVX2 0.234375 against 0.25, equal on AVX-512).
    # With the vllm engine RL's evaluation is vLLM's greedy decoding against the SFT's hf one: stage 2 leaves the
    # choice between zooming and answering at once near a tie by design, and vLLM's kernels round otherwise (6 of 64
    # prompts differed on AVX2: 0.25 against 0.15625); there the start is held to stage 2's own bar
    # (check_rl_learns_when_and_where_to_zoom) and the engines' agreement to the log-prob gaps.
    if same_engine:
        assert abs(rows[0]["eval/accuracy"] - sft_rarely) <= 1 / 64 + 1e-9, (rows[0]["eval/accuracy"], sft_rarely)
    return {"sft": sft, "sft_rarely": sft_rarely, "rows": rows}


def _mean(rows: list[dict], key: str) -> float:
    return sum(r[key] for r in rows) / len(rows)


LATE = 30  # from this step on the policy is to have learned (the evaluations every 15 steps: 30, 45, 60)


def check_rl_learns_when_and_where_to_zoom(result: dict) -> dict:
    """The proof's assertions, on either engine; returns the figures it printed."""
    rows = result["rows"]
    evals = [r for r in rows if "eval/accuracy" in r]
    with_tools = {r["step"]: r["eval/accuracy"] for r in evals}
    withheld = {r["step"]: r["eval/withheld/accuracy"] for r in evals}
    train = [r for r in rows if "tools/call_rate" in r]
    figures = {
        "sft": result["sft"],
        "sft_rarely": result["sft_rarely"],
        "with_tools": with_tools,
        "withheld": withheld,
        **{k: (_mean(train[:5], k), _mean(train[-10:], k)) for k in ("tools/call_rate", "reward/right_region")},
    }
    print(f"tools learning proof: {figures}")
    assert result["sft"] >= 0.9, figures  # stage 1 taught the call and the reading (measured 1.0)
    assert result["sft_rarely"] <= 0.4, figures  # greedy answers at once: chance 0.25 (measured 0.25)
    assert with_tools[0] <= 0.4, figures  # and RL starts there: chance (measured 0.25 on hf and on vllm)
    late = [a for step, a in with_tools.items() if step >= LATE]  # not the last evaluation alone
    assert len(late) >= 3 and min(late) >= 0.9, figures  # measured 1.0 at 15-60 (seeds 0-2)
    # the answer is the tool's: never above chance without it. One-sided: shown a blank zoom, a policy may answer
    # nothing at all (format 0, accuracy 0.0: measured on vllm at step 25, with AMD seed 2 at step 50, on an Intel
    # Xeon at steps 75-100), which is no reading of the image either (docs/tools.md)
    assert all(a <= 0.25 + 0.1 for a in withheld.values()), figures
    assert figures["tools/call_rate"][0] <= 0.5 and figures["tools/call_rate"][1] >= 0.9, figures
    assert figures["reward/right_region"][1] >= 0.9, figures
    return figures


def test_grpo_learns_when_and_where_to_zoom_from_a_policy_that_rarely_does(tmp_path):
    check_rl_learns_when_and_where_to_zoom(lessons(tmp_path))
