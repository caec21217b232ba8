"""Micro-batches by a token budget (``train.micro_batch_tokens``), the same number of them on every rank.

Every trainer's loss is a sum over tokens (or sequences, pairs) divided by a count over the whole
optimizer step on all ranks, so how a step's samples are cut into micro-batches does not change the
update: only the rounding. A fixed ``micro_train_batch_size`` cuts by sample count, which gives one
micro-batch of short answers and one of long ones the same size; a token budget fills each micro-batch
up to the same number of tokens instead, so the largest fits memory and the rest are not small.

What a sample costs: its ``tokens`` (an unpacked row: prompt + response; a conversation: its length)
plus, for samples packed by the group-shared forward, its prompt's ``shared`` tokens once per
micro-batch that holds any sample of that prompt (the packed row is the prompt once + its responses).

Balanced across ranks: FSDP2 gathers parameters in every forward and reduces gradients in every
backward, DeepSpeed ZeRO-3 likewise, so every rank must run the same number of micro-batches. The
count is all-reduced (max) and a rank with fewer first splits its largest micro-batches (no extra
work: smaller micro-batches, on a rank that would otherwise wait), then, only when it has fewer
samples than micro-batches to run, pads with zero-weight micro-batches (:data:`PAD`: a forward and
backward of one real sample whose loss is multiplied by 0, which adds exactly nothing to the gradient).
"""

from __future__ import annotations

from typing import Any, Hashable, Sequence

import torch

from vlrft.config import option

# a micro-batch that only keeps the ranks in step: run on one sample with weight 0
PAD: tuple[int, ...] = ()


def micro_batch_tokens_option():
    """The ``train.micro_batch_tokens`` field every trainer's config declares (one help text, one range)."""
    return option(
        0,
        "token budget per micro-batch (0: off, micro-batches by sample count): micro-batches are filled up to this "
        "many tokens (a packed group counts its prompt once plus its responses; images count their tokens), the "
        "same number on every rank; the update equals the fixed micro-batches' (docs/strategies.md)",
        ge=0,
    )


def budget_micro_batches(
    tokens: Sequence[int],
    budget: int,
    *,
    shared: Sequence[int] | None = None,
    keys: Sequence[Hashable] | None = None,
) -> list[list[int]]:
    """Positions ``0..n-1`` cut into micro-batches of at most ``budget`` tokens (a sample larger than the
    budget alone makes one). ``shared[i]`` tokens are paid once per micro-batch per ``keys[i]`` (a packed
    prompt); samples of one key are kept next to each other (a stable sort by first appearance), so a
    packed prompt is split over as few micro-batches as the budget allows."""
    n = len(tokens)
    shared = shared if shared is not None else [0] * n
    keys = keys if keys is not None else list(range(n))
    first: dict[Hashable, int] = {}
    for i, k in enumerate(keys):
        first.setdefault(k, i)
    order = sorted(range(n), key=lambda i: first[keys[i]])
    out: list[list[int]] = []
    current: list[int] = []
    seen: set[Hashable] = set()
    used = 0
    for i in order:
        cost = int(tokens[i]) + (0 if keys[i] in seen else int(shared[i]))
        if current and used + cost > budget:
            out.append(current)
            current, seen, used = [], set(), 0
            cost = int(tokens[i]) + int(shared[i])
        current.append(i)
        seen.add(keys[i])
        used += cost
    if current:
        out.append(current)
    return out


def micro_batch_cost(batch: Sequence[int], tokens: Sequence[int], shared: Sequence[int], keys: Sequence) -> int:
    """The tokens of one micro-batch as :func:`budget_micro_batches` counts them."""
    return sum(int(tokens[i]) for i in batch) + sum(int(shared[i]) for i in {keys[i]: i for i in batch}.values())


def even_out(batches: list[list[int]], count: int, cost) -> list[list[int] | tuple]:
    """``batches`` made exactly ``count`` long: the costliest micro-batch of more than one sample split in two
    (by cost, order kept) until there are enough, then :data:`PAD` entries for what splitting cannot give."""
    out: list[Any] = [list(b) for b in batches]
    while len(out) < count:
        splittable = [j for j, b in enumerate(out) if len(b) > 1]
        if not splittable:
            out += [PAD] * (count - len(out))
            break
        j = max(splittable, key=lambda j: cost(out[j]))
        b = out[j]
        half, acc = 1, cost(b[:1])
        while half < len(b) - 1 and acc + cost(b[half : half + 1]) <= cost(b) / 2:
            acc += cost(b[half : half + 1])
            half += 1
        out[j : j + 1] = [b[:half], b[half:]]
    return out


def plan_micro_batches(
    strategy: Any,
    tokens: Sequence[int],
    budget: int,
    *,
    shared: Sequence[int] | None = None,
    keys: Sequence[Hashable] | None = None,
) -> list[list[int] | tuple]:
    """This rank's micro-batches under ``budget`` (:func:`budget_micro_batches`), as many as the rank with the
    most (:func:`even_out`; ``strategy.all_reduce`` agrees on the count)."""
    n = len(tokens)
    shared = shared if shared is not None else [0] * n
    keys = keys if keys is not None else list(range(n))
    batches = budget_micro_batches(tokens, budget, shared=shared, keys=keys)
    count = int(strategy.all_reduce(torch.tensor(float(len(batches))), "max"))
    return even_out(batches, count, lambda b: micro_batch_cost(b, tokens, shared, keys))


def sequence_micro_batches(
    strategy: Any, batch: dict[str, torch.Tensor], idx: torch.Tensor, budget: int, size: int, *, packed: bool
) -> list[tuple[torch.Tensor, float]]:
    """Samples ``idx`` of a collated prompt+response batch (``data_pipelines.collate.collate_sequences``) as
    micro-batches: ``size`` samples each when ``budget`` is 0, else filled up to ``budget`` tokens, as many on
    every rank. Each is (sample indices, loss weight): 1, or 0 for a :data:`PAD` one (run on the shortest
    sample). ``packed``: the group-shared forward computes each prompt once with its responses."""
    if not budget:
        return [(idx[k : k + size], 1.0) for k in range(0, len(idx), size)]
    prompt, response = batch["prompt_lengths"][idx].tolist(), batch["response_lengths"][idx].tolist()
    if packed:
        tokens, shared, keys = response, prompt, batch["prompt_index"][idx].tolist()
    else:
        tokens, shared, keys = [p + r for p, r in zip(prompt, response)], None, None
    plan = plan_micro_batches(strategy, tokens, budget, shared=shared, keys=keys)
    shortest = min(range(len(prompt)), key=lambda i: prompt[i] + response[i])
    return [(idx[list(p)], 1.0) if p != PAD else (idx[[shortest]], 0.0) for p in plan]
