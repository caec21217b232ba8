"""Advantage estimators, selected by name (``algorithm.advantage_estimator``).

``compute_advantages(name, rewards, response_mask, group_ids=..., ...) -> (advantages[N, T], returns[N, T])``.
``rewards`` is either one scalar per sample (``[N]``, outcome reward) or token-level (``[N, T]``, e.g. the
output of :func:`vlrft.algorithms.kl.apply_kl_penalty`); group estimators use the per-sample sum of
token-level rewards. Advantages and returns are 0 outside ``response_mask``.

``std_normalization`` (``algorithm.std_normalization``): ``None`` picks the estimator's own default;
``"group"`` divides by the std of the sample's group, ``"batch"`` by the std of the whole batch,
``"none"`` does not divide (Dr.GRPO). Which values an estimator accepts is in its registry entry.
Stds are Bessel-corrected. A group whose rewards are all equal gets advantage exactly 0 (never NaN);
an estimator that needs a group baseline refuses a group of one sample with a ValueError.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from vlrft.algorithms.masked import masked_whiten

Tensor = torch.Tensor

# the std normalisations that ``_normalise`` implements; an estimator accepts some of them
STD_NORMALIZATIONS = ("group", "batch", "none")


@dataclass(frozen=True)
class AdvantageEstimator:
    """One advantage estimator: its function and what it needs, declared once. Config validation,
    preflight and the trainer read these fields instead of testing names."""

    fn: Callable[..., tuple[Tensor, Tensor]]
    group: bool  # a per-prompt group baseline: needs group_ids and n_samples_per_prompt >= 2
    critic: bool  # needs values= (critic predictions): the trainer builds a value model
    std_normalizations: tuple[str, ...]  # the std_normalization values it accepts
    default_std: str  # what std_normalization=None picks
    teacher: bool = False  # its rewards are a teacher's per-token log-probs (the trainer needs teacher.path)


# name -> entry; filled by @register_advantage_estimator below
ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_advantage_estimator(
    name: str,
    *,
    group: bool,
    critic: bool = False,
    teacher: bool = False,
    std_normalizations: tuple[str, ...],
    default_std: str,
) -> Callable[[Callable], Callable]:
    """Decorator: register ``fn(rewards, response_mask, *, group_ids, values, gamma, lam, std_normalization,
    eps, **_) -> (advantages, returns)`` under ``name`` with what it needs. A new estimator is one function
    and this line; ``algorithm.advantage_estimator`` accepts it from then on."""
    if name in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"advantage estimator {name!r} is already registered")
    unknown = [n for n in std_normalizations if n not in STD_NORMALIZATIONS]
    if unknown or default_std not in std_normalizations:
        raise ValueError(
            f"advantage estimator {name!r}: std_normalizations {std_normalizations} must be among "
            f"{STD_NORMALIZATIONS} and contain default_std {default_std!r}"
        )

    def register(fn: Callable[..., tuple[Tensor, Tensor]]) -> Callable[..., tuple[Tensor, Tensor]]:
        ADVANTAGE_ESTIMATORS[name] = AdvantageEstimator(
            fn, group, critic, tuple(std_normalizations), default_std, teacher
        )
        return fn

    return register


def scatter_last_token(values: Tensor, mask: Tensor) -> Tensor:
    """``[N] -> [N, T]``: ``values[i]`` on the last true position of ``mask[i]``, 0 elsewhere (and 0 for an
    all-false row)."""
    m = mask.bool()
    length = m.shape[-1]
    if length == 0:
        return torch.zeros(m.shape, dtype=values.dtype, device=values.device)
    last = length - 1 - m.flip(-1).int().argmax(-1)
    out = torch.zeros(m.shape, dtype=values.dtype, device=values.device)
    has = m.any(-1)
    out[has.nonzero(as_tuple=True)[0], last[has]] = values[has]
    return out


def discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Reward-to-go ``G_t = sum_{k >= t, valid} gamma^(#valid steps from t to k) r_k`` over the valid tokens
    (REINFORCE, Williams 1992; REINFORCE++ arXiv 2501.03262 eq. 2). Invalid positions are skipped and get 0."""
    m = mask.bool()
    r = torch.where(m, token_rewards, torch.zeros_like(token_rewards))
    if gamma == 1.0:
        return torch.where(m, r.flip(-1).cumsum(-1).flip(-1), torch.zeros_like(r))
    out = torch.zeros_like(r)
    running = torch.zeros(r.shape[0], dtype=r.dtype, device=r.device)
    for t in reversed(range(r.shape[1])):
        running = torch.where(m[:, t], r[:, t] + gamma * running, running)
        out[:, t] = torch.where(m[:, t], running, torch.zeros_like(running))
    return out


class _Groups:
    """Per-group statistics of per-sample scores ``s[N]``."""

    def __init__(self, scores: Tensor, group_ids, estimator: str, min_size: int):
        if group_ids is None:
            raise ValueError(f"advantage estimator {estimator!r} needs group_ids (samples of one prompt share an id)")
        ids = _as_id_tensor(group_ids, scores.device)
        if ids.shape != scores.shape:
            raise ValueError(f"group_ids has {ids.numel()} entries for {scores.numel()} samples")
        _, inv, counts = torch.unique(ids, return_inverse=True, return_counts=True)
        small = (counts < min_size).nonzero(as_tuple=True)[0]
        if small.numel():
            bad = ids[(inv == small[0]).nonzero()[0, 0]].item()
            raise ValueError(
                f"advantage estimator {estimator!r} needs at least {min_size} samples per prompt group, but group "
                f"{bad!r} has {int(counts[small[0]])}; set rollout.n_samples_per_prompt >= {min_size} "
                "(or use reinforce_plus_plus, which needs no group)"
            )
        g = counts.numel()
        c = counts.to(scores.dtype)
        self.inv, self.count = inv, c[inv]
        mean = torch.zeros(g, dtype=scores.dtype, device=scores.device).index_add_(0, inv, scores) / c
        self.mean = mean[inv]
        var = torch.zeros_like(mean).index_add_(0, inv, (scores - self.mean) ** 2) / (c - 1).clamp(min=1)
        self.std = var.sqrt()[inv]
        gmax = torch.full_like(mean, -torch.inf).scatter_reduce(0, inv, scores, "amax")
        gmin = torch.full_like(mean, torch.inf).scatter_reduce(0, inv, scores, "amin")
        self.all_equal = (gmax == gmin)[inv]


def _as_id_tensor(group_ids, device) -> Tensor:
    if isinstance(group_ids, Tensor):
        return group_ids.to(device)
    try:
        return torch.as_tensor(group_ids, device=device)
    except (TypeError, ValueError):  # e.g. string uids: map to ints in order of appearance
        index: dict = {}
        return torch.tensor([index.setdefault(u, len(index)) for u in group_ids], device=device)


def _scores(rewards: Tensor, mask: Tensor) -> Tensor:
    return rewards if rewards.dim() == 1 else torch.where(mask.bool(), rewards, torch.zeros_like(rewards)).sum(-1)


def _token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    return scatter_last_token(rewards, mask) if rewards.dim() == 1 else rewards


def _broadcast(per_sample: Tensor, mask: Tensor) -> Tensor:
    return torch.where(mask.bool(), per_sample[:, None].expand(mask.shape), torch.zeros((), dtype=per_sample.dtype))


def _normalise(centred: Tensor, scores: Tensor, groups: _Groups, mode: str, eps: float) -> Tensor:
    if mode == "group":
        return centred / (groups.std + eps)
    if mode == "batch":
        return centred / (scores.std() + eps) if scores.numel() > 1 else centred
    return centred


@register_advantage_estimator("grpo", group=True, std_normalizations=STD_NORMALIZATIONS, default_std="group")
def grpo_advantages(
    rewards, response_mask, *, group_ids, std_normalization="group", eps=1e-6, **_
) -> tuple[Tensor, Tensor]:
    """GRPO outcome advantage (DeepSeekMath, arXiv 2402.03300, Sec. 4.1.2):
    ``A_i = (r_i - mean(r_group)) / (std(r_group) + eps)`` on every token of sample ``i``.
    ``std_normalization="none"`` is Dr.GRPO (arXiv 2503.20783, eq. 3: no std division); ``"batch"`` divides
    by the batch std instead (group mean, batch std). Returns = the sample's reward on its tokens."""
    s = _scores(rewards, response_mask)
    groups = _Groups(s, group_ids, "grpo", min_size=2)
    centred = torch.where(groups.all_equal, torch.zeros_like(s), s - groups.mean)
    adv = _normalise(centred, s, groups, std_normalization, eps)
    return _broadcast(adv, response_mask), _broadcast(s, response_mask)


@register_advantage_estimator("rloo", group=True, std_normalizations=STD_NORMALIZATIONS, default_std="none")
def rloo_advantages(
    rewards, response_mask, *, group_ids, std_normalization="none", eps=1e-6, **_
) -> tuple[Tensor, Tensor]:
    """RLOO (Ahmadian et al. 2024, arXiv 2402.14740, eq. 6; Kool et al. 2019): leave-one-out baseline
    ``A_i = r_i - (1/(k-1)) sum_{j != i} r_j = k/(k-1) (r_i - mean(r_group))``; not std-normalised unless asked."""
    s = _scores(rewards, response_mask)
    groups = _Groups(s, group_ids, "rloo", min_size=2)
    centred = torch.where(groups.all_equal, torch.zeros_like(s), (s - groups.mean) * groups.count / (groups.count - 1))
    adv = _normalise(centred, s, groups, std_normalization, eps)
    return _broadcast(adv, response_mask), _broadcast(s, response_mask)


@register_advantage_estimator("reinforce_plus_plus", group=False, std_normalizations=("batch",), default_std="batch")
def reinforce_plus_plus_advantages(rewards, response_mask, *, gamma=1.0, eps=1e-6, **_) -> tuple[Tensor, Tensor]:
    """REINFORCE++ (Hu 2025, arXiv 2501.03262, eqs. 1-3): token reward (outcome reward on the last token,
    minus a KL penalty if given token-level), discounted return ``G_t``, then global batch whitening
    ``A_t = (G_t - mean_batch G) / (std_batch G + eps)`` over all valid tokens. Needs no groups."""
    m = response_mask.bool()
    returns = discounted_returns(_token_rewards(rewards, m), m, gamma)
    return masked_whiten(returns, m, eps), returns


@register_advantage_estimator(
    "reinforce_plus_plus_baseline", group=True, std_normalizations=("batch",), default_std="batch"
)
def reinforce_plus_plus_baseline_advantages(
    rewards, response_mask, *, group_ids, gamma=1.0, eps=1e-6, **_
) -> tuple[Tensor, Tensor]:
    """REINFORCE++-baseline (arXiv 2501.03262, v3+ Sec. 3, "REINFORCE++ w/ baseline"): subtract the
    prompt group's mean reward from each sample's reward, then as REINFORCE++: return, global whitening."""
    m = response_mask.bool()
    s = _scores(rewards, m)
    groups = _Groups(s, group_ids, "reinforce_plus_plus_baseline", min_size=2)
    centred = torch.where(groups.all_equal, torch.zeros_like(s), s - groups.mean)
    if rewards.dim() == 1:
        token_rewards = scatter_last_token(centred, m)
    else:  # keep the token-level shape (e.g. KL penalties), shift the last token by the baseline
        token_rewards = torch.where(m, rewards, torch.zeros_like(rewards)) + scatter_last_token(centred - s, m)
    returns = discounted_returns(token_rewards, m, gamma)
    return masked_whiten(returns, m, eps), returns


@register_advantage_estimator(
    "gae", group=False, critic=True, std_normalizations=("batch", "none"), default_std="batch"
)
def gae_advantages(
    rewards, response_mask, *, values=None, gamma=1.0, lam=1.0, std_normalization="batch", eps=1e-6, **_
) -> tuple[Tensor, Tensor]:
    """GAE (Schulman et al. 2016, arXiv 1506.02438, eqs. 11-16) for PPO with a critic:
    ``delta_t = r_t + gamma V_{t+1} - V_t``, ``A_t = delta_t + gamma lam A_{t+1}``, ``V`` after the last valid
    token is 0 (the episode ends). Invalid positions (padding, tool output) are skipped: the next valid
    token is the next step. ``returns = A + V`` (before whitening); ``"batch"`` whitens the advantages."""
    if values is None:
        raise ValueError("advantage estimator 'gae' needs values (critic predictions [N, T]); pass values=")
    if values.shape != response_mask.shape:
        raise ValueError(f"gae: values shape {tuple(values.shape)} != response_mask shape {tuple(response_mask.shape)}")
    m = response_mask.bool()
    r = _token_rewards(rewards, m)
    values = values.detach().to(r.dtype)
    adv = torch.zeros_like(r)
    next_value = torch.zeros(r.shape[0], dtype=r.dtype, device=r.device)
    next_adv = torch.zeros_like(next_value)
    for t in reversed(range(r.shape[1])):
        delta = r[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_adv
        valid = m[:, t]
        adv[:, t] = torch.where(valid, a, torch.zeros_like(a))
        next_value = torch.where(valid, values[:, t], next_value)
        next_adv = torch.where(valid, a, next_adv)
    returns = torch.where(m, adv + values, torch.zeros_like(adv))
    if std_normalization == "batch":
        adv = masked_whiten(adv, m, eps)
    return adv, returns


@register_advantage_estimator("cpgd", group=True, std_normalizations=STD_NORMALIZATIONS, default_std="group")
def cpgd_advantages(
    rewards, response_mask, *, group_ids, std_normalization="group", eps=1e-6, **_
) -> tuple[Tensor, Tensor]:
    """CPGD advantage (Liu et al. 2025, arXiv 2505.12504, Sec. 4, "weighted advantage"):
    ``A_i = w(x) (r_i - mean(r_group))`` with the per-prompt weight ``w(x) = 1/(std(r_group) + eps)``
    (``"group"``, default), ``1/(batch std + eps)`` (``"batch"``) or 1 (``"none"``). Numerically the group-
    normalised GRPO advantage; kept as its own name so the CPGD recipe is spelled as the paper does."""
    s = _scores(rewards, response_mask)
    groups = _Groups(s, group_ids, "cpgd", min_size=2)
    centred = torch.where(groups.all_equal, torch.zeros_like(s), s - groups.mean)
    adv = _normalise(centred, s, groups, std_normalization, eps)
    return _broadcast(adv, response_mask), _broadcast(s, response_mask)


def distillation_rewards(teacher_log_probs: Tensor, student_log_probs: Tensor, response_mask: Tensor) -> Tensor:
    """Per-token rewards of on-policy distillation (Agarwal et al. 2024, GKD, arXiv 2306.13649, eq. 4 with the
    student's own samples; Qwen3 technical report arXiv 2505.09388 Sec. 4.5; Lu and Thinking Machines 2025, "On-Policy
    Distillation"): ``r_t = log pi_T(y_t | y_<t) - log pi_S(y_t | y_<t)`` for the token ``y_t`` the student sampled,
    the negative single-sample estimate of the per-token reverse KL ``KL(pi_S || pi_T)``; 0 outside the mask."""
    if teacher_log_probs.shape != student_log_probs.shape or teacher_log_probs.shape != response_mask.shape:
        raise ValueError(
            f"distillation_rewards: teacher {tuple(teacher_log_probs.shape)}, student "
            f"{tuple(student_log_probs.shape)} and mask {tuple(response_mask.shape)} must be one [N, T] shape"
        )
    diff = teacher_log_probs.detach() - student_log_probs.detach()
    return torch.where(response_mask.bool(), diff, torch.zeros_like(diff))


def vocabulary_reverse_kl(student_logits: Tensor, teacher_log_probs: Tensor, temperature: float = 1.0) -> Tensor:
    """The exact per-token reverse KL of on-policy distillation over the whole vocabulary at each sampled position
    (GKD, Agarwal et al. 2024, arXiv 2306.13649, eq. 2 and Sec. 3 with the divergence ``KL(pi_S || pi_T)``, the
    generalized JSD's beta -> 1 end, on the student's own samples): ``D_t = sum_v pi_S(v | y_<t) (log pi_S(v | y_<t)
    - log pi_T(v | y_<t))``, ``pi_S = softmax(student_logits / temperature)``. ``[N, T, V]`` logits and teacher
    log-probs in, ``[N, T]`` out, differentiable in the student's logits (the teacher's are constants). Where
    :func:`distillation_rewards` estimates ``D_t`` from the one sampled token (a policy gradient), this is its
    value: no sampling noise per position, a gradient on every token of the vocabulary."""
    if student_logits.shape != teacher_log_probs.shape:
        raise ValueError(
            f"vocabulary_reverse_kl: student logits {tuple(student_logits.shape)} and teacher log-probs "
            f"{tuple(teacher_log_probs.shape)} must be one [N, T, V] shape"
        )
    dtype = torch.promote_types(student_logits.dtype, torch.float32)  # bf16 logits in float32; float64 kept
    log_s = torch.log_softmax(student_logits.to(dtype) / temperature, dim=-1)
    return (log_s.exp() * (log_s - teacher_log_probs.detach().to(log_s.dtype))).sum(-1)


@register_advantage_estimator("opd", group=False, teacher=True, std_normalizations=("none",), default_std="none")
def opd_advantages(rewards, response_mask, **_) -> tuple[Tensor, Tensor]:
    """On-policy distillation (``algorithm.advantage_estimator: opd``): the advantage of each sampled token is its
    own distillation reward, ``A_t = r_t = log pi_T(y_t) - log pi_S(y_t)`` (:func:`distillation_rewards`, times
    ``teacher.coef``), with no group baseline and no reward-to-go: the per-token reverse KL's policy gradient
    ``-grad KL(pi_S || pi_T) = E_{y ~ pi_S}[sum_t (log pi_T(y_t) - log pi_S(y_t)) grad log pi_S(y_t)]`` with
    the discount 0 of Thinking Machines' recipe (each token answers for its own divergence; the future terms have
    zero mean under the student's sampling). ``rewards`` are token-level ``[N, T]`` (the trainer passes the
    distillation rewards, plus a KL penalty's tokens where one is set); an outcome reward ``[N]`` is refused."""
    if rewards.dim() != 2:
        raise ValueError("advantage estimator 'opd' needs token-level rewards [N, T] (the teacher's per-token terms)")
    adv = torch.where(response_mask, rewards, torch.zeros_like(rewards))
    return adv, adv.clone()


def compute_advantages(
    name: str,
    rewards: Tensor,
    response_mask: Tensor,
    *,
    group_ids: Tensor | Sequence | None = None,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    std_normalization: str | None = None,
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor]:
    """Advantages and returns ``[N, T]`` with the estimator ``name`` (see ``ADVANTAGE_ESTIMATORS``).

    Computed without gradient; float64 inputs stay float64, anything else is computed in float32.
    Raises ValueError for an unknown name, shapes that do not fit, non-finite rewards (naming the
    sample), a missing ``group_ids``/``values`` or a too-small group.
    """
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage_estimator {name!r}; choose one of {', '.join(ADVANTAGE_ESTIMATORS)}")
    spec = ADVANTAGE_ESTIMATORS[name]
    norm = spec.default_std if std_normalization is None else std_normalization
    if norm not in spec.std_normalizations:
        raise ValueError(
            f"std_normalization={norm!r} does not apply to advantage estimator {name!r} "
            f"(accepted: {', '.join(spec.std_normalizations)}; null picks its default {spec.default_std!r})"
        )
    if response_mask.dim() != 2 or rewards.dim() not in (1, 2) or rewards.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"compute_advantages: need rewards [N] or [N, T] and response_mask [N, T]; got rewards "
            f"{tuple(rewards.shape)}, response_mask {tuple(response_mask.shape)}"
        )
    if rewards.dim() == 2 and rewards.shape != response_mask.shape:
        raise ValueError(f"token-level rewards {tuple(rewards.shape)} != response_mask {tuple(response_mask.shape)}")
    dtype = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    rewards = rewards.detach().to(dtype)
    bad = (~torch.isfinite(rewards)).nonzero()
    if bad.numel():
        value = rewards[tuple(bad[0])].item()
        raise ValueError(f"compute_advantages: reward of sample {bad[0, 0].item()} is not finite ({value})")
    with torch.no_grad():
        return spec.fn(
            rewards,
            response_mask.bool(),
            group_ids=group_ids,
            values=values,
            gamma=gamma,
            lam=lam,
            std_normalization=norm,
            eps=eps,
        )
