"""RL algorithms as pure tensor functions: log-probs/entropy, advantages, policy losses, KL, aggregation,
reward shaping, dynamic sampling. No model, no config object, no distributed state (except the
``global_token_count`` / ``global_sequence_count`` collectives). See docs/algorithms.md."""

from vlrft.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    STD_NORMALIZATIONS,
    AdvantageEstimator,
    compute_advantages,
    discounted_returns,
    distillation_rewards,
    register_advantage_estimator,
    vocabulary_reverse_kl,
)
from vlrft.algorithms.aggregation import LOSS_AGG_MODES, aggregate_loss, global_sequence_count, global_token_count
from vlrft.algorithms.dynamic_sampling import (
    DynamicSamplingExhausted,
    filter_zero_variance_groups,
    more_prompts_needed,
)
from vlrft.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    kl_penalty,
)
from vlrft.algorithms.logprobs import entropy_from_logits, high_entropy_mask, logprobs_from_logits
from vlrft.algorithms.policy_losses import (
    POLICY_LOSSES,
    PolicyLoss,
    compute_policy_loss,
    register_policy_loss,
    truncated_is_weights,
    value_loss,
)
from vlrft.algorithms.preference import PREFERENCE_LOSSES, preference_loss, rpo_loss
from vlrft.algorithms.rollout_correction import OFF_POLICY_CORRECTIONS, decoupled_weights
from vlrft.algorithms.sft import sft_loss, shifted_targets
from vlrft.algorithms.shaping import RunningRewardNormalizer, clip_rewards, combine_rewards, overlong_penalty

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "OFF_POLICY_CORRECTIONS",
    "POLICY_LOSSES",
    "PREFERENCE_LOSSES",
    "STD_NORMALIZATIONS",
    "AdaptiveKLController",
    "AdvantageEstimator",
    "DynamicSamplingExhausted",
    "FixedKLController",
    "PolicyLoss",
    "RunningRewardNormalizer",
    "aggregate_loss",
    "apply_kl_penalty",
    "clip_rewards",
    "combine_rewards",
    "compute_advantages",
    "compute_policy_loss",
    "decoupled_weights",
    "discounted_returns",
    "distillation_rewards",
    "vocabulary_reverse_kl",
    "entropy_from_logits",
    "filter_zero_variance_groups",
    "global_sequence_count",
    "global_token_count",
    "high_entropy_mask",
    "kl_penalty",
    "logprobs_from_logits",
    "more_prompts_needed",
    "overlong_penalty",
    "preference_loss",
    "register_advantage_estimator",
    "register_policy_loss",
    "rpo_loss",
    "sft_loss",
    "shifted_targets",
    "truncated_is_weights",
    "value_loss",
]
