"""Batched generation for evaluation: chat messages in, n decoded responses per prompt out.

One function on purpose, so that it can later be pointed at the trainer's rollout engine. Left padding;
greedy when ``temperature == 0`` (n > 1 then repeats the single greedy response); seeded sampling
otherwise, on a forked RNG so that an in-training evaluation leaves the trainer's RNG untouched.
Images travel inside the messages (``{"type": "image", "image": PIL.Image}``) through the processor's
chat template.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from data_pipelines.collate import tokenizer_of


@dataclass
class Generation:
    text: str
    num_tokens: int  # generated tokens, EOS included when the model stopped by itself
    finish_reason: str  # "stop" (EOS) or "length" (max_new_tokens reached)


@torch.no_grad()
def generate(model: torch.nn.Module, processor_or_tokenizer: Any, messages: list[list[dict[str, Any]]], *,
             n: int = 1, temperature: float = 0.0, top_p: float = 1.0, max_new_tokens: int = 512,
             seed: int = 0) -> list[list[Generation]]:  # fmt: skip
    """``n`` responses for each conversation in ``messages`` (one batch), prompt-major."""
    tok = tokenizer_of(processor_or_tokenizer)
    side = tok.padding_side
    tok.padding_side = "left"
    try:
        kwargs: dict[str, Any] = dict(add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt")
        if tok is processor_or_tokenizer:
            inputs = tok.apply_chat_template(messages, padding=True, **kwargs)
        else:
            inputs = processor_or_tokenizer.apply_chat_template(
                messages, processor_kwargs={"padding": True, "padding_side": "left"}, **kwargs
            )
    finally:
        tok.padding_side = side
    device = next(model.parameters()).device
    inputs = {k: v.to(device) for k, v in inputs.items()}
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) - {None}
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else next(iter(eos_ids))
    gen_kwargs: dict[str, Any] = dict(max_new_tokens=max_new_tokens, pad_token_id=pad_id)
    sample = temperature > 0 and n > 0
    if sample:
        gen_kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=None, num_return_sequences=n)
    else:
        gen_kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    was_training = model.training
    model.eval()
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            out = model.generate(**inputs, **gen_kwargs)
    finally:
        model.train(was_training)
    new = out[:, inputs["input_ids"].shape[1] :].cpu()
    per_prompt = n if sample else 1
    results: list[list[Generation]] = []
    for i in range(len(messages)):
        gens = [_decode(tok, new[i * per_prompt + j].tolist(), eos_ids) for j in range(per_prompt)]
        results.append(gens if sample else gens * n)
    return results


def _decode(tok: Any, ids: list[int], eos_ids: set[int]) -> Generation:
    reason = "length"
    for pos, t in enumerate(ids):
        if t in eos_ids:
            ids, reason = ids[: pos + 1], "stop"  # what follows is padding
            break
    return Generation(tok.decode(ids, skip_special_tokens=True), len(ids), reason)


def generate_with_engine(engine: Any, processor: Any, records: list[Any], *, system_prompt: str | None,
                         prompt_template: str | None, n: int = 1, temperature: float = 0.0, top_p: float = 1.0,
                         max_new_tokens: int = 512, seed: int = 0) -> list[list[Generation]]:  # fmt: skip
    """As :func:`generate`, through a rollout engine (``vlrft.rollout``): what the policy trainer uses,
    so an in-training evaluation shares the trainer's engine (sharded models, vLLM) and prompt encoding."""
    from data_pipelines.collate import encode_prompt
    from vlrft.rollout import SamplingParams

    sample = temperature > 0
    prompts = [encode_prompt(processor, r, system_prompt=system_prompt, prompt_template=prompt_template) for r in records]
    sampling = SamplingParams(n=n if sample else 1, temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens)
    device = next(engine.model.parameters()).device if hasattr(engine, "model") else torch.device("cpu")
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        rollouts = engine.generate(prompts, sampling)
    results: list[list[Generation]] = [[] for _ in records]
    for r in rollouts:
        results[r.prompt_index].append(Generation(r.text, int(r.response_ids.numel()), r.finish_reason))
    return results if sample else [g * n for g in results]
