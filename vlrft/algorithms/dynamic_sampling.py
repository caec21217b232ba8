"""DAPO dynamic sampling (Yu et al. 2025, arXiv 2503.14476, Sec. 3.2 and eq. 11, Algorithm 1 line 6).

Groups whose rewards all agree (all correct or all wrong) have zero advantage under group baselines
and give no gradient; DAPO drops them and samples more prompts until the batch holds
``target_num_groups`` groups with ``0 < #correct < G``. The policy trainer
(``PolicyTrainer.make_experience``) loops::

    groups, tries, need = [], 0, target_num_groups
    while need:
        tries += 1
        drawn = sample_and_score(need)                    # scored groups
        groups += [g for g in drawn if varied(g)][:target_num_groups - len(groups)]
        short = max over ranks of (target_num_groups - len(groups))   # ranks draw in step
        need = more_prompts_needed(target_num_groups - short, target_num_groups, tries, max_tries)

where :func:`filter_zero_variance_groups` defines "varied". ``more_prompts_needed`` raises
:class:`DynamicSamplingExhausted` after ``max_tries`` generation rounds that did not fill the batch
(verl's ``max_num_gen_batches``; ``max_tries <= 0`` means no limit): the trainer prints its message and
trains on the groups kept (on the last round unfiltered if a rank kept none).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

Tensor = torch.Tensor


class DynamicSamplingExhausted(RuntimeError):
    """Dynamic sampling used ``max_tries`` generation rounds without filling the batch."""


def filter_zero_variance_groups(rewards: Tensor, group_ids: Tensor | Sequence) -> tuple[Tensor, int]:
    """``(keep_mask[N], num_kept_groups)``: keep the samples of groups whose rewards are not all equal
    (DAPO eq. 11: ``0 < |{o_i correct}| < G``, generalised to real-valued rewards as ``max > min``).
    A group of one sample has zero variance and is dropped."""
    if rewards.dim() != 1:
        raise ValueError(f"filter_zero_variance_groups: rewards must be [N], got {tuple(rewards.shape)}")
    if not isinstance(group_ids, Tensor):
        index: dict = {}
        group_ids = torch.tensor([index.setdefault(u, len(index)) for u in group_ids])
    group_ids = group_ids.to(rewards.device)
    if group_ids.shape != rewards.shape:
        raise ValueError(f"filter_zero_variance_groups: {group_ids.numel()} group ids for {rewards.numel()} rewards")
    if rewards.numel() == 0:
        return torch.zeros(0, dtype=torch.bool, device=rewards.device), 0
    _, inv = torch.unique(group_ids, return_inverse=True)
    g = int(inv.max()) + 1
    r = rewards.detach().to(torch.float64)
    gmax = torch.full((g,), -torch.inf, dtype=r.dtype, device=r.device).scatter_reduce(0, inv, r, "amax")
    gmin = torch.full((g,), torch.inf, dtype=r.dtype, device=r.device).scatter_reduce(0, inv, r, "amin")
    varied = gmax > gmin
    return varied[inv], int(varied.sum())


def more_prompts_needed(num_kept_groups: int, target_num_groups: int, num_tries: int, max_tries: int) -> int:
    """How many more prompts (one group each) to sample so the batch reaches ``target_num_groups``; 0 when
    full. Raises :class:`DynamicSamplingExhausted` when ``num_tries >= max_tries > 0`` and the batch is
    still short: the data are too easy or too hard for the policy (every group all right or all wrong),
    or the reward is constant."""
    if target_num_groups <= 0:
        raise ValueError(f"target_num_groups must be > 0, got {target_num_groups}")
    needed = max(0, target_num_groups - num_kept_groups)
    if needed and max_tries > 0 and num_tries >= max_tries:
        raise DynamicSamplingExhausted(
            f"dynamic sampling: {num_tries} generation rounds kept {num_kept_groups} of {target_num_groups} "
            "groups with non-constant rewards. The prompts are too easy or too hard for the policy, or the "
            "reward is constant; raise the max_tries limit, lower the batch size, or set "
            "algorithm.dynamic_sampling=false"
        )
    return needed
