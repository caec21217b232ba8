"""The vllm rollout engine against the hf engine and the trainer: same policy, same outputs.

Greedy generations equal the hf engine's token for token; the sampled tokens' log-probs reported by vLLM
equal the trainer's (``response_logprobs``, the function the policy loss uses) within 1e-4; on a tiny text
Qwen2 and a tiny Qwen2.5-VL with one and two images per prompt (head_dim 64: vLLM refuses 16). After a real
optimizer step the synced engine agrees again, and a skipped sync is detected by the same comparison.
Needs vLLM (``bash scripts/setup.sh --vllm``; run with ``bash scripts/test.sh --vllm``).
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image

pytest.importorskip(
    "vllm", reason="vLLM is not installed here: bash scripts/setup.sh --vllm; bash scripts/test.sh --vllm"
)

from data_pipelines.collate import collate_sequences, encode_prompt, tokenizer_of  # noqa: E402
from data_pipelines.records import PromptRecord  # noqa: E402
from data_pipelines.synthetic import make_prompt_records  # noqa: E402
from vlrft.models.loading import load_model  # noqa: E402
from vlrft.rollout import HFRolloutEngine, SamplingParams, VLLMRolloutEngine  # noqa: E402
from vlrft.rollout.base import stack_rollout_logprobs  # noqa: E402
from vlrft.rollout.vllm_engine import collapse_image_pads  # noqa: E402
from vlrft.strategies import OptimConfig, StrategyConfig, make_strategy  # noqa: E402
from vlrft.trainer.experience import response_logprobs, response_tensors  # noqa: E402

pytestmark = pytest.mark.vllm

SIZES = dict(hidden=128, heads=2, kv_heads=2)  # head_dim 64


def _prompts(processor, kind: str) -> list:
    if kind == "text":
        texts = ["Name a colour.", "Count to three.", "What is two plus two?", "Say hello."]
        records = [PromptRecord(id=str(i), prompt=t) for i, t in enumerate(texts)]
    elif kind == "one_image":
        records = make_prompt_records("color", 4, seed=3)
    else:
        colours = [(200, 20, 20), (20, 200, 20), (20, 20, 200), (200, 200, 20)]
        records = [
            PromptRecord(
                id=str(i),
                prompt="<image> <image> Which colours are these?",
                images=[Image.new("RGB", (56, 84), colours[i]), Image.new("RGB", (84, 56), colours[(i + 1) % 4])],
            )
            for i in range(4)
        ]
    return [encode_prompt(processor, r) for r in records]


def _trainer_logprobs(model, processor, prompts, rollouts, temperature: float, grad: bool = False):
    """The trainer's ``[N, R]`` log-probs of the rollouts (the policy loss's own function) and their mask."""
    pad = tokenizer_of(processor).pad_token_id
    responses = [x.response_ids for x in rollouts]
    batch = collate_sequences(prompts, [x.prompt_index for x in rollouts], responses, pad)
    ids, mask = response_tensors(responses, pad)
    with torch.set_grad_enabled(grad):
        logp, _ = response_logprobs(model, batch, ids, temperature=temperature)
    return logp, mask


def max_logprob_gap(engine, model, processor, prompts, temperature: float = 0.8) -> float:
    """Largest |vLLM - trainer| log-prob over the tokens vLLM sampled (n=2 per prompt)."""
    sampling = SamplingParams(n=2, temperature=temperature, max_new_tokens=12)
    rollouts = engine.generate(prompts, sampling)
    logp, mask = _trainer_logprobs(model, processor, prompts, rollouts, temperature)
    engine_logp = stack_rollout_logprobs(rollouts, mask.shape[1])
    assert engine_logp is not None and int(mask.sum()) > 0
    return float((logp - engine_logp).abs()[mask.bool()].max())


@pytest.fixture(scope="module", params=["qwen2", "qwen2_5_vl"])
def policy(request, tiny_model):
    path = tiny_model(request.param, **SIZES)
    model, processor = load_model(str(path), "float32")
    model.eval()
    engine = VLLMRolloutEngine(str(path), processor)
    yield request.param, path, model, processor, engine
    del engine


def _kinds(arch: str) -> list[str]:
    return ["text"] if arch == "qwen2" else ["one_image", "two_images"]


def test_collapse_image_pads():
    assert collapse_image_pads([1, 9, 9, 9, 2, 9, 9, 3], 9) == [1, 9, 2, 9, 3]
    assert collapse_image_pads([1, 2], 9) == [1, 2]


def test_greedy_equals_hf_token_for_token(policy):
    arch, _, model, processor, engine = policy
    hf = HFRolloutEngine(model, processor)
    for kind in _kinds(arch):
        prompts = _prompts(processor, kind)
        greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=16)
        ours = [x.response_ids.tolist() for x in engine.generate(prompts, greedy)]
        ref = [x.response_ids.tolist() for x in hf.generate(prompts, greedy)]
        assert ours == ref, (kind, ours, ref)
        assert sum(len(x) for x in ours) >= 4 * 8


def test_sampled_logprobs_equal_the_trainers(policy):
    arch, _, model, processor, engine = policy
    for kind in _kinds(arch):
        gap = max_logprob_gap(engine, model, processor, _prompts(processor, kind))
        print(f"{arch} {kind}: max |vllm - trainer| log-prob {gap:.2e}")
        assert gap < 1e-4, (kind, gap)


def test_sync_after_optimizer_step_and_skipped_sync_detected(policy):
    """A real AdamW step moves the policy; before the sync the engine is detectably stale, after it agrees."""
    arch, path, _, _, _ = policy
    model, processor = load_model(str(path), "float32")
    strategy = make_strategy(StrategyConfig(name="single", grad_clip=0), OptimConfig(lr=5e-3))
    strategy.prepare(model, total_steps=2)
    engine = VLLMRolloutEngine(str(path), processor)
    prompts = _prompts(processor, _kinds(arch)[-1])
    rollouts = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=8))
    for _ in range(2):  # raise the likelihood of the samples: the policy moves
        logp, mask = _trainer_logprobs(strategy.train_module, processor, prompts, rollouts, 1.0, grad=True)
        strategy.backward(-(logp * mask).sum() / mask.sum())
        strategy.step()
    model.eval()
    skipped = max_logprob_gap(engine, model, processor, prompts, temperature=1.0)
    engine.update_weights(strategy.full_params(trainable_only=True))
    synced = max_logprob_gap(engine, model, processor, prompts, temperature=1.0)
    print(f"{arch}: skipped sync {skipped:.3e}, synced {synced:.3e}")
    assert synced < 1e-4 and skipped > 1e-2, (synced, skipped)
