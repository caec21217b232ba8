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
