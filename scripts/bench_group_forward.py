"""Time the policy loss's forward and backward over one micro-batch with the group-shared forward and with the plain
per-sample rows, side by side in one process, alternating (docs/benchmarks.md, "Group-shared forward").

The model is a random tiny-model-factory model of ``--arch`` at ``--hidden --layers --heads`` (Qwen3.5: every 4th
layer and the last full attention, the rest Gated DeltaNet linear attention; the group-shared forward is then the
cached path: each prompt's forward once, its states carried into each sample's continuation; attention-only archs
pack one row per prompt). ``--prompts`` text prompts of ``--prompt-tokens`` tokens each, ``--generations`` random
responses of ``--response-tokens`` tokens per prompt, all in one micro-batch. Each round times one forward +
backward per side (shared first in even rounds, plain first in odd ones); prints the median per side, the ratio,
and the largest log-prob difference between the two (the exactness the tests assert).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_group_forward.py --arch qwen3_5 --hidden 256 --layers 4
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from data_pipelines.collate import collate_sequences, encode_prompt  # noqa: E402
from data_pipelines.records import PromptRecord  # noqa: E402
from vlrft.models.loading import load_model  # noqa: E402
from vlrft.models.packing import shared_forward_kind  # noqa: E402
from vlrft.models.tiny import make_tiny_model  # noqa: E402
from vlrft.trainer.experience import response_logprobs, response_tensors  # noqa: E402

WORDS = "red green blue yellow the a of which colour is this square and that one".split()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="qwen3_5")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--generations", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--response-tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=5, help="rounds counted (after one warm-up round)")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model(tmp, arch=a.arch, hidden=a.hidden, layers=a.layers, heads=a.heads)
        model, proc = load_model(path)
    model.train()
    tok = getattr(proc, "tokenizer", proc)
    g = torch.Generator().manual_seed(0)
    prompts = []
    for i in range(a.prompts):
        words = [WORDS[int(j)] for j in torch.randint(0, len(WORDS), (a.prompt_tokens,), generator=g)]
        ids = encode_prompt(proc, PromptRecord(id=str(i), prompt=" ".join(words))).input_ids
        prompts.append(encode_prompt(proc, PromptRecord(id=str(i), prompt=tok.decode(ids[: a.prompt_tokens]))))
    index = [i for i in range(a.prompts) for _ in range(a.generations)]
    responses = [torch.randint(3, 200, (a.response_tokens,), generator=g) for _ in index]
    batch = collate_sequences(prompts, index, responses, tok.pad_token_id)
    ids, mask = response_tensors(responses, tok.pad_token_id)
    adv = torch.randn(len(index), 1, generator=g).expand_as(ids)

    def step(shared: bool) -> tuple[float, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        logp, _ = response_logprobs(model, batch, ids, shared=shared)
        (-(logp * adv * mask).sum() / mask.sum()).backward()
        return time.perf_counter() - start, logp.detach()

    times: dict[bool, list[float]] = {True: [], False: []}
    gap = 0.0
    for r in range(a.rounds + 1):
        order = (True, False) if r % 2 == 0 else (False, True)
        got = {}
        for shared in order:
            t, got[shared] = step(shared)
            if r:
                times[shared].append(t)
        gap = max(gap, (got[True] - got[False])[mask.bool()].abs().max().item())
    shared_s, plain_s = statistics.median(times[True]), statistics.median(times[False])
    params = sum(x.numel() for x in model.parameters())
    print(
        f"{a.arch} ({params / 1e6:.1f} M parameters, hidden {a.hidden}, {a.layers} layers), {a.prompts} prompts x "
        f"{a.generations} samples, prompts of {batch['prompt_lengths'].max().item()} tokens, responses of "
        f"{a.response_tokens}; torch {torch.__version__}, {a.threads} thread(s), {platform.processor() or 'cpu'}"
    )
    print(f"group-shared forward: {shared_forward_kind(model, batch)}")
    print(f"forward + backward, median of {a.rounds}: shared {shared_s:.3f} s, plain {plain_s:.3f} s")
    print(f"plain / shared: {plain_s / shared_s:.2f}x; max |log-prob difference| {gap:.2e}")


if __name__ == "__main__":
    main()
