"""Reward shaping: DAPO's soft overlong penalty, clipping, running normalisation, weighted combination."""

from __future__ import annotations

import math

import torch

Tensor = torch.Tensor


def overlong_penalty(
    response_lengths: Tensor, max_response_length: int, overlong_buffer_len: int, penalty_factor: float = 1.0
) -> Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, eq. 13), to be *added* to the reward:

    ``0`` if ``|y| <= L_max - L_cache``; ``((L_max - L_cache) - |y|) / L_cache`` if
    ``L_max - L_cache < |y| <= L_max``; ``-1`` if ``|y| > L_max``; all times ``penalty_factor``.
    ``L_cache = overlong_buffer_len``; 0 gives the hard penalty (``-penalty_factor`` beyond ``L_max`` only).
    Values lie in ``[-penalty_factor, 0]``; float32 (float64 for float64 lengths).
    """
    if max_response_length <= 0 or not 0 <= overlong_buffer_len <= max_response_length:
        raise ValueError(
            f"overlong_penalty: need max_response_length > 0 and 0 <= overlong_buffer_len <= max_response_length, "
            f"got {max_response_length}, {overlong_buffer_len}"
        )
    dtype = torch.float64 if response_lengths.dtype == torch.float64 else torch.float32
    lengths = response_lengths.to(dtype)
    if overlong_buffer_len == 0:
        return torch.where(lengths > max_response_length, -penalty_factor, 0.0).to(dtype)
    expected = max_response_length - overlong_buffer_len
    soft = ((expected - lengths) / overlong_buffer_len).clamp(min=-1.0, max=0.0)
    return soft * penalty_factor


def clip_rewards(rewards: Tensor, min_value: float | None = None, max_value: float | None = None) -> Tensor:
    """Clamp rewards into ``[min_value, max_value]`` (either bound may be None)."""
    if min_value is not None and max_value is not None and min_value > max_value:
        raise ValueError(f"clip_rewards: min_value {min_value} > max_value {max_value}")
    return rewards.clamp(min=min_value, max=max_value)


class RunningRewardNormalizer:
    """Running mean/std of all rewards seen (Chan et al. 1979 parallel update, float64), used to
    normalise rewards as ``(r - mean) / (std + eps)`` (reward scaling as in Engstrom et al. 2020,
    arXiv 2005.12729, Sec. 3; OpenRLHF's ``normalize_reward``). ``state_dict``/``load_state_dict`` for resume.

    ``normalize(r)`` first folds ``r`` into the statistics (unless ``update=False``), then normalises,
    so the first batch is normalised by its own statistics. The std is the population std. Until
    ``min_count`` rewards have been seen, rewards pass unchanged; if every reward seen so far is equal,
    the centred result is 0 up to rounding (std + eps >= eps keeps it finite).
    """

    def __init__(self, eps: float = 1e-6, center: bool = True, min_count: int = 2):
        self.eps, self.center, self.min_count = float(eps), bool(center), int(min_count)
        self.count, self.mean, self.m2 = 0, 0.0, 0.0

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count else 0.0

    def update(self, rewards: Tensor) -> None:
        x = rewards.detach().to(torch.float64).reshape(-1)
        if not bool(torch.isfinite(x).all()):
            raise ValueError("RunningRewardNormalizer.update: rewards contain NaN or inf")
        n = x.numel()
        if n == 0:
            return
        batch_mean = float(x.mean())
        batch_m2 = float(((x - batch_mean) ** 2).sum())
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * n / total
        self.m2 += batch_m2 + delta * delta * self.count * n / total
        self.count = total

    def normalize(self, rewards: Tensor, update: bool = True) -> Tensor:
        """Normalised rewards, same dtype as ``rewards``. Until ``min_count`` rewards have been seen the
        rewards are returned unchanged (no statistics to trust yet)."""
        if update:
            self.update(rewards)
        if self.count < self.min_count:
            return rewards.clone()
        x = rewards.to(torch.float64)
        if self.center:
            x = x - self.mean
        return (x / (self.std + self.eps)).to(rewards.dtype)

    def state_dict(self) -> dict:
        return {
            "count": self.count,
            "mean": self.mean,
            "m2": self.m2,
            "eps": self.eps,
            "center": self.center,
            "min_count": self.min_count,
        }

    def load_state_dict(self, state: dict) -> None:
        self.count, self.mean, self.m2 = int(state["count"]), float(state["mean"]), float(state["m2"])
        self.eps, self.center = float(state["eps"]), bool(state["center"])
        self.min_count = int(state.get("min_count", 2))


def combine_rewards(sources: dict[str, Tensor], weights: dict[str, float]) -> Tensor:
    """``sum_k weights[k] * sources[k]``: the weighted sum of several reward sources (rule verifiers,
    reward models), each ``[N]``, added in float64 in the order of ``sources`` and returned as float32
    (float64 if any source is). Every source needs a weight and every weight a source; a NaN/inf score
    is an error naming the source and the sample (a scorer that failed must say so, not score 0)."""
    if not sources:
        raise ValueError("combine_rewards: no reward sources given")
    missing, unused = sorted(set(sources) - set(weights)), sorted(set(weights) - set(sources))
    if missing or unused:
        raise ValueError(f"combine_rewards: sources without a weight: {missing}; weights without a source: {unused}")
    shape = None
    total = None
    dtype = torch.float32
    for name, scores in sources.items():
        if shape is None:
            shape = scores.shape
        elif scores.shape != shape:
            raise ValueError(f"combine_rewards: source {name!r} has shape {tuple(scores.shape)}, others {tuple(shape)}")
        bad = (~torch.isfinite(scores)).nonzero()
        if bad.numel():
            raise ValueError(f"combine_rewards: source {name!r} gave a non-finite score for sample {bad[0].tolist()}")
        if scores.dtype == torch.float64:
            dtype = torch.float64
        term = float(weights[name]) * scores.to(torch.float64)
        total = term if total is None else total + term
    return total.to(dtype)
