"""Multi-turn rollouts with tools through the vllm engine (issue 26 items 3-4): a tiny Qwen2.5-VL with Qwen's tool
tokens (head_dim 64, which vLLM takes), taught by train-sft to zoom twice before it answers (images come back in
turns 2 and 3), runs trajectories on a colocated vLLM engine. Each trajectory is the chat template's rendering of
its conversation, and the sampled tokens' log-probs vLLM reports per turn equal the trainer's log-probs of the
whole trajectory (``response_logprobs``, observations masked) within 1e-4, the tolerance of the single-turn vLLM
tests. Needs vLLM (``bash scripts/test.sh --vllm``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "vllm", reason="vLLM is not installed here: bash scripts/setup.sh --vllm; bash scripts/test.sh --vllm"
)

from tolerance import assert_within  # noqa: E402

from data_pipelines.chat import ChatRecord, encode_chat  # noqa: E402
from data_pipelines.collate import collate_sequences, encode_prompt, processor_image_kwargs  # noqa: E402
from data_pipelines.synthetic import make_prompt_records  # noqa: E402
from tests.test_tools_learning import check_rl_learns_when_and_where_to_zoom, lessons  # noqa: E402
from vlrft.cli import main  # noqa: E402
from vlrft.models.loading import load_model  # noqa: E402
from vlrft.rollout import SamplingParams, VLLMRolloutEngine  # noqa: E402
from vlrft.rollout.base import vision_token_ids  # noqa: E402
from vlrft.rollout.trajectories import TrajectoryRunner  # noqa: E402
from vlrft.tools import ToolBox, ToolsConfig  # noqa: E402
from vlrft.trainer.experience import response_logprobs  # noqa: E402

pytestmark = pytest.mark.vllm
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def twice_zooming_policy(tiny_model, tmp_path_factory) -> Path:
    base = tiny_model("qwen2_5_vl", hidden=128, heads=2, kv_heads=2, tool_tokens=True)
    out = tmp_path_factory.mktemp("vllm-tools") / "sft"
    args = [
        "train-sft",
        str(REPO / "configs" / "sft" / "zoom_tools.yaml"),
        f"model.path={base}",
        "data.synthetic_options={image_size: 224, demo_zooms: 2}",
        "data.synthetic_train_size=256",
        "data.eval_source=",
        "train.max_steps=80",
        "optim.lr=3e-3",  # the config's former rate without warm-up (as tests/conftest.py's tool_policy): 80 steps
        "optim.warmup_steps=0",  # at its 1e-3 after warm-up leave calls the template does not render back alike
        "train.eval_every=0",
        f"train.output_dir={out}",
        "logging.wandb=disabled",
        "logging.progress_bar=false",
        "logging.tensorboard=false",
    ]
    assert main(args) == 0
    return out / "final"


def test_vllm_trajectories_match_the_template_and_the_trainers_logprobs(twice_zooming_policy):
    path = str(twice_zooming_policy)
    model, processor = load_model(path, "float32")
    model.eval()
    cfg = ToolsConfig(names=["zoom"], max_turns=4, max_tokens=256)
    box = ToolBox(cfg, processor_image_kwargs(processor))
    engine = VLLMRolloutEngine(path, processor)
    try:
        runner = TrajectoryRunner(engine, processor, box, cfg)
        records = make_prompt_records("mark_color", 4, seed=5)
        prompts = [encode_prompt(processor, r, tools=box.schemas) for r in records]
        torch.manual_seed(0)
        rollouts = runner.run(records, prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=32))
    finally:
        box.close()
        del engine
    suppress = torch.tensor(vision_token_ids(processor.tokenizer))
    turns_seen, worst = set(), 0.0
    for x in rollouts:
        t, prompt = x.trajectory, prompts[x.prompt_index]
        turns_seen.add((len(t.turns), t.num_images))
        if x.finish_reason in ("stop", "max_turns"):  # each turn ended by the policy: the template's rendering
            whole = encode_chat(processor, ChatRecord("c", prompt.messages + t.messages), tools=box.schemas)
            assert torch.equal(torch.cat([prompt.input_ids, x.response_ids]), whole.input_ids[:-1])
            assert torch.equal(t.action_mask, (whole.labels[prompt.input_ids.numel() : -1] != -100).long())
        assert x.logprobs is not None and x.logprobs.numel() == x.response_ids.numel()
        batch = collate_sequences([prompt], [0], [t.response], processor.tokenizer.pad_token_id)
        with torch.no_grad():
            ours = response_logprobs(model, batch, x.response_ids[None], suppress=suppress)[0][0]
        sampled = t.action_mask.bool()
        assert bool((x.logprobs[~sampled] == 0).all())  # observations: no engine log-prob
        worst = max(worst, float((ours[sampled] - x.logprobs[sampled]).abs().max()))
    # images returned in turns 2 and 3: trajectories of 3 turns with 2 returned images
    assert (3, 2) in turns_seen, turns_seen
    # float32 on both sides, vLLM's kernels against transformers' (the single-turn vLLM tests' bound)
    assert_within(worst, 1e-4, "vLLM trajectory log-probs vs the trainer's")


@pytest.mark.timeout(3600)
def test_grpo_on_the_vllm_engine_learns_when_and_where_to_zoom(tiny_model, tmp_path):
    """The tools learning proof (tests/test_tools_learning.py: SFT that zooms, SFT that rarely zooms, GRPO) with
    GRPO's trajectories sampled by the colocated vllm engine, weights sent to it after every update: a tiny
    Qwen3-VL of head_dim 64 (hidden 128, 2 heads; vLLM's CPU attention takes no less). Same bars as on hf."""
    base = tiny_model("qwen3_vl", hidden=128, heads=2, kv_heads=2, tool_tokens=True)
    # stage 1 as measured on this model: 800 steps (the config's until 2026-12-03, now 400 for the hf proof; at its
    # former lr 3e-3 this model needed 1200 and still stuck at seed 1: docs/tools.md)
    result = lessons(tmp_path, "rollout.engine=vllm", base=base, same_engine=False, sft=("train.max_steps=800",))
    check_rl_learns_when_and_where_to_zoom(result)
    gaps = [r["rollout/logprob_diff_max"] for r in result["rows"] if "rollout/logprob_diff_max" in r]
    print(f"vLLM's sampled log-probs against the trainer's, largest gap per step: max {max(gaps):.3g}")
    assert len(gaps) >= 55  # each of the 60 steps' trajectories came from vLLM, with their log-probs
    # float32 on both sides, vLLM's kernels against transformers', after every weight sync. The single-turn bound
    # (1e-4) is for random tiny policies, whose logits are O(1); float32 rounding is relative to the logits, and a
    # trained policy (entropy 0.005 here) has logits about ten times larger, hence 1e-3 (measured 3.0e-5 at most,
    # at step 31 of 100, when the policy was sharpening fastest)
    assert_within(max(gaps), 1e-3, "vLLM trajectory log-probs vs the trainer's during GRPO")
