"""The hf engine's inference copy against the training module under a strategy (single; FSDP2 / ZeRO-3 under
torchrun with 2 gloo ranks), before and after two real AdamW steps: greedy tokens of the copy and of the
training module (which generates in lockstep when sharded), and the log-probs of the copy's sampled tokens
under both; after the steps also before the copy is refreshed (stale: the check can fail).

Usage: python inference_copy.py MODEL_DIR OUT_FILE STRATEGY  (writes OUT_FILE.RANK, JSON)
"""

from __future__ import annotations

import json
import sys

import torch
from vllm_sync import make_prompts, raise_likelihood, trainer_logprobs

from vlrft.models.loading import load_model
from vlrft.rollout import HFEngineConfig, SamplingParams, make_engine
from vlrft.strategies import OptimConfig, StrategyConfig, finish_process, make_strategy


def compare(copy, policy, model, processor, prompts) -> dict:
    """Greedy tokens of the copy == the policy's; the largest |log-prob| gap on the copy's samples (T = 1)."""
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=8)
    ours = [x.response_ids.tolist() for x in copy.generate(prompts, greedy)]
    ref = [x.response_ids.tolist() for x in policy.generate(prompts, greedy)]
    torch.manual_seed(11)
    sampled = copy.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=8))
    with torch.no_grad():
        trained, mask = trainer_logprobs(model, processor, prompts, sampled, 1.0, suppress=copy.suppress)
        own, _ = trainer_logprobs(copy.model, processor, prompts, sampled, 1.0, suppress=copy.suppress)
    gap = float((trained.cpu() - own.cpu()).abs()[mask.bool()].max())
    return {"greedy_equal": ours == ref, "greedy_tokens": sum(map(len, ours)), "logprob_gap": gap}


def main() -> None:
    model_dir, out_file, name = sys.argv[1:4]
    strategy = make_strategy(StrategyConfig(name=name, zero_stage=3, grad_clip=0), OptimConfig(lr=5e-3))
    model, processor = load_model(model_dir, "float32")
    strategy.prepare(model, total_steps=2)
    sharded = strategy.shards_parameters
    policy = make_engine("hf", strategy.unwrap(), processor, synced=sharded)
    copy = make_engine("hf", strategy.unwrap(), processor, synced=sharded, hf=HFEngineConfig(inference_copy="on"))
    report = {"copy": copy.copy is not None, "policy_lockstep": policy.synced, "copy_lockstep": copy.synced}
    prompts = make_prompts(processor, "one_image", seed=3 + strategy.rank)
    strategy.train_module.eval()
    report["before"] = compare(copy, policy, strategy.train_module, processor, prompts)
    rollouts = copy.generate(prompts, SamplingParams(n=2, temperature=1.0, max_new_tokens=8))
    copy.sleep()  # the update gets the memory (on a GPU: the copy goes to CPU memory)
    strategy.train_module.train()
    raise_likelihood(strategy, processor, prompts, rollouts)  # two AdamW steps: the policy moves
    strategy.train_module.eval()
    copy.wake()
    report["stale"] = compare(copy, policy, strategy.train_module, processor, prompts)
    copy.update_weights(strategy.full_params(trainable_only=not copy.needs_all_params))
    report["after"] = compare(copy, policy, strategy.train_module, processor, prompts)
    with open(f"{out_file}.{strategy.rank}", "w") as f:
        json.dump(report, f)
    strategy.barrier()


if __name__ == "__main__":
    main()
    sys.exit(finish_process(0))
