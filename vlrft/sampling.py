"""Seeded data orders for every trainer: the order of an epoch is a pure function of (seed, epoch), so a
resumed run continues the same order from its position alone (the trainers' bitwise-resume tests); and the one
split of held-out records over ranks (:func:`share_over_ranks`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TypeVar

import torch

T = TypeVar("T")

# Each trainer keeps the orders its runs and checkpoints were made with.
POLICY_ORDER_STRIDE = 1_000_003  # prompt order of episode e: seed * 1_000_003 + e
REWARD_ORDER_STRIDE = 100_003  # record (or record-group) order of epoch e: seed * 100_003 + e


def seeded_permutation(n: int, seed: int, epoch: int, *, stride: int = POLICY_ORDER_STRIDE) -> list[int]:
    """A permutation of ``range(n)``: ``torch.randperm`` with a CPU generator seeded ``seed * stride + epoch``."""
    generator = torch.Generator().manual_seed(seed * stride + epoch)
    return torch.randperm(n, generator=generator).tolist()


class PromptStream:
    """The policy trainer's global stream of training prompts: episode ``e`` visits them in
    :func:`seeded_permutation` order, groups of ``group_size`` consecutive records permuted as units (a judgment in
    both orders stays together). ``cursor`` (prompts consumed, over all ranks) is the whole position: a checkpoint
    keeps it and a resumed run draws the same prompts."""

    def __init__(self, records: list, group_size: int, seed: int):
        self.records, self.group_size, self.seed = records, group_size, seed
        self.cursor = 0
        self._order: tuple[int, list[int]] = (-1, [])  # (episode, its order), the one being read

    def _episode(self, episode: int) -> list[int]:
        g = self.group_size
        groups = seeded_permutation(len(self.records) // g, self.seed, episode)
        return [k * g + j for k in groups for j in range(g)]

    def take(self, count: int) -> list:
        """The next ``count`` records of the global stream (every rank takes them all, then its share)."""
        n = len(self.records)
        picked = []
        for k in range(self.cursor, self.cursor + count):
            episode, offset = divmod(k, n)
            if self._order[0] != episode:
                self._order = (episode, self._episode(episode))
            picked.append(self.records[self._order[1][offset]])
        self.cursor += count
        return picked


def share_over_ranks(records: Sequence[T], rank: int, world: int) -> tuple[list[T], int]:
    """This rank's share of held-out records, the one split every trainer's evaluation uses: records ``rank``,
    ``rank + world``, ... (every record on exactly one rank), then copies of the first record until every rank's
    share has the same length, ``ceil(len(records) / world)``, since sharded models (FSDP2, ZeRO-3) forward and
    generate in lockstep. Returns ``(share, counted)``: the first ``counted`` items are this rank's records, the rest
    padding, run but never counted in a metric (5 records on 2 ranks: rank 0 counts 3, rank 1 counts 2 and runs one
    padding copy)."""
    mine = list(records[rank::world])
    per_rank = -(-len(records) // world)
    return mine + [records[0] for _ in range(per_rank - len(mine))], len(mine)


def shared_chunks(records: Sequence[T], rank: int, world: int, size: int) -> Iterator[tuple[list[T], list[bool]]]:
    """This rank's :func:`share_over_ranks` in chunks of ``size``, each with its ``keep`` flags (False on the
    padding, which runs to keep sharded ranks in step and is never counted)."""
    share, counted = share_over_ranks(records, rank, world)
    for start in range(0, len(share), size):
        chunk = share[start : start + size]
        yield chunk, [start + i < counted for i in range(len(chunk))]
