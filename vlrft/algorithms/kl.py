"""KL between the policy and a reference policy: per-token estimators and the coefficient controllers.

Estimators (J. Schulman, "Approximating KL divergence", 2020, http://joschu.net/blog/kl-approx.html),
for tokens sampled from the policy ``pi`` and ``log r = log ref - log pi``:

- ``k1 = -log r = log pi - log ref``: unbiased for KL(pi || ref), high variance, can be negative.
- ``k2 = (log r)^2 / 2``: biased, low variance, always >= 0.
- ``k3 = (r - 1) - log r``: unbiased, low variance, always >= 0 (verl's ``low_var_kl``).

Use as a loss term (``algorithm.use_kl_loss: true``, GRPO, arXiv 2402.03300, eq. 3-4, with k3) or as a
per-token reward penalty (``use_kl_loss: false``, Ziegler et al. 2019 arXiv 1909.08593 eq. 2,
REINFORCE++ arXiv 2501.03262 eq. 1; see :func:`apply_kl_penalty`).
"""

from __future__ import annotations

import torch

from vlrft.algorithms.advantages import scatter_last_token

Tensor = torch.Tensor

KL_ESTIMATORS = ("k1", "k2", "k3")
_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}  # verl's names
_MAX_LOG_RATIO = 20.0  # exp(20) ~ 5e8: keeps k3 finite in float32 for extreme tokens


def kl_penalty(log_probs: Tensor, ref_log_probs: Tensor, estimator: str = "k3", max_value: float = 0.0) -> Tensor:
    """Per-token KL(pi || ref) estimate ``[B, T]`` (unmasked: multiply by the response mask yourself).

    ``k3`` clamps ``log r`` to +-20 before the exponential so it stays finite; k1 and k2 are exact.
    ``max_value`` > 0 (``algorithm.kl_max``) bounds ``k3`` at that value, with no gradient from a token above it,
    as verl's ``low_var_kl`` and OpenRLHF's ``k3`` do (their bound: 10); 0 leaves it unbounded.
    Gradients flow into ``log_probs`` (and ``ref_log_probs`` if it requires grad).
    """
    estimator = _ALIASES.get(estimator, estimator)
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl_estimator {estimator!r}; choose one of {', '.join(KL_ESTIMATORS)}")
    if log_probs.shape != ref_log_probs.shape:
        raise ValueError(
            f"kl_penalty: log_probs {tuple(log_probs.shape)} != ref_log_probs {tuple(ref_log_probs.shape)}"
        )
    log_ratio = log_probs - ref_log_probs  # log pi - log ref = -log r
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    neg = (-log_ratio).clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)  # log r
    k3 = neg.exp() - 1 - neg
    return k3.clamp(max=max_value) if max_value > 0 else k3


def apply_kl_penalty(rewards: Tensor, kl: Tensor, response_mask: Tensor, kl_coef: float) -> Tensor:
    """Token-level rewards ``[N, T]``: ``-kl_coef * kl_t`` on every response token plus the sequence
    reward ``rewards[N]`` on its last response token (Ziegler et al. 2019, arXiv 1909.08593, eq. 2;
    REINFORCE++, arXiv 2501.03262, eq. 1). Pass the result to ``compute_advantages``.

    A sequence with no response token gets no reward anywhere (its row is all zeros).
    """
    if rewards.dim() != 1 or kl.shape != response_mask.shape or rewards.shape[0] != kl.shape[0]:
        raise ValueError(
            f"apply_kl_penalty: need rewards[N], kl[N, T], response_mask[N, T]; got {tuple(rewards.shape)}, "
            f"{tuple(kl.shape)}, {tuple(response_mask.shape)}"
        )
    m = response_mask.bool()
    penalty = torch.where(m, -kl_coef * kl.detach(), torch.zeros_like(kl))
    return penalty + scatter_last_token(rewards.to(kl.dtype), m)


class FixedKLController:
    """A constant KL coefficient (``algorithm.kl_coef``); ``update`` does nothing."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Target-KL controller of Ziegler et al. 2019 (arXiv 1909.08593, Sec. 2.2):

    ``e = clip(KL_current / KL_target - 1, -0.2, 0.2)``, ``beta <- beta * (1 + K_beta * e)`` with
    ``K_beta = n_steps / horizon`` (``n_steps`` samples seen since the last update).
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"AdaptiveKLController needs target_kl > 0 and horizon > 0, got {target_kl}, {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value, "target": self.target, "horizon": self.horizon}

    def load_state_dict(self, state: dict) -> None:
        self.value, self.target, self.horizon = float(state["value"]), float(state["target"]), int(state["horizon"])
