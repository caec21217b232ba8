"""Seeded data orders for both trainers: the order of an epoch is a pure function of (seed, epoch), so a
resumed run continues the same order from its position alone (both trainers' bitwise-resume tests)."""

from __future__ import annotations

import torch

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
