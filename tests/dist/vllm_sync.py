"""vLLM weight sync after real optimizer steps under a strategy (single; FSDP2 / ZeRO-3 under torchrun with
2 gloo ranks): each process holds its own vLLM engine; after two AdamW steps the engine's log-probs of its
own samples are compared with the trainer's before the sync (a skipped sync: stale) and after it.

Usage: python vllm_sync.py MODEL_DIR OUT_FILE STRATEGY  (out: {"skipped": max gap, "synced": max gap} per rank)
"""

from __future__ import annotations

import json
import sys

import torch
from PIL import Image

from data_pipelines.collate import collate_sequences, encode_prompt, tokenizer_of
from data_pipelines.records import PromptRecord
from data_pipelines.synthetic import make_prompt_records
from vlrft.models.loading import load_model
from vlrft.rollout import SamplingParams, VLLMRolloutEngine, stack_rollout_logprobs
from vlrft.strategies import OptimConfig, StrategyConfig, finish_process, make_strategy
from vlrft.trainer.experience import response_logprobs, response_tensors


def make_prompts(processor, kind: str, seed: int = 3) -> list:
    """4 encoded prompts: text only, one image, or two images each."""
    if kind == "text":
        texts = ["Name a colour.", "Count to three.", "What is two plus two?", "Say hello."]
        records = [PromptRecord(id=str(i), prompt=t) for i, t in enumerate(texts)]
    elif kind == "one_image":
        records = make_prompt_records("color", 4, seed=seed)
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


def trainer_logprobs(model, processor, prompts, rollouts, temperature: float, grad: bool = False, suppress=()):
    """The trainer's ``[N, R]`` log-probs of the rollouts (the policy loss's own function) and their mask.
    ``suppress``: token ids the engine never samples (vision placeholders): with them (as the trainer passes
    them), the log-probs of the distribution the engine samples from (those tokens at probability 0)."""
    pad = tokenizer_of(processor).pad_token_id
    responses = [x.response_ids for x in rollouts]
    batch = collate_sequences(prompts, [x.prompt_index for x in rollouts], responses, pad)
    ids, mask = response_tensors(responses, pad)
    banned = torch.tensor(sorted(suppress), dtype=torch.long)
    with torch.set_grad_enabled(grad):
        logp, _ = response_logprobs(model, batch, ids, temperature=temperature, suppress=banned)
    return logp, mask


def logprob_gaps(engine, model, processor, prompts, temperature: float = 0.8) -> tuple[float, float]:
    """Largest |vLLM - trainer| log-prob over the tokens vLLM sampled (n=2 per prompt): against the trainer's
    distribution with the vision placeholders the engine suppresses left out, and against the plain one
    (which differs by the suppressed tokens' probability mass, -log(1 - p))."""
    rollouts = engine.generate(prompts, SamplingParams(n=2, temperature=temperature, max_new_tokens=12))
    engine_logp = None
    gaps = []
    for suppress in (engine.suppress, ()):
        logp, mask = trainer_logprobs(model, processor, prompts, rollouts, temperature, suppress=suppress)
        engine_logp = stack_rollout_logprobs(rollouts, mask.shape[1])
        assert engine_logp is not None and int(mask.sum()) > 0
        gaps.append(float((logp.cpu() - engine_logp).abs()[mask.bool()].max()))
    return gaps[0], gaps[1]


def max_logprob_gap(engine, model, processor, prompts, temperature: float = 0.8) -> float:
    """:func:`logprob_gaps` against the distribution the engine samples from."""
    return logprob_gaps(engine, model, processor, prompts, temperature)[0]


def raise_likelihood(strategy, processor, prompts, rollouts, steps: int = 2) -> None:
    """``steps`` AdamW steps raising the likelihood of ``rollouts``: the policy moves."""
    for _ in range(steps):
        logp, mask = trainer_logprobs(strategy.train_module, processor, prompts, rollouts, 1.0, grad=True)
        mask = mask.to(logp.device)
        strategy.backward(-(logp * mask).sum() / mask.sum())
        strategy.step()


def main() -> None:
    model_dir, out_file, name = sys.argv[1:4]
    strategy = make_strategy(StrategyConfig(name=name, zero_stage=3, grad_clip=0), OptimConfig(lr=5e-3))
    model, processor = load_model(model_dir, "float32")
    strategy.prepare(model, total_steps=2)
    engine = VLLMRolloutEngine(model_dir, processor, distributed=strategy.distributed, seed=strategy.rank)
    kind = "one_image" if getattr(processor, "image_processor", None) is not None else "text"
    prompts = make_prompts(processor, kind, seed=3 + strategy.rank)
    rollouts = engine.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=8))
    raise_likelihood(strategy, processor, prompts, rollouts)
    strategy.train_module.eval()
    skipped = max_logprob_gap(engine, strategy.train_module, processor, prompts, temperature=1.0)
    engine.update_weights(strategy.full_params(trainable_only=True))
    synced = max_logprob_gap(engine, strategy.train_module, processor, prompts, temperature=1.0)
    with open(f"{out_file}.{strategy.rank}", "w") as f:
        json.dump({"skipped": skipped, "synced": synced}, f)
    strategy.barrier()


if __name__ == "__main__":
    main()
    sys.exit(finish_process(0))
