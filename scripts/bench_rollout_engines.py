"""Rollout speed, vllm vs hf, on the same text Qwen2, side by side (alternating rounds).

Both engines generate ``--prompts`` prompts x ``--n`` samples x up to ``--max-new-tokens`` tokens (T=1) from
the same random model (about 20 M parameters by default, float32); tokens/s counts the tokens actually
generated. Run in the vLLM venv: ``.venv-vllm/bin/python scripts/bench_rollout_engines.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from data_pipelines.collate import encode_prompt
from data_pipelines.records import PromptRecord
from vlrft.models.loading import load_model
from vlrft.models.tiny import make_tiny_model
from vlrft.rollout import HFRolloutEngine, SamplingParams, VLLMRolloutEngine

WORDS = "red green blue circle square two three four seven apple river stone cloud light".split()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default="", help="write the figures as JSON here too")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    folder = Path(tempfile.mkdtemp()) / "bench-qwen2"
    make_tiny_model(folder, arch="qwen2", hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=2)
    model, tokenizer = load_model(str(folder), "float32")
    model.eval()
    params = sum(t.numel() for t in model.parameters())
    records = [
        PromptRecord(id=str(i), prompt=" ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(8 + i % 8)))
        for i in range(args.prompts)
    ]
    prompts = [encode_prompt(tokenizer, r) for r in records]
    sampling = SamplingParams(n=args.n, temperature=1.0, max_new_tokens=args.max_new_tokens)
    engines = {"hf": HFRolloutEngine(model, tokenizer, micro_batch_size=args.prompts), "vllm": None}
    t0 = time.perf_counter()
    engines["vllm"] = VLLMRolloutEngine(str(folder), tokenizer)
    startup = time.perf_counter() - t0
    rates: dict[str, list[float]] = {"hf": [], "vllm": []}
    for r in range(args.rounds + 1):  # round 0 warms both up and is not counted
        for name in ("vllm", "hf") if r % 2 else ("hf", "vllm"):
            t0 = time.perf_counter()
            out = engines[name].generate(prompts, sampling)
            dt = time.perf_counter() - t0
            tokens = sum(x.response_ids.numel() for x in out)
            if r:
                rates[name].append(tokens / dt)
            print(f"round {r} {name}: {tokens} tokens in {dt:.2f} s = {tokens / dt:,.0f} tokens/s", flush=True)
    result = {
        "params_m": params / 1e6,
        "shape": f"{args.prompts} prompts x {args.n} samples x {args.max_new_tokens} tokens",
        "threads": args.threads,
        "vllm_startup_s": startup,
        **{f"{k}_tokens_per_s_median": statistics.median(v) for k, v in rates.items()},
        **{f"{k}_tokens_per_s": v for k, v in rates.items()},
    }
    result["ratio_vllm_over_hf"] = result["vllm_tokens_per_s_median"] / result["hf_tokens_per_s_median"]
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
